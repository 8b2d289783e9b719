"""Nothing corrupts, leaks or silently changes results: failed forwards, shared pools, dropped caches, odd arguments."""

import copy
import gc
import pickle
import threading

import pytest
import torch
from tiny_models import ragged_batch, tiny_model
from transformers import DynamicCache

from hf_paged_cache import KVPool, PagedCache, set_paged_attention

ARCHITECTURES = ["llama", "gemma3_text", "gpt2"]  # rotary + GQA, hybrid sliding/full layers, learned positions


class Injected(Exception):
    """The failure a test injects in the middle of a forward."""


def attention_modules(model):
    """The model's attention modules, in layer order (each holds its `layer_idx`)."""
    found = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    return sorted(found, key=lambda m: m.layer_idx)


def fail_in_layer(model, layer, after_update, error=Injected):
    """Make layer `layer`'s attention raise, before or after it updates the cache, on the next forward.

    `layer` may also be ``"head"``: the LM head raises, after every layer has written the step.
    """

    def raise_now(*args):
        remove()
        raise error(f"injected in layer {layer}")

    module = model.get_output_embeddings() if layer == "head" else attention_modules(model)[layer]
    handle = module.register_forward_hook(raise_now) if after_update else module.register_forward_pre_hook(raise_now)

    def remove():
        handle.remove()

    return handle


def greedy(model, cache, batch, new_tokens=6):
    return model.generate(
        **batch, cache=cache, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
        output_scores=True,
    )


def assert_same(reference, paged):
    torch.testing.assert_close(paged.sequences, reference.sequences, rtol=0, atol=0)
    for ours, theirs in zip(paged.scores, reference.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def held_blocks(pool):
    return pool.blocks.num_used


DECODE_STEP = {"input_ids": torch.tensor([[5], [6]]), "attention_mask": torch.ones(2, 21, dtype=torch.long)}
"""One decode step after `ragged_batch([0, 3], 20)`."""


def assert_same_step(model, batch, step, paged):
    """`paged`'s logits equal those of `step` after `batch` on a DynamicCache."""
    dense = DynamicCache(config=model.config)
    with torch.no_grad():
        model(**batch, cache=dense, use_cache=True)
        expected = model(**step, cache=dense, use_cache=True)
    torch.testing.assert_close(paged.logits, expected.logits, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- atomic steps


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_failed_forward_at_any_layer_leaves_the_cache_and_prefix_index_as_before(model_type):
    model = tiny_model(model_type)
    prompt = {"input_ids": ragged_batch([0], 40, seed=3)["input_ids"]}
    prompt["attention_mask"] = torch.ones_like(prompt["input_ids"])
    reference = greedy(model, DynamicCache(config=model.config), prompt)
    layers = len(attention_modules(model))
    # "head": after the last layer's update, every layer has written the step; the forward still fails, and
    # the model's forward hook rolls the step back (it failed before this change)
    for layer in [*range(layers), "head"]:
        for after_update in (False, True):
            pool = KVPool.for_config(model.config, num_blocks=64)
            with PagedCache(model, pool=pool) as cache:
                handle = fail_in_layer(model, layer, after_update)
                with pytest.raises(Injected):
                    greedy(model, cache, prompt)
                handle.remove()
                assert cache.get_seq_length() == 0 and cache.batch_size == 0
                assert held_blocks(pool) == 0  # the step's blocks went back
                assert pool.blocks.prefix_stats().cached_blocks == 0  # and nothing half-written was registered
            with PagedCache(model, pool=pool) as cache:
                assert cache.reuse_prefix(prompt["input_ids"]) == 0
                assert_same(reference, greedy(model, cache, prompt))  # the pool just works again
            with PagedCache(model, pool=pool) as cache:  # and a later request reuses the complete blocks
                assert cache.reuse_prefix(prompt["input_ids"]) == 32
                assert_same(reference, greedy(model, cache, prompt))
            assert held_blocks(pool) == 0


@pytest.mark.parametrize("error", [KeyboardInterrupt, Injected])
def test_interrupted_decode_step_rolls_back_to_the_previous_token(error):
    model = tiny_model("llama")
    batch = ragged_batch([0, 3], 20, seed=1)
    with PagedCache(model, num_blocks=32) as cache:
        with torch.no_grad():
            model(**batch, cache=cache, use_cache=True)
            before = (cache.get_seq_length(), [list(t) for t in cache.block_tables.tables], held_blocks(cache.pool))
            step = DECODE_STEP
            fail_in_layer(model, 1, after_update=False, error=error)
            with pytest.raises(error):
                model(**step, cache=cache, use_cache=True)
            # rolled back: an exception by the model's forward hook at once, a KeyboardInterrupt (which no hook
            # sees) by this read on the same thread; no crop() or reset() needed
            assert (cache.get_seq_length(), cache.block_tables.tables, held_blocks(cache.pool)) == before
            paged = model(**step, cache=cache, use_cache=True)
    assert_same_step(model, batch, step, paged)


def test_readers_on_another_thread_see_the_last_committed_step_and_change_nothing():
    """stats(), get_seq_length(), repr(), is_real, block_tables and layers[i].keys read from another thread in
    the middle of a forward: each sees the cache before the step and leaves the step alone (before this
    change they rolled the step back under the forward's feet)."""
    model, batch, step = tiny_model("llama"), ragged_batch([0, 3], 20, seed=1), DECODE_STEP
    seen = {}

    def read(cache):
        seen.update(length=cache.get_seq_length(), stats=cache.stats(), text=repr(cache), rows=cache.batch_size,
                    mask=cache.is_real.clone(), tables=cache.block_tables.tables, keys=cache.layers[0].keys)

    with PagedCache(model, num_blocks=32) as cache, torch.no_grad():
        model(**batch, cache=cache, use_cache=True)
        before = dict(length=20, stats=cache.stats(), text=repr(cache), rows=2, mask=cache.is_real.clone(),
                      tables=cache.block_tables.tables, keys=cache.layers[0].keys)

        def read_elsewhere(*args):  # after layer 1 has written the step
            reader = threading.Thread(target=read, args=(cache,))
            reader.start()
            reader.join()

        handle = attention_modules(model)[1].register_forward_hook(read_elsewhere)
        paged = model(**step, cache=cache, use_cache=True)
        handle.remove()
        assert cache.get_seq_length() == 21
    assert seen.pop("keys").equal(before.pop("keys")) and seen.pop("mask").equal(before.pop("mask"))
    assert seen == before
    assert_same_step(model, batch, step, paged)


def test_manual_commit_keeps_a_forward_pending_until_commit_or_settle():
    model, batch, step = tiny_model("llama"), ragged_batch([0, 3], 20, seed=1), DECODE_STEP
    with PagedCache(model, num_blocks=32, manual_commit=True) as cache, torch.no_grad():
        model(**batch, cache=cache, use_cache=True)
        assert (cache.get_seq_length(), cache.batch_size) == (0, 0)  # pending: readers see the cache before it
        assert held_blocks(cache.pool) == 2 + 2  # its blocks are taken: 20 and 17 tokens
        cache.settle()  # dropped
        assert held_blocks(cache.pool) == 0
        model(**batch, cache=cache, use_cache=True)
        cache.commit()
        assert (cache.get_seq_length(), cache.batch_size) == (20, 2)
        model(**step, cache=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="awaits commit"):  # a second forward would bury the first
            model(**step, cache=cache, use_cache=True)
        assert cache.get_seq_length() == 20  # the refused forward dropped the pending one: nothing is half-kept
        paged = model(**step, cache=cache, use_cache=True)
        cache.commit()
    assert_same_step(model, batch, step, paged)


def test_output_attentions_error_does_not_poison_the_prefix_cache():
    model = tiny_model("llama")
    set_paged_attention(model)
    prompt = ragged_batch([0], 40, seed=5)
    pool = KVPool.for_config(model.config, num_blocks=64)
    with PagedCache(model, pool=pool) as cache, pytest.raises(NotImplementedError):
        model.generate(**prompt, cache=cache, max_new_tokens=4, do_sample=False, output_attentions=True,
                       return_dict_in_generate=True)
    assert pool.blocks.prefix_stats().cached_blocks == 0
    reference = greedy(model, DynamicCache(config=model.config), prompt)
    with PagedCache(model, pool=pool) as cache:
        assert cache.reuse_prefix(prompt["input_ids"]) == 0
        assert_same(reference, greedy(model, cache, prompt))


# ------------------------------------------------------------------------------------------ sound prefix keys


def test_prefix_keys_bind_the_model_that_computed_the_blocks():
    model_a, model_b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)  # same config, other weights
    prompt = ragged_batch([0], 40, seed=2)
    pool = KVPool.for_config(model_a.config, num_blocks=64)
    with PagedCache(model_a, pool=pool) as cache:
        greedy(model_a, cache, prompt)
    reference = greedy(model_b, DynamicCache(config=model_b.config), prompt)
    with PagedCache(model_b, pool=pool) as cache:
        assert cache.reuse_prefix(prompt["input_ids"]) == 0  # model A's blocks are not model B's
        assert_same(reference, greedy(model_b, cache, prompt))
    with PagedCache(model_a, pool=pool) as cache:
        assert cache.reuse_prefix(prompt["input_ids"]) == 32  # model A still finds its own


def test_prefix_keys_need_positions_that_are_token_indices():
    model = tiny_model("llama")
    batch = ragged_batch([8, 0], 40, seed=4)  # row 0: 8 pads then 32 tokens
    row = batch["input_ids"][:1, 8:]  # row 0's 32 real tokens
    pool = KVPool.for_config(model.config, num_blocks=64)
    with PagedCache(model, pool=pool) as cache, torch.no_grad():
        model(**batch, cache=cache, use_cache=True)  # no position_ids: row 0's keys sit at positions 8..39
    with PagedCache(model, pool=pool) as cache:
        assert cache.reuse_prefix(torch.cat([row, row[:, :1]], dim=1)) == 0  # so they are not reusable
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # what generate passes
    with PagedCache(model, pool=pool) as cache, torch.no_grad():
        model(**batch, position_ids=positions, cache=cache, use_cache=True)
    unpadded = {"input_ids": row, "attention_mask": torch.ones_like(row)}
    reference = greedy(model, DynamicCache(config=model.config), unpadded)
    with PagedCache(model, pool=pool) as cache:
        assert cache.reuse_prefix(row) == 16  # now they are (one token is always left to compute)
        assert_same(reference, greedy(model, cache, unpadded))


# ------------------------------------------------------------------------------------ autograd, inference mode


def test_pool_first_used_in_inference_mode_works_outside_it_and_back():
    model = tiny_model("llama")
    batch = ragged_batch([0, 2], 12)
    reference = greedy(model, DynamicCache(config=model.config), batch)
    pool = KVPool.for_config(model.config, num_blocks=32)
    with torch.inference_mode(), PagedCache(model, pool=pool) as cache:
        assert_same(reference, greedy(model, cache, batch))
    with PagedCache(model, pool=pool) as cache:
        assert_same(reference, greedy(model, cache, batch))
    with torch.inference_mode(), PagedCache(model, pool=pool) as cache:
        assert_same(reference, greedy(model, cache, batch))


def test_grad_enabled_forwards_keep_the_pool_out_of_autograd():
    model = tiny_model("llama")
    batch = ragged_batch([0, 2], 12)
    pool = KVPool.for_config(model.config, num_blocks=32)
    for _ in range(5):
        with PagedCache(model, pool=pool) as cache:
            out = model(**batch, cache=cache, use_cache=True)  # grad mode on, parameters require grad
            assert out.logits.requires_grad
    for storage in (*pool.keys, *pool.values):
        assert not storage.requires_grad and storage.grad_fn is None  # no graph kept alive, memory stays flat


def test_gradients_through_a_fresh_cache_match_dynamic_cache():
    model = tiny_model("llama")
    batch = ragged_batch([0, 3], 16)

    def grads(cache):
        model.zero_grad()
        model(**batch, cache=cache, use_cache=True).logits.square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    with PagedCache(model, num_blocks=16) as cache:
        paged = grads(cache)
    for ours, theirs in zip(paged, grads(DynamicCache(config=model.config)), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_gradients_into_cached_positions_raise_a_clear_error():
    model = tiny_model("llama")
    batch = ragged_batch([0, 0], 16)
    with PagedCache(model, num_blocks=16) as cache:
        with torch.no_grad():
            model(**batch, cache=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="outside autograd"):
            model(input_ids=torch.tensor([[4], [5]]), cache=cache, use_cache=True)
        assert cache.get_seq_length() == 16  # and the failed step left nothing behind


# ------------------------------------------------------------------------------------------------- lifetimes


def test_dropped_cache_gives_its_blocks_back_without_the_garbage_collector():
    model = tiny_model("llama")
    pool = KVPool.for_config(model.config, num_blocks=8)  # room for one request at a time
    batch = ragged_batch([0], 40)

    def request():
        cache = PagedCache(model, pool=pool)
        greedy(model, cache, batch)
        assert pool.blocks.num_used > 0

    gc.disable()
    try:
        for _ in range(5):
            request()  # the cache goes out of scope here
            assert pool.blocks.num_used == 0
    finally:
        gc.enable()


def test_dropped_caches_leave_one_hook_on_the_model():
    model = tiny_model("llama")
    for _ in range(1000):
        PagedCache(model, num_blocks=2)
    assert len(model._forward_pre_hooks) == 1
    with PagedCache(model.config, num_blocks=2):
        pass
    assert len(model._forward_pre_hooks) == 1


# ------------------------------------------------------------------------------------------- copies, saving


def test_shallow_copy_forks_the_cache():
    model = tiny_model("llama")
    batch = ragged_batch([0, 2], 20)
    with PagedCache(model, num_blocks=32) as cache:
        with torch.no_grad():
            model(**batch, cache=cache, use_cache=True)
        twin = copy.copy(cache)
        assert twin.block_tables.tables == cache.block_tables.tables
        assert twin.block_tables.tables is not cache.block_tables.tables
        twin.release()
        assert cache.get_seq_length() == 20 and cache.stats().blocks_in_use == 4  # the original is intact
        deep = copy.deepcopy(cache)
        torch.testing.assert_close(cache.layers[0].keys, deep.layers[0].keys)
        deep.release()


def test_pickle_and_torch_save_raise_a_type_error_naming_paged_cache(tmp_path):
    model = tiny_model("llama")
    with PagedCache(model, num_blocks=8) as cache:
        with pytest.raises(TypeError, match="PagedCache cannot be pickled"):
            pickle.dumps(cache)
        with pytest.raises(TypeError, match="PagedCache cannot be pickled"):
            torch.save(cache, tmp_path / "cache.pt")


# ------------------------------------------------------------------------------------------------- arguments


def test_non_tensor_input_ids_raise_the_same_type_error_as_without_a_cache():
    model = tiny_model("llama")
    with pytest.raises(TypeError) as without:
        model(input_ids=[[1, 2, 3]])
    with PagedCache(model, num_blocks=8) as cache, pytest.raises(TypeError) as with_cache:
        model(input_ids=[[1, 2, 3]], cache=cache)
    assert str(with_cache.value) == str(without.value)


@pytest.mark.parametrize(
    "bad, error",
    [
        (torch.tensor([1, 2, 3]), TypeError),  # 1-D: one row of a batch, not a batch
        ([[1, 2, 3]], TypeError),
        (torch.tensor([[1.0, 2.0]]), TypeError),
        (torch.zeros(0, 4, dtype=torch.long), ValueError),
    ],
)
def test_reuse_prefix_validates_its_input(bad, error):
    model = tiny_model("llama")
    with PagedCache(model, num_blocks=8) as cache, pytest.raises(error, match="reuse_prefix"):
        cache.reuse_prefix(bad)


def test_reuse_prefix_needs_a_cache_built_from_the_model():
    model = tiny_model("llama")
    with PagedCache(model.config, num_blocks=8) as cache, pytest.raises(ValueError, match="built from the model"):
        cache.reuse_prefix(torch.ones(1, 20, dtype=torch.long))


# --------------------------------------------------------------------------------------------- dense views


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_layer_keys_and_values_read_like_dynamic_cache(model_type):
    model = tiny_model(model_type)
    batch = ragged_batch([0, 5], 20, seed=6)
    dense = DynamicCache(config=model.config)
    model.generate(**batch, cache=dense, max_new_tokens=8, do_sample=False)
    with PagedCache(model, num_blocks=32) as cache:
        assert cache.layers[0].keys is None  # nothing stored yet, as DynamicLayer
        model.generate(**batch, cache=cache, max_new_tokens=8, do_sample=False)
        for ours, theirs in zip(cache.layers, dense.layers, strict=True):
            assert ours.keys.shape == theirs.keys.shape and ours.values.shape == theirs.values.shape
            real = cache.is_real[:, -ours.keys.shape[2] :]  # [B, kv] padding reads zeros, not pad-token K/V
            for mine, reference in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                torch.testing.assert_close(mine.transpose(1, 2)[real], reference.transpose(1, 2)[real])  # [N, H, D]
        with pytest.raises(AttributeError, match="read-only"):
            cache.layers[0].keys = torch.zeros(1)
