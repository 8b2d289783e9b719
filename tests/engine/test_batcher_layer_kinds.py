"""The continuous batcher on every model type the supported-architectures table of docs/layer-kinds.md says it
runs (attention of every kind, KV sharing, chunked attention, linear attention, SSMs, conv and hybrid layers): ragged requests, prompts prefilled in chunks beside other requests' decode steps, each request given the
tokens ``generate`` gives it alone (with the model's default cache)."""

import re

import pytest
from batcher_helpers import alone, assert_pool_empty, requests
from encoder_decoder_models import ENCODER_DECODER_CONFIGS
from layer_kind_models import LAYER_KIND_CONFIGS
from repo_paths import DOCS
from tiny_models import TINY_CONFIGS, tiny_model

from hf_paged_cache import ContinuousBatcher


def batched_types() -> list[str]:
    """The decoder-only model types whose row in the table says ``yes`` under `ContinuousBatcher` (the
    encoder-decoder ones take encoder inputs: tests/engine/test_batcher_encoder_decoder.py runs them)."""
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|.*\| (yes|refused[^|]*|-) \|$", (DOCS / "layer-kinds.md").read_text(), re.M)
    batched = {model_type for model_type, batcher in rows if batcher == "yes"}
    return sorted(batched - set(ENCODER_DECODER_CONFIGS))


BATCHED = batched_types()


def test_the_table_names_every_model_the_tests_build():
    assert set(BATCHED) <= {*TINY_CONFIGS, *LAYER_KIND_CONFIGS} and len(BATCHED) >= 40


@pytest.mark.parametrize("model_type", BATCHED)
def test_each_request_gets_what_generate_gives_it_alone(model_type):
    model = tiny_model(model_type)
    work = requests(5, seed=3)
    expected = [alone(model, prompt, max_new_tokens=new, min_new_tokens=new) for prompt, new in work]
    with ContinuousBatcher(model, block_size=4, max_step_tokens=24, max_running=3) as batcher:
        handles = [batcher.submit(prompt, max_new_tokens=new, min_new_tokens=new) for prompt, new in work]
        assert [handle.result(timeout=120) for handle in handles] == expected
    assert_pool_empty(batcher)
