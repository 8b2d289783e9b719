"""The server on an image-text model (a tiny random LLaVA with its processor), as users meet it: chat messages
with base64 images through the official client, each answer the one ``generate`` gives the processor's inputs;
two images give two answers, the same image twice the same answer and a prefix hit in ``/metrics``; images the
server refuses (malformed, too many, a URL it may not fetch) get a 400 naming the problem."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch
from json_tokenizer import save_json_tokenizer
from PIL import Image
from server_process import KEY, NAME, metric, metrics_text, run_server
from transformers import AutoProcessor, AutoTokenizer, CLIPImageProcessor, LlavaForConditionalGeneration, LlavaProcessor
from vision_models import tiny_llava

from hf_paged_cache.kernels import pack_linears

openai = pytest.importorskip("openai")

TEMPLATE = ("{% for message in messages %}{{ message.role }}: {% if message.content is string %}{{ message.content }}"
            "{% else %}{% for part in message.content %}{% if part.type == 'image' %}<image>{% else %}{{ part.text }}"
            "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
MAX_IMAGES = 2


def save_llava(path):
    """A tiny random LLaVA (32x32 images in 16 patches) with a processor: the JSON-capable character tokenizer plus
    an ``<image>`` token (id 96) and a chat template that writes one per image part."""
    tokenizer = AutoTokenizer.from_pretrained(save_json_tokenizer(path / "tokenizer"))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                   vision_feature_select_strategy="default", image_token="<image>", num_additional_image_tokens=1,
                   chat_template=TEMPLATE).save_pretrained(path)
    model = tiny_llava(image_token=96, max_positions=512)  # the tokenizer's <image>
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    return path


def png(colour: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> str:
    """A data URL of a PNG: `colour`, with a diagonal stripe."""
    image = Image.new("RGB", size, colour)
    for x in range(min(size)):
        image.putpixel((x, x), (255 - colour[0], 255 - colour[1], 255 - colour[2]))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def message(text: str, *urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = save_llava(tmp_path_factory.mktemp("tiny-llava"))
    with run_server(path, path / "server.log", "--max-images", str(MAX_IMAGES)) as server:
        model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        pack_linears(model)  # as the server does (--packed-linears)
        yield server, model, AutoProcessor.from_pretrained(path)


def reference(model, processor, messages: list[dict], max_tokens: int) -> str:
    """What ``generate`` answers the processor's inputs for `messages` (images decoded from their data URLs)."""
    images, template_messages = [], []
    for entry in messages:
        if isinstance(entry["content"], str):
            template_messages.append(entry)
            continue
        parts = []
        for part in entry["content"]:
            if part["type"] == "image_url":
                data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
                images.append(Image.open(io.BytesIO(data)).convert("RGB"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        template_messages.append({"role": entry["role"], "content": parts})
    text = processor.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=[2])
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def chat(server, messages: list[dict], max_tokens: int = 10) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens, temperature=0)
    return answer.choices[0].message.content


def test_an_image_is_read_through_the_models_processor(served):
    server, model, processor = served
    red, blue = message("what is this?", png((200, 10, 10))), message("what is this?", png((10, 10, 200)))
    expected = [reference(model, processor, red, 10), reference(model, processor, blue, 10)]
    assert expected[0] != expected[1]  # the same words, other pixels: other answers
    assert [chat(server, red), chat(server, blue)] == expected
    both = message("and these?", png((200, 10, 10)), png((10, 200, 10), size=(64, 64)))
    assert chat(server, both) == reference(model, processor, both, 10)
    text_only = [{"role": "user", "content": "no picture here"}]
    assert chat(server, text_only) == reference(model, processor, text_only, 10)


def test_the_same_image_again_is_a_prefix_hit(served):
    server, *_ = served
    first = message("describe the colours of this picture, please", png((30, 140, 90)))
    hits = metric(metrics_text(server), "hf_paged_cache_prefix_cache_hit_tokens_total")
    answer = chat(server, first)
    after_first = metric(metrics_text(server), "hf_paged_cache_prefix_cache_hit_tokens_total")
    assert chat(server, first) == answer
    after_again = metric(metrics_text(server), "hf_paged_cache_prefix_cache_hit_tokens_total")
    assert after_first == hits and after_again - after_first >= 48  # its blocks, the image's included
    other = message("describe the colours of this picture, please", png((90, 30, 140)))
    chat(server, other)  # the same placeholders, another image: nothing past the text before it
    assert metric(metrics_text(server), "hf_paged_cache_prefix_cache_hit_tokens_total") - after_again < 16


@pytest.mark.parametrize(("url_or_urls", "words"), [
    ("data:image/png;base64,not-base64!", "image 0"),
    ("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), "image 0"),
    ("http://127.0.0.1:9/picture.png", "--allow-image-urls"),
    ("file:///etc/passwd", "image 0"),
    ([png((1, 2, 3))] * (MAX_IMAGES + 1), f"at most {MAX_IMAGES}"),
])
def test_refused_images_get_a_400_naming_the_problem(served, url_or_urls, words):
    server, *_ = served
    urls = url_or_urls if isinstance(url_or_urls, list) else [url_or_urls]
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": NAME, "messages": message("hi", *urls), "max_tokens": 2}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == "messages"
