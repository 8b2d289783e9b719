"""submit() refuses, with a ValueError naming the argument, what would fail later or what the batcher cannot do."""

import pytest
import torch
from batcher_helpers import alone, assert_pool_empty
from tiny_models import VOCAB, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from hf_paged_cache import ContinuousBatcher

PROMPT = [5, 6, 7, 8]


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(bad_words_ids=[[3], [VOCAB + 4]]), "bad_words_ids: token id 100"),
        (dict(suppress_tokens=[VOCAB]), "suppress_tokens: token id 96"),
        (dict(begin_suppress_tokens=[-1]), "begin_suppress_tokens: token id -1"),
        (dict(eos_token_id=[3, VOCAB + 1]), "eos_token_id: token id 97"),
        (dict(forced_eos_token_id=VOCAB), "forced_eos_token_id"),
        (dict(sequence_bias={(VOCAB,): 1.0}), "sequence_bias"),
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, temperature=-1.0), "temperature"),
        (dict(do_sample=True, temperature=float("nan")), "temperature"),
        (dict(do_sample=True, temperature=1e-45), "temperature must be a finite number > 0 whose reciprocal"),
        (dict(do_sample=True, top_p=0.0), "top_p"),
        (dict(do_sample=True, top_p=1.5), "top_p"),
        (dict(do_sample=True, top_k=-1), "top_k"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=253), "257 positions, past the model's 256"),
        (dict(num_beams=4), "not beam_search"),
        (dict(penalty_alpha=0.6, top_k=4), "not contrastive_search"),
        (dict(prompt_lookup_num_tokens=3), "not assisted_generation"),
        (dict(num_return_sequences=2), "num_return_sequences"),  # transformers' own check (greedy)
        (dict(do_sample=True, num_return_sequences=2), "num_return_sequences=2"),
        (dict(output_scores=True), "output_scores=True"),
        (dict(return_dict_in_generate=True), "return_dict_in_generate=True"),
        (dict(use_cache=False), "use_cache=False"),
        (dict(assistant_model="draft"), "assistant_model="),
        (dict(streamer=object()), "streamer="),
        (dict(attention_mask=torch.ones(1, 4)), "attention_mask="),
        (dict(prefill_chunk_size=8), "prefill_chunk_size=8"),
    ],
)
def test_submit_names_the_argument(kwargs, named):
    model = tiny_model("llama")
    with ContinuousBatcher(model, block_size=4) as batcher:
        with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
            batcher.submit(PROMPT, **{"max_new_tokens": 3, **kwargs})
        assert batcher.stats().waiting == 0  # nothing was queued
        assert batcher.generate([PROMPT], max_new_tokens=3) == [alone(model, PROMPT, max_new_tokens=3)]
    assert_pool_empty(batcher)


def test_prompt_ids_outside_the_vocabulary_and_unknown_arguments():
    model = tiny_model("llama")
    with ContinuousBatcher(model, block_size=4) as batcher:
        with pytest.raises(ValueError, match="input_ids: token id 96 is outside the model's vocabulary of 96"):
            batcher.submit([5, VOCAB], max_new_tokens=2)
        with pytest.raises(TypeError, match="unknown generation argument.*max_new_tokenz"):
            batcher.submit(PROMPT, max_new_tokenz=3)
        with pytest.raises(ValueError, match="max_length=3 leaves nothing to generate"):
            batcher.submit(PROMPT, max_length=3)


def test_a_prompt_past_gpt2s_position_table_is_refused_and_the_others_are_exact():
    """GPT-2 learns 64 positions: a prompt that would run past them used to fail every request in flight
    (an index error in the position embedding); now submit refuses it."""
    config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                  bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with ContinuousBatcher(model, block_size=4) as batcher:
        with pytest.raises(ValueError, match="70 positions, past the model's 64"):
            batcher.submit(list(range(3, 63)), max_new_tokens=10)
        fine = [list(range(3, 40)), list(range(10, 50))]  # still decoding when the long one would pass 64
        assert batcher.generate(fine, max_new_tokens=12) == [alone(model, p, max_new_tokens=12) for p in fine]
    assert_pool_empty(batcher)


def test_generation_config_logits_processor_and_stopping_criteria_as_generate_takes_them():
    from transformers import LogitsProcessorList, StoppingCriteriaList
    from transformers.generation import MaxLengthCriteria, MinLengthLogitsProcessor

    model = tiny_model("llama")
    config = GenerationConfig(max_new_tokens=6, do_sample=False, repetition_penalty=1.3)
    first = alone(model, PROMPT, max_new_tokens=6, repetition_penalty=1.3)
    processors = LogitsProcessorList([MinLengthLogitsProcessor(7, eos_token_id=first[0])])  # bans first[0] once
    criteria = StoppingCriteriaList([MaxLengthCriteria(len(PROMPT) + 3)])
    with ContinuousBatcher(model, block_size=4) as batcher:
        assert batcher.submit(PROMPT, generation_config=config).result(timeout=60) == first
        got = batcher.submit(PROMPT, generation_config=config, logits_processor=processors,
                             stopping_criteria=criteria).result(timeout=60)
    ids = torch.tensor([PROMPT])
    expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                              logits_processor=processors, stopping_criteria=criteria)[0, len(PROMPT):].tolist()
    assert got == expected and len(got) == 3
