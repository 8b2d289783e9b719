"""The continuous batcher on an image-text model (a tiny random LLaVA): requests carry their processor's pixels,
prefill their images in one forward of their own beside other requests' rows, and get what ``generate`` gives
each alone; an image's blocks are found again by a digest of the image, never by its placeholders alone."""

import pytest
import torch
from vision_models import tiny_llava

from hf_paged_cache import ContinuousBatcher

IMAGE = 100
BLOCK = 4


@pytest.fixture(scope="module")
def llava():
    return tiny_llava(IMAGE)


def pixels(seed: int) -> torch.Tensor:
    return torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def prompt(before: list[int], after: list[int]) -> list[int]:
    return [*before, *[IMAGE] * 16, *after]


def alone(model, ids: list[int], image: torch.Tensor, new: int = 8) -> list[int]:
    tensor = torch.tensor([ids])
    out = model.generate(input_ids=tensor, attention_mask=torch.ones_like(tensor), pixel_values=image,
                         max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


def test_requests_with_images_get_what_generate_gives_each_alone(llava):
    work = [(prompt([5, 6], [7, 8, 9]), pixels(1)), (prompt([5, 6], [7, 8, 9]), pixels(2)),
            (prompt([11] * 9, [3]), pixels(3)), (list(range(20, 31)), None)]
    expected = [alone(llava, ids, image) if image is not None else
                llava.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8,
                               do_sample=False)[0, len(ids):].tolist() for ids, image in work]
    assert expected[0] != expected[1]  # the same placeholders, other pixels: other answers
    with ContinuousBatcher(llava, block_size=BLOCK, max_step_tokens=8) as batcher:
        handles = [batcher.submit(ids, max_new_tokens=8, min_new_tokens=8,
                                  **({"multimodal_inputs": {"pixel_values": image}} if image is not None else {}))
                   for ids, image in work]
        assert [handle.result(timeout=60) for handle in handles] == expected
        steps = batcher.stats().steps
        assert steps.prompt_tokens >= sum(len(ids) for ids, _ in work)  # each image's prompt whole in one chunk
    assert batcher.pool.blocks.num_used == 0


def test_the_same_image_again_is_a_prefix_hit_and_another_is_not(llava):
    ids = prompt([5, 6], [7, 8, 9])  # 21 tokens: the image's placeholders end at 18
    with ContinuousBatcher(llava, block_size=BLOCK) as batcher:
        first = batcher.submit(ids, max_new_tokens=6, multimodal_inputs={"pixel_values": pixels(1)}).result(60)
        assert batcher.stats().prefix_hit_tokens == 0
        again = batcher.submit(ids, max_new_tokens=6, multimodal_inputs={"pixel_values": pixels(1)}).result(60)
        assert again == first and batcher.stats().prefix_hit_tokens == 20  # every full block, the image's included
        other = batcher.submit(ids, max_new_tokens=6, multimodal_inputs={"pixel_values": pixels(2)}).result(60)
        assert other == alone(llava, ids, pixels(2), 6) and batcher.stats().prefix_hit_tokens == 20
        turn = [*ids, *first, 40, 41]  # a follow-up turn on the same image
        follow = batcher.submit(turn, max_new_tokens=6, multimodal_inputs={"pixel_values": pixels(1)}).result(60)
        assert follow == alone(llava, turn, pixels(1), 6)
        assert batcher.stats().prefix_hit_tokens > 40


def test_digests_name_the_images(llava):
    ids = prompt([5, 6], [7, 8, 9])
    with ContinuousBatcher(llava, block_size=BLOCK) as batcher:
        batcher.submit(ids, max_new_tokens=2, multimodal_inputs={"pixel_values": pixels(1)},
                       image_digests=["cat"]).result(60)
        # other pixels under the same digest are taken for the same image: the digest is the caller's word
        batcher.submit(ids, max_new_tokens=2, multimodal_inputs={"pixel_values": pixels(2)},
                       image_digests=["cat"]).result(60)
        assert batcher.stats().prefix_hit_tokens == 20
        with pytest.raises(ValueError, match="no image placeholder"):
            batcher.submit([5, 6, 7], multimodal_inputs={"pixel_values": pixels(1)})
