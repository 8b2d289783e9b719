"""`ContinuousBatcher`: many requests on one model and one block pool, admitted and retired at every step.

A background thread runs the loop; each iteration is one step:

1. **admit** waiting requests, oldest first, while the pool can hold every request in flight at every step
   until each reaches its longest (prompt and ``max_new_tokens``; `hf_paged_cache.serving.admission`), or, with
   ``reserve_new_tokens=False``, while its prompt fits with one block of headroom per request in flight,
   and fewer than `max_running` are in flight; an admitted request starts from the longest prefix the pool
   has cached;
2. **prefill** admitted requests without padding, in chunks so that a step computes at most
   `max_step_tokens` prompt tokens; a request whose prompt is done picks its first token and joins the
   running batch by block table (no key or value is copied);
3. **decode**: every running request computes its next token (attention straight from the block tables)
   and picks it; a finished request leaves at once and its blocks go back to the pool (full ones stay
   findable by prefix).

With `pack_steps` (the default), a step's prompt chunks and decode rows run in one forward over one packed
sequence (`hf_paged_cache.serving.packed`): the weights are read once per step and the decode rows ride in the
prompt chunks' large matmuls. A request then joins the running batch one step after its prompt is done.
Otherwise each prompt chunk is a forward of its own, followed by one decode forward for every running
request, the newly prefilled ones included. A packed step that fails (the pool runs out, a request's own
bad input) is computed again unpacked, where each failure is handled as described below.

When the pool runs out in the middle of a decode (without reservation, or when another cache shares the
pool and takes blocks), the most recently admitted request is preempted: its blocks are freed and it waits
at the front of the queue, to be computed again (prompt and tokens so far) when blocks free up, so its
output is what it would have been. A request that cannot fit the pool even alone fails on its own handle
with `PoolExhaustedError`; the others carry on.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from ..attention.paged_sdpa import ATTENTION_NAME, set_paged_attention
from ..cache.paged_cache import PagedCache
from ..errors import PoolExhaustedError
from ..pool.kv_pool import KVPool
from .admission import Lifetime, peak_blocks
from .packed import PackingUnsupported, Segment, packed_forward
from .request import Request, RequestHandle

DEFAULT_MAX_STEP_TOKENS = 512
DEFAULT_MAX_RUNNING = 64


class ContinuousBatcher:
    """Serve many generation requests at once on `model`, continuously batched on one paged KV pool.

    Args:
        model: a decoder-only transformers model; it is switched to ``paged_sdpa`` attention when its
            architecture allows (`set_paged_attention`), which keeps results exact.
        pool: a `KVPool` to share (else a new one of `num_blocks` / `max_memory`, or elastic with neither).
        block_size: tokens per block of a new pool.
        max_running: most requests in flight (prefilling or decoding) at once.
        max_step_tokens: most prompt tokens prefilled per step (long prompts are prefilled in chunks).
        tokenizer: needed for ``stop_strings``.
        reserve_new_tokens: admit a request only when the pool can hold every request in flight at every
            step until each reaches its longest (prompt and ``max_new_tokens``), so that none is preempted
            and computed twice; False admits while its prompt fits (more requests at once, preempted when
            the pool runs out).
        pack_steps: run each step's prompt chunks and decode rows in one packed forward (needs
            ``paged_sdpa``; turned off by itself for a model that cannot); False runs them one by one.

    `submit` is thread-safe and starts the loop on first use; `close` (or leaving ``with``) stops it, fails
    unfinished requests and gives every block back.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pool: KVPool | None = None,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
        block_size: int = 16,
        max_running: int | None = None,
        max_step_tokens: int | None = None,
        tokenizer: Any = None,
        reserve_new_tokens: bool = True,
        pack_steps: bool = True,
    ):
        self.model = model
        if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
            try:
                set_paged_attention(model)
            except NotImplementedError:
                pass  # e.g. Falcon: its own attention reads the dense K/V; results are exact either way
        self.running_cache = PagedCache(
            model, block_size=block_size, num_blocks=num_blocks, max_memory=max_memory, pool=pool
        )
        self.pool = self.running_cache.pool
        self.max_running = max_running or DEFAULT_MAX_RUNNING
        self.max_step_tokens = max_step_tokens or DEFAULT_MAX_STEP_TOKENS
        self.tokenizer = tokenizer
        self.reserve_new_tokens = reserve_new_tokens
        self.pack_steps = pack_steps and model.config._attn_implementation == ATTENTION_NAME
        self.context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self._ids = itertools.count()
        self._wakeup = threading.Condition()
        self._submitted: deque[Request] = deque()  # guarded by _wakeup
        self._closed = False
        self._thread: threading.Thread | None = None
        # the loop's own state (only its thread touches it)
        self._waiting: deque[Request] = deque()
        self._prefilling: list[tuple[Request, PagedCache, int]] = []  # request, its cache, tokens computed
        self._running: list[Request] = []  # in the order of the running cache's rows
        self.preemptions = 0  # requests preempted so far (pool exhausted mid-decode)
        self.packed_steps = 0  # steps run as one packed forward so far

    # ------------------------------------------------------------------ public API

    def submit(self, input_ids: Sequence[int] | torch.Tensor, **generation_kwargs: Any) -> RequestHandle:
        """Queue one prompt (token ids: a list or a 1-D tensor); returns its handle at once.

        `generation_kwargs` are `GenerationConfig` fields (``max_new_tokens``, ``do_sample``,
        ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``min_new_tokens``,
        ``eos_token_id``, ``stop_strings``, ...) plus ``seed`` for sampling. Raises `ValueError` /
        `TypeError` for an empty or too long prompt or an unknown argument, `RuntimeError` once closed.
        """
        prompt = _token_list(input_ids)
        if self.context is not None and len(prompt) >= self.context:
            raise ValueError(f"the prompt has {len(prompt)} tokens but the model's context is {self.context}")
        request = Request(next(self._ids), prompt, self.model, generation_kwargs, self.tokenizer)
        with self._wakeup:
            if self._closed:
                raise RuntimeError("this ContinuousBatcher is closed")
            self._submitted.append(request)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ContinuousBatcher", daemon=True)
                self._thread.start()
            self._wakeup.notify()
        return request.handle

    def generate(self, prompts: Sequence[Sequence[int] | torch.Tensor], **generation_kwargs: Any) -> list[list[int]]:
        """Generate for every prompt; each result is the list of new token ids, in the order of `prompts`."""
        handles = [self.submit(prompt, **generation_kwargs) for prompt in prompts]
        return [handle.result() for handle in handles]

    def close(self) -> None:
        """Stop the loop, fail the requests not finished (`RuntimeError`) and give every block back."""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()
        closed = RuntimeError("the ContinuousBatcher was closed before this request finished")
        with self._wakeup:
            leftovers = [*self._submitted, *self._waiting, *(r for r, _, _ in self._prefilling), *self._running]
            self._submitted.clear()
        for request in leftovers:
            request.handle._finish(closed)
        for _, cache, _ in self._prefilling:
            cache.release()
        self._waiting.clear()
        self._prefilling, self._running = [], []
        self.running_cache.release()

    def __enter__(self) -> ContinuousBatcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._closed and not (self._submitted or self._waiting or self._prefilling or self._running):
                    self._wakeup.wait()
                if self._closed:
                    return
                self._waiting.extend(self._submitted)
                self._submitted.clear()
            try:
                with torch.no_grad():
                    self._admit()
                    if not self._step_packed():
                        self._prefill()
                        self._decode()
            except BaseException as error:  # noqa: BLE001 (no request may wait forever on a dead loop)
                self._fail_in_flight(error)

    def _fail_in_flight(self, error: BaseException) -> None:
        """A step failed outside any one request: fail every admitted request with `error`, free their blocks."""
        for request, cache, _ in self._prefilling:
            cache.release()
            request.handle._finish(error)
        for request in self._running:
            request.handle._finish(error)
        self._prefilling, self._running = [], []
        self.running_cache.reset()

    def _admit(self) -> None:
        """Start waiting requests, oldest first, while the pool can hold their tokens."""
        while self._waiting and len(self._prefilling) + len(self._running) < self.max_running:
            request = self._waiting[0]
            needed = self._blocks_needed(len(request.tokens) + 1)
            too_big = [
                (n, blocks, group) for n, blocks, group in zip(needed, self.pool.groups, self.pool.layer_groups)
                if blocks.max_blocks is not None and n > blocks.capacity
            ]
            if too_big:  # more than the whole (fixed) pool: it could never run
                n, blocks, group = too_big[0]
                self._waiting.popleft()
                name = group.name if len(self.pool.groups) > 1 else None
                request.handle._finish(PoolExhaustedError(n, blocks.num_free, blocks.capacity, blocks.block_size, name))
                continue
            if not self._admissible(request, needed):
                return
            self._waiting.popleft()
            cache = PagedCache(self.model, pool=self.pool)
            done = cache.reuse_prefix(torch.tensor([request.tokens])) if len(request.tokens) > 1 else 0
            self._prefilling.append((request, cache, done))

    def _admissible(self, request: Request, needed: list[int]) -> bool:
        """Whether `request` may start now, beside the requests in flight, in every layer group.

        With `reserve_new_tokens`: while the pool can hold every request in flight at every step until each
        reaches ``max_length`` (`peak_blocks`), so that none is preempted later. Otherwise while `needed` (its
        prompt and next token) fits with one block of headroom per request in flight.
        """
        if not self.reserve_new_tokens:
            in_flight = len(self._prefilling) + len(self._running) + 1
            return all(blocks.can_allocate(n + in_flight) for n, blocks in zip(needed, self.pool.groups))
        lifetimes = [Lifetime.running(len(r.tokens), r.max_length) for r in self._running]
        queued = 0  # prompt tokens the prefill computes, in order, before each prefilling request is done
        for other, done in [*((r, done) for r, _, done in self._prefilling), (request, 0)]:
            queued += len(other.tokens) - done
            ready = -(-queued // self.max_step_tokens) + self.pack_steps  # packed: it decodes the step after
            lifetimes.append(Lifetime.prefilling(len(other.tokens), other.max_length, ready))
        caches = [self.running_cache, *(cache for _, cache, _ in self._prefilling)]
        for group, (blocks, layers) in enumerate(zip(self.pool.groups, self.pool.layer_groups)):
            if blocks.max_blocks is None:
                continue  # elastic: it grows
            in_flight = set().union(*(cache.batch.groups[group].unique_blocks() for cache in caches))
            held_elsewhere = blocks.num_used - len(in_flight)  # by other caches sharing the pool
            cap = min(layers.max_blocks_per_row(max(life.top for life in lifetimes), blocks.block_size), blocks.capacity)
            if peak_blocks(lifetimes, blocks.block_size, cap) > blocks.capacity - held_elsewhere:
                return False
        return True

    def _blocks_needed(self, num_tokens: int) -> list[int]:
        return [group.max_blocks_per_row(num_tokens, self.pool.block_size) for group in self.pool.layer_groups]

    def _step_packed(self) -> bool:
        """Prompt chunks and decode rows in one packed forward; False when the step is to run unpacked.

        That is when packing is off, when there is no prompt chunk or a single one and nothing else, and
        when the packed forward fails (every cache is then as it was).
        """
        if not self.pack_steps or not self._prefilling:
            return False
        chunks = self._chunks()
        if not self._running and len(chunks) == 1:
            return False
        try:
            logits = packed_forward(self.model, *self._segments(chunks))  # [decode rows + prompts done, vocab]
        except PackingUnsupported:
            self.pack_steps = False
            return False
        except Exception:  # noqa: BLE001 (the unpacked step handles it: preemption, or the one request's failure)
            return False
        finished = [row for row, request in enumerate(self._running) if request.choose(logits[row])[1]]
        next_logits, still = len(self._running), []
        for request, cache, done, chunk in chunks:
            if done + len(chunk) < len(request.tokens):
                still.append((request, cache, done + len(chunk)))
                continue
            self._prompt_done(request, cache, logits[next_logits])  # joins after the rows in `finished`
            next_logits += 1
        self._retire(finished)
        self._prefilling = still + self._prefilling[len(chunks) :]
        self.packed_steps += 1
        return True

    def _segments(self, chunks: list[tuple[Request, PagedCache, int, list[int]]]) -> tuple[list[Segment], list[int]]:
        """The packed step's segments (the decode rows, then each chunk) and where to take logits: at every
        decode row, and at the last token of each chunk that ends its prompt."""
        segments, logits_at = [], []
        if self._running:
            segments.append(Segment(self.running_cache, *self._decode_inputs()))
            logits_at += range(len(self._running))
        end = len(self._running)
        for request, cache, done, chunk in chunks:
            positions = torch.arange(done, done + len(chunk)).unsqueeze(0)  # [1, c]
            segments.append(Segment(cache, torch.tensor([chunk]), positions))
            end += len(chunk)
            if done + len(chunk) == len(request.tokens):
                logits_at.append(end - 1)
        return segments, logits_at

    def _chunks(self) -> list[tuple[Request, PagedCache, int, list[int]]]:
        """The prompt chunks of this step, oldest request first, `max_step_tokens` tokens in all: each with
        its request, cache and the tokens computed before it."""
        budget, chunks = self.max_step_tokens, []
        for request, cache, done in self._prefilling:
            if budget <= 0:
                break
            chunk = request.tokens[done : done + budget]
            chunks.append((request, cache, done, chunk))
            budget -= len(chunk)
        return chunks

    def _decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The running rows' next forward: input ids ``[B, 1]``, positions ``[B, 1]``, mask ``[B, L + 1]``."""
        device = self.model.device
        input_ids = torch.tensor([[r.generated[-1]] for r in self._running], device=device)  # [B, 1]
        positions = torch.tensor([[len(r.tokens) - 1] for r in self._running], device=device)  # [B, 1]
        real = self.running_cache.is_real.to(device)
        mask = torch.cat([real, torch.ones_like(input_ids, dtype=torch.bool)], dim=1).long()  # [B, L + 1]
        return input_ids, positions, mask

    def _prefill(self) -> None:
        """Compute this step's prompt chunks (`_chunks`), a forward each; requests whose prompt is done join the
        running batch."""
        chunks, still = self._chunks(), []
        for index, (request, cache, done, chunk) in enumerate(chunks):
            try:
                out = self.model(
                    input_ids=torch.tensor([chunk], device=self.model.device),
                    position_ids=torch.arange(done, done + len(chunk), device=self.model.device).unsqueeze(0),
                    cache=cache, use_cache=True, logits_to_keep=1,
                )
            except PoolExhaustedError as error:
                cache.release()
                if not self._running and len(self._prefilling) == 1:
                    request.handle._finish(error)  # alone and still too big: it can never fit
                else:
                    self._waiting.appendleft(request)  # retry when blocks free up
                still.extend((other, its_cache, its_done) for other, its_cache, its_done, _ in chunks[index + 1 :])
                break
            except Exception as error:  # noqa: BLE001 (the request's own failure, reported on its handle)
                cache.release()
                request.handle._finish(error)
                continue
            done += len(chunk)
            if done < len(request.tokens):
                still.append((request, cache, done))
                continue
            self._prompt_done(request, cache, out.logits[0, -1])
        self._prefilling = still + self._prefilling[len(chunks) :]

    def _prompt_done(self, request: Request, cache: PagedCache, logits: torch.Tensor) -> None:
        """`request`'s prompt is all in `cache`: it picks its first token from `logits` ``[vocab]``, then either
        finishes (its blocks go back) or joins the running batch as its last row."""
        if request.choose(logits)[1]:
            cache.release()
            request.handle._finish()
        else:
            self.running_cache.add_rows_from(cache)
            self._running.append(request)

    def _decode(self) -> None:
        """One forward for every running request; finished ones leave at once."""
        while self._running:
            input_ids, positions, mask = self._decode_inputs()
            try:
                out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                 cache=self.running_cache, use_cache=True)
            except PoolExhaustedError as error:
                if len(self._running) == 1:
                    self._retire([0], error)
                    return
                self._preempt()
                continue
            except Exception as error:  # noqa: BLE001 (a batched forward: every running request failed)
                self._retire(list(range(len(self._running))), error)
                return
            finished = [row for row, request in enumerate(self._running) if request.choose(out.logits[row, -1])[1]]
            self._retire(finished)
            return

    def _retire(self, rows: list[int], error: BaseException | None = None) -> None:
        """Finish the requests of running rows `rows` and drop them from the running cache."""
        if not rows:
            return
        for row in rows:
            self._running[row].handle._finish(error)
        keep = [row for row in range(len(self._running)) if row not in set(rows)]
        self._running = [self._running[row] for row in keep]
        self.running_cache.batch_select_indices(torch.tensor(keep, dtype=torch.long))
        self.running_cache.drop_leading_padding()

    def _preempt(self) -> None:
        """Free the newest running request's blocks and queue it first, to be computed again later."""
        request = self._running.pop()
        self.preemptions += 1
        self.running_cache.batch_select_indices(torch.arange(len(self._running)))
        self.running_cache.drop_leading_padding()
        self._waiting.appendleft(request)


def generate_many(model: PreTrainedModel, prompts: Sequence[Sequence[int] | torch.Tensor], **kwargs: Any) -> list[list[int]]:
    """`ContinuousBatcher.generate` with a batcher built for this one call (batcher arguments go to it)."""
    batcher_kwargs = {name: kwargs.pop(name) for name in _BATCHER_ARGUMENTS if name in kwargs}
    with ContinuousBatcher(model, **batcher_kwargs) as batcher:
        return batcher.generate(prompts, **kwargs)


_BATCHER_ARGUMENTS = (
    "pool", "num_blocks", "max_memory", "block_size", "max_running", "max_step_tokens", "tokenizer",
    "reserve_new_tokens", "pack_steps",
)


def _token_list(input_ids: Sequence[int] | torch.Tensor) -> list[int]:
    """`input_ids` as a list of ints: a 1-D integer tensor or a sequence of ints, not empty."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.ndim != 1 or input_ids.is_floating_point():
            raise ValueError(f"submit() takes a 1-D integer tensor of token ids, got shape {tuple(input_ids.shape)}")
        ids = input_ids.tolist()
    else:
        ids = list(input_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("submit() takes token ids: a list of ints or a 1-D integer tensor")
    if not ids:
        raise ValueError("submit() needs a prompt of at least one token")
    return ids
