"""The continuous batcher on encoder-decoder models (T5, BART, Marian, Whisper): each request's encoder input
(source token ids of its own length, or log-mel features) is encoded when its prompt runs, its cross-attention
keys and values go to the cross-attention pool once, and its decoder rows join the running batch beside other
requests' rows; every request gets the tokens ``generate`` gives it alone, through cancellations, preemption,
faults of its own and the choices of one prompt. Both pools are empty at the end."""

import pytest
import torch
from batcher_helpers import wait_until
from encoder_decoder_models import ENCODER_DECODER_CONFIGS, VOCAB, tiny_seq2seq
from faults import Force, Injected, RaiseInChoice, fail_next

from hf_paged_cache import ContinuousBatcher, PoolExhaustedError, RequestCancelled

MODEL_TYPES = list(ENCODER_DECODER_CONFIGS)


def work(model_type: str, count: int, seed: int = 1) -> list[tuple[dict, int]]:
    """`count` requests: an encoder input (token ids of 3 to 13 positions; Whisper: features) and a length."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        if model_type == "whisper":
            encoder = {"input_features": torch.randn(16, 32, generator=generator)}
        else:
            length = int(torch.randint(3, 14, (1,), generator=generator))
            encoder = {"input_ids": torch.randint(3, VOCAB - 3, (length,), generator=generator).tolist()}
        out.append((encoder, 2 + (5 * i) % 11))
    return out


def alone(model, encoder: dict, **kwargs) -> torch.Tensor:
    """What ``generate`` with the model's default cache gives this request alone: its sequence output (new tokens,
    and the logits of each)."""
    inputs = ({"input_features": encoder["input_features"][None]} if "input_features" in encoder
              else {"input_ids": torch.tensor([encoder["input_ids"]])})
    kwargs.setdefault("do_sample", False)
    return model.generate(**inputs, return_dict_in_generate=True, output_logits=True, **kwargs)


def new_tokens(model, output) -> list[int]:
    """The decoder's new tokens of a generate output (after its start token)."""
    return output.sequences[0, 1:].tolist()


def submit(batcher, encoder: dict, **kwargs):
    if "input_features" in encoder:
        return batcher.submit(input_features=encoder["input_features"], **kwargs)
    return batcher.submit(encoder["input_ids"], **kwargs)


def assert_pools_empty(batcher):
    assert batcher.pool.blocks.num_used == 0
    assert batcher.running_cache.cross_attention_cache.pool.blocks.num_used == 0


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_each_request_gets_what_generate_gives_it_alone(model_type):
    model = tiny_seq2seq(model_type)
    requests = work(model_type, 7)
    expected = [alone(model, encoder, max_new_tokens=new, min_new_tokens=new) for encoder, new in requests]
    with ContinuousBatcher(model, block_size=4, max_running=3) as batcher:
        handles = [submit(batcher, encoder, max_new_tokens=new, min_new_tokens=new, logprobs=0)
                   for encoder, new in requests]
        for handle, reference in zip(handles, expected):
            assert handle.result(timeout=120) == new_tokens(model, reference)
            for step, (ours, logits) in enumerate(zip(handle.logprobs, reference.logits, strict=True)):
                theirs = torch.log_softmax(logits[0].float(), -1)[ours.token]
                assert abs(ours.logprob - float(theirs)) < 1e-5, f"step {step}"
        assert batcher.stats().finished == len(requests)
    assert_pools_empty(batcher)


def test_rows_of_different_encoder_lengths_decode_in_one_step():
    model = tiny_seq2seq("bart")
    requests = [({"input_ids": list(range(3, 3 + length))}, 6) for length in (3, 11, 7)]
    expected = [new_tokens(model, alone(model, encoder, max_new_tokens=6, min_new_tokens=6))
                for encoder, _ in requests]
    with ContinuousBatcher(model, block_size=4) as batcher:
        handles = [submit(batcher, encoder, max_new_tokens=new, min_new_tokens=new) for encoder, new in requests]
        assert [handle.result(timeout=60) for handle in handles] == expected
        cross = batcher.running_cache.cross_attention_cache
        assert cross.batch_size == 0 and cross.lengths == []
        assert batcher.stats().steps.decode_rows > batcher.stats().steps.decode_steps  # rows ran together


def test_a_decoder_prompt_and_sampling_choices_share_the_request_encoder_output():
    model = tiny_seq2seq("t5")
    encoder, prompt = {"input_ids": [5, 9, 14, 20, 33]}, [0, 7, 12]
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=True, top_k=20)
    with ContinuousBatcher(model, block_size=4) as batcher:
        group = batcher.submit_group(encoder["input_ids"], 3, decoder_input_ids=prompt, seed=11, **settings)
        grouped = [handle.result(timeout=60) for handle in group]
        apart = [batcher.submit(encoder["input_ids"], decoder_input_ids=prompt, seed=11 + i, **settings).result(60)
                 for i in range(3)]
    assert grouped == apart and len(set(map(tuple, grouped))) > 1
    greedy = alone(model, encoder, decoder_input_ids=torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8)
    with ContinuousBatcher(model, block_size=4) as batcher:
        ours = batcher.submit(encoder["input_ids"], decoder_input_ids=prompt, max_new_tokens=8, min_new_tokens=8)
        assert ours.result(timeout=60) == greedy.sequences[0, len(prompt):].tolist()
    assert_pools_empty(batcher)


def test_cancelled_requests_leave_and_the_others_stay_exact():
    model = tiny_seq2seq("marian")
    requests = work("marian", 6, seed=4)
    expected = [new_tokens(model, alone(model, encoder, max_new_tokens=20, min_new_tokens=20))
                for encoder, _ in requests]
    with ContinuousBatcher(model, block_size=4) as batcher:
        handles = [submit(batcher, encoder, max_new_tokens=20, min_new_tokens=20) for encoder, _ in requests]
        for handle in handles[::2]:
            next(iter(handle))  # its first token came: it is running
            handle.cancel()
        for index, handle in enumerate(handles):
            if index % 2:
                assert handle.result(timeout=60) == expected[index]
            else:
                streamed = []
                with pytest.raises(RequestCancelled):
                    streamed.extend(handle)
                assert 1 <= len(streamed) < 20 and streamed == expected[index][: len(streamed)]
        wait_until(lambda: batcher.stats().running == 0)
    assert_pools_empty(batcher)


def test_preempted_requests_are_computed_again_exactly():
    model = tiny_seq2seq("bart")
    requests = work("bart", 6, seed=2)
    expected = [new_tokens(model, alone(model, encoder, max_new_tokens=24, min_new_tokens=24))
                for encoder, _ in requests]
    with ContinuousBatcher(model, block_size=4, num_blocks=24, reserve_new_tokens=False) as batcher:
        handles = [submit(batcher, encoder, max_new_tokens=24, min_new_tokens=24) for encoder, _ in requests]
        assert [handle.result(timeout=120) for handle in handles] == expected
        assert batcher.stats().preemptions > 0
    assert_pools_empty(batcher)


def test_a_fixed_pool_admits_by_look_ahead_and_a_request_larger_than_the_cross_attention_pool_fails():
    model = tiny_seq2seq("bart")
    requests = work("bart", 5, seed=6)
    expected = [new_tokens(model, alone(model, encoder, max_new_tokens=12, min_new_tokens=12))
                for encoder, _ in requests]
    with ContinuousBatcher(model, block_size=4, num_blocks=20) as batcher:  # reserve_new_tokens: the default
        handles = [submit(batcher, encoder, max_new_tokens=12, min_new_tokens=12) for encoder, _ in requests]
        assert [handle.result(timeout=60) for handle in handles] == expected
    whisper = tiny_seq2seq("whisper")  # 16 encoder positions: 4 blocks of 4 a request
    with ContinuousBatcher(whisper, block_size=4, max_memory="32KiB") as batcher:  # a cross-attention pool of 1
        assert batcher.running_cache.cross_attention_cache.pool.blocks.capacity < 4
        handle = batcher.submit(input_features=torch.zeros(16, 32), max_new_tokens=2)
        with pytest.raises(PoolExhaustedError, match="cross attention"):
            handle.result(timeout=60)  # refused, not sent back to the queue for ever
    assert_pools_empty(batcher)


def test_a_request_that_breaks_the_decoder_fails_alone():
    model = tiny_seq2seq("whisper")
    requests = work("whisper", 4, seed=5)
    expected = [new_tokens(model, alone(model, encoder, max_new_tokens=10, min_new_tokens=10))
                for encoder, _ in requests]
    bad_token = VOCAB - 5

    def refuse(module, args, kwargs):  # the decoder refuses one token: the request that picks it breaks its row
        ids = kwargs.get("input_ids")
        if ids is not None and bool((ids == bad_token).any()):
            raise Injected("the decoder refuses this token")

    hook = model.get_decoder().register_forward_pre_hook(refuse, with_kwargs=True)
    transient = fail_next(model.get_encoder(), times=1)  # the first encoder forward fails: it costs nobody anything
    try:
        with ContinuousBatcher(model, block_size=4) as batcher:
            handles = []
            for index, (encoder, _) in enumerate(requests):
                # request 1 is made to pick the refused token at its 3rd step; request 2's first choice raises once
                processors = [Force(bad_token, 3, 1)] if index == 1 else [RaiseInChoice(1 if index == 2 else 0)]
                handles.append(submit(batcher, encoder, max_new_tokens=10, min_new_tokens=10,
                                      logits_processor=processors))
            for index, handle in enumerate(handles):
                if index == 1:
                    with pytest.raises(Injected, match="refuses"):
                        handle.result(timeout=60)
                else:
                    assert handle.result(timeout=60) == expected[index]
    finally:
        hook.remove()
        transient.remove()
    assert transient.fired == 1
    assert_pools_empty(batcher)


def test_refusals_name_the_model_and_the_argument():
    model = tiny_seq2seq("t5")
    with pytest.raises(NotImplementedError, match="speculative decoding is not supported on T5"):
        ContinuousBatcher(model, speculative="ngram")
    with ContinuousBatcher(model) as batcher:
        with pytest.raises(ValueError, match="needs the encoder's input_ids"):
            batcher.submit()
        with pytest.raises(ValueError, match="reads token ids, not input_features"):
            batcher.submit([3, 4], input_features=torch.zeros(16, 32))
        with pytest.raises(ValueError, match="below 96"):
            batcher.submit([3, VOCAB])
    whisper = tiny_seq2seq("whisper")
    with ContinuousBatcher(whisper) as batcher:
        with pytest.raises(ValueError, match=r"float tensor \[16, frames\]"):
            batcher.submit(input_features=torch.zeros(80, 32))
        with pytest.raises(ValueError, match="not token ids"):
            batcher.submit([3, 4])
