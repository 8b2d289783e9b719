"""An image-text model (a tiny random LLaVA) through ``generate(cache=PagedCache(model))``: an image's patches sit
behind placeholder tokens that every image shares, so token ids alone must neither make rows share blocks nor key
blocks by prefix."""

import pytest
import torch
from vision_models import tiny_llava

from hf_paged_cache import PagedCache

IMAGE_TOKEN = 100
GREEDY = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)


@pytest.fixture(scope="module")
def llava():
    return tiny_llava(IMAGE_TOKEN)


def prompt(rows: int) -> torch.Tensor:
    """``[rows, 21]`` the same prompt in every row: 2 tokens, an image's 16 placeholders, 3 tokens."""
    return torch.tensor([[5, 6] + [IMAGE_TOKEN] * 16 + [7, 8, 9]] * rows)


def test_the_same_prompt_with_other_images_shares_no_block_and_is_exact(llava):
    ids, pixels = prompt(2), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    reference = llava.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels, **GREEDY)
    assert not torch.equal(reference.logits[0][0], reference.logits[0][1])  # the images make the answers differ
    with PagedCache(llava) as cache:
        paged = llava.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels, cache=cache,
                               **GREEDY)
        first, second = cache.block_tables.tables
        assert not set(first) & set(second)  # each row its own blocks: the placeholders are not the image
    assert torch.equal(paged.sequences, reference.sequences)
    for ours, theirs in zip(paged.logits, reference.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_blocks_behind_an_image_are_not_found_by_prefix(llava):
    ids, pixels = prompt(1), torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with PagedCache(llava) as cache:
        llava.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels, cache=cache,
                       max_new_tokens=4, do_sample=False)
    assert cache.pool.blocks.prefix_stats().cached_blocks == 0
    with PagedCache(llava, pool=cache.pool) as again:
        assert again.reuse_prefix(ids) == 0  # another image behind the same placeholders must not find them
