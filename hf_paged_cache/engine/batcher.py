"""`ContinuousBatcher`: many requests on one model and one block pool, admitted and retired at every step.

The batcher is four parts on one loop thread: the `Scheduler` decides which requests each step runs
(admission, prompt chunks, decode rows, preemption), `StepRoles` completes that into the step's whole plan
(packed or apart, drafts, constraints), the `StepExecutor` runs the plan on the model, all or nothing, with
failures isolated to the request that causes them (`engine.recovery`), and the `Inbox` hands the loop what
other threads submit, cancel or close. See those modules for the policies; this one holds the public face.

With `pack_steps` (the default), a step's prompt chunks and decode rows run in one forward over one packed
sequence (`hf_paged_cache.cache.packed_forward`): the weights are read once per step and the decode rows ride in
the prompt chunks' large matmuls. A request then joins the running batch the step after its prompt is done.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from ..attention import PAGED_ATTENTION_NAMES, set_paged_attention
from ..cache.paged_cache import PagedCache
from ..cache.state_probe import one_token
from ..compiled import CompiledForward
from ..errors import BatcherClosed
from ..kernels.openmp_pool import release_openmp_pool
from ..kinds.encoder_decoder import is_encoder_decoder
from ..pool.block_pool import as_count
from ..pool.kv_pool import KVPool
from ..speculative.draft_model import DraftModel
from ..speculative.speculator import DEFAULT_SPECULATIVE_TOKENS, SpeculationStats, Speculator
from .encoder_inputs import check_positions, encoder_input
from .executor import StepExecutor
from .inbox import Inbox
from .media import media_input
from .prompt_scores import PromptScores
from .request import Request, RequestHandle
from .roles import StepRoles
from .scheduler import Scheduler
from .step_result import StepTimes
from .validation import flat_token_ids

DEFAULT_MAX_STEP_TOKENS = 512
DEFAULT_MAX_RUNNING = 64
PROMPT_SCORE_BLOCKS = 8192
"""The blocks of prompt log-probabilities a batcher keeps (131,072 tokens at 16 a block), least recently used out."""


@dataclass(frozen=True)
class GroupUsage:
    """One layer group of the batcher's pool (other caches on a shared pool count too)."""

    name: str  # "full attention" or "sliding window W"
    blocks_used: int
    blocks_free: int
    capacity: int  # most blocks held at once (an elastic pool's grows)
    kv_utilization: float  # tokens stored / token slots of the blocks the batcher's requests hold (0.0 when none)
    blocks_cached: int = 0  # findable by their prefix (held or free)


@dataclass(frozen=True)
class BatcherStats:
    """What `ContinuousBatcher.stats` reports: requests by state at the last step boundary, and the pool now."""

    waiting: int  # submitted (or preempted) and not started
    prefilling: int
    running: int
    finished: int
    failed: int
    cancelled: int
    preemptions: int  # running requests preempted, to be computed again
    prefill_retries: int  # prefilling requests sent back to the queue for want of blocks, to be computed again
    packed_steps: int  # steps run as one packed forward
    prefix_hit_tokens: int  # prompt tokens taken from the pool's prefix cache instead of computed
    groups: tuple[GroupUsage, ...]
    steps: StepTimes  # the steps run so far, and their time, by kind
    speculation: SpeculationStats = SpeculationStats()  # draft tokens proposed and kept (``speculative=``)


class ContinuousBatcher:
    """Serve many generation requests at once on `model`, continuously batched on one paged KV pool.

    Args:
        model: a decoder-only transformers model; it is switched to ``paged_sdpa`` attention when its
            architecture allows (`set_paged_attention`), which keeps results exact (a model on ``paged_bmm``
            keeps it).
        pool: a `KVPool` to share (else a new one of `num_blocks` / `max_memory`, or elastic with neither).
        block_size: tokens per block of a new pool.
        kv_dtype: how a new pool stores keys and values (`PagedCache`'s `kv_dtype`: ``"int8"``, say, holds
            about four times the tokens of float32 in the same memory).
        max_running: most requests in flight (prefilling or decoding) at once.
        max_waiting: most requests submitted and not started; `submit` raises `QueueFullError` beyond it
            (None: no bound).
        max_step_tokens: most prompt tokens prefilled per step (long prompts are prefilled in chunks).
        tokenizer: needed for ``stop_strings``.
        reserve_new_tokens: admit a request only when the pool can hold every request in flight at every
            step until each reaches its longest (prompt and ``max_new_tokens``), so that none is preempted
            and computed twice; False admits while its prompt fits (more requests at once, preempted when
            the pool runs out).
        pack_steps: run each step's prompt chunks and decode rows in one packed forward (needs
            ``paged_sdpa``; turned off by itself for a model that cannot); False runs them one by one.
        speculative: ``"ngram"`` verifies draft tokens looked up in each request's own prompt and output, up
            to `speculative_tokens` per row, in the decode steps where that is expected to pay
            (`hf_paged_cache.speculative.speculator`); greedy requests give the same tokens, and so do sampled
            ones for a seed. A model (a smaller one with the same tokenizer) drafts its own greedy
            continuation instead (`hf_paged_cache.speculative.draft_model`); a `Speculator` of your own sets
            how. None (the default) or ``"off"``: one token per row and step.
        batch_invariant: each request's logits the same bits whatever other requests share its steps, and the
            same when a prompt is scored as when its tokens were generated (`PagedCache`'s ``batch_invariant``:
            switches the model for good).
        reuse_prompt_scores: keep the prompt log-probabilities requests ask for (``prompt_logprobs``) by block, so
            that a later prompt starting with the same blocks takes them and computes only the rest
            (`engine.prompt_scores`; up to `PROMPT_SCORE_BLOCKS` blocks); False computes every such prompt whole.
            Bitwise what a computation gives again in batch-invariant mode; in the default mode the numbers
            the first computation gave.
        compile: run decode forwards as one graph compiled by inductor (`compiled_forward`): logits equal to float32.

    `submit` is thread-safe and starts the loop on first use, ending the calling thread's idle OpenMP workers
    (`kernels.openmp_pool`: with them, every op of the loop's thread would run slower). `close` (or leaving
    ``with``) stops it, fails unfinished requests and gives every block back. A batcher dropped without `close`
    finishes the requests it has, then ends its thread and gives its blocks back.
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
        max_waiting: int | None = None,
        max_step_tokens: int | None = None,
        tokenizer: Any = None,
        reserve_new_tokens: bool = True,
        pack_steps: bool = True,
        kv_dtype: str | torch.dtype | None = None,
        speculative: str | PreTrainedModel | Speculator | None = None,
        speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
        batch_invariant: bool = False,
        reuse_prompt_scores: bool = True,
        compile: bool = False,
    ):
        if not isinstance(speculative, (Speculator, PreTrainedModel)) and speculative not in (None, "off", "ngram"):
            raise ValueError(
                f"speculative={speculative!r}: expected 'ngram', 'off', None, a draft model or a Speculator"
            )
        encoder_decoder = is_encoder_decoder(model.config)
        if encoder_decoder:
            check_positions(model)
            if speculative not in (None, "off"):  # drafts are verified on decoder-only models' caches
                raise NotImplementedError(
                    f"speculative decoding is not supported on {type(model).__name__}, an encoder-decoder model; "
                    "pass speculative=None"
                )
        self.model = model
        if getattr(model.config, "_attn_implementation", None) not in PAGED_ATTENTION_NAMES and not encoder_decoder:
            try:
                set_paged_attention(model)
            except NotImplementedError:
                pass  # e.g. Falcon: its own attention reads the dense K/V; results are exact either way
        compiled = compiled_forward(model, batch_invariant) if compile else None
        max_running = as_count("max_running", max_running or DEFAULT_MAX_RUNNING, 1)
        sequences = None if pool is not None or max_memory is None else max_running  # a budget's state slots
        running_cache = PagedCache(
            model, block_size=block_size, num_blocks=num_blocks, max_memory=max_memory, pool=pool, manual_commit=True,
            kv_dtype=kv_dtype, max_sequences=sequences, batch_invariant=batch_invariant,
        )
        if encoder_decoder:
            running_cache.cross_attention_cache.keep_reads = True  # dense between steps, following the rows
            pack_steps = False  # each row attends to its own encoder's output
        self.pool = running_cache.pool
        self.tokenizer = tokenizer
        text = model.config.get_text_config(decoder=True)
        # the most positions a request's tokens take (an encoder-decoder model's decoder's: Whisper's 448)
        self.context = getattr(text, "max_target_positions", None) or getattr(text, "max_position_embeddings", None)
        self.decoder_prompt = _decoder_start(model) if encoder_decoder else None  # default decoder_input_ids
        self.vocab_size = model.get_input_embeddings().num_embeddings  # a prompt's ids are below it
        self.eos_token_ids = tuple(flat_token_ids(model.generation_config.eos_token_id))  # the model's own
        self._inbox = Inbox(None if max_waiting is None else as_count("max_waiting", max_waiting, 1))
        speculator = speculative if isinstance(speculative, Speculator) else None
        if isinstance(speculative, PreTrainedModel):
            draft = DraftModel(speculative, vocab_size=self.vocab_size, block_size=block_size)
            speculator = Speculator(as_count("speculative_tokens", speculative_tokens, 1), source=draft)
        elif speculative == "ngram":
            speculator = Speculator(as_count("speculative_tokens", speculative_tokens, 1))
        if running_cache.pool.layout.indexer_dims:
            raise NotImplementedError(
                f"{type(model).__name__} has indexed-attention (DSA) layers, which the continuous batcher does not "
                "run yet: their indexer's choice of keys depends on the other rows of a left-padded batch (generate "
                "on a batch differs from each prompt alone, with DynamicCache too), and a batcher's answers must be "
                "each request's alone (generate with a PagedCache is exact against DynamicCache)"
            )
        if running_cache.keeps_states:
            if speculator is not None:  # drafts a state has taken in cannot be given back
                raise NotImplementedError(
                    f"speculative decoding is not supported on {type(model).__name__}: its conv / recurrent states "
                    "cannot give back rejected drafts; pass speculative=None"
                )
            elsewhere = _states_kept_elsewhere(model)  # a forward of one token: after the checks that cost none
            if elsewhere:
                raise NotImplementedError(
                    f"{type(model).__name__} keeps the states of layers {elsewhere} in its own modules, outside the "
                    "cache: a continuous batcher, whose rows come and go, cannot run it (generate with a PagedCache can)"
                )
            pack_steps = False  # one packed sequence would run every row's conv and recurrent states as one
        self._roles = StepRoles(model, pack_steps, speculator)
        self._scheduler = Scheduler(
            model, running_cache, self._inbox, self._roles,
            max_running=max_running,
            max_step_tokens=as_count("max_step_tokens", max_step_tokens or DEFAULT_MAX_STEP_TOKENS, 1),
            reserve_new_tokens=reserve_new_tokens,
            prompt_scores=None if encoder_decoder or running_cache.keeps_states or not reuse_prompt_scores
            else PromptScores(block_size, PROMPT_SCORE_BLOCKS),
        )
        self._executor = StepExecutor(model, compiled)
        # blocks freed by any cache on the pool wake a loop that waits for room (held weakly by the pool)
        self._listeners = [blocks.add_free_listener(self._inbox.wake) for blocks in self.pool.groups]
        self._ids = itertools.count()
        self._start = threading.Lock()  # guards _thread and _closed
        self._thread: threading.Thread | None = None
        self._closed = False
        # dropped without close(): the loop (which holds no reference to this object) drains, then ends
        weakref.finalize(self, self._inbox.close)

    # ------------------------------------------------------------------ public API

    def submit(
        self, input_ids: Sequence[int] | torch.Tensor | None = None, **generation_kwargs: Any
    ) -> RequestHandle:
        """Queue one prompt (token ids: a list or a 1-D tensor); returns its handle at once.

        On an encoder-decoder model, as for its ``generate``: `input_ids` are the encoder's (T5, BART, Marian),
        or ``input_features=`` ``[mel bins, frames]`` (Whisper), and ``decoder_input_ids=`` is the decoder's
        prompt (default: its start token); ``max_new_tokens`` counts the decoder's tokens. On an image-text model,
        ``multimodal_inputs=`` are its processor's outputs (``pixel_values``, ...; the ids and mask, if
        there, are left out: the prompt holds the processor's expanded image placeholders) and ``image_digests=`` optionally names each image
        (say, a hash of its pixels), which keys the blocks that hold it (`engine.media`).

        `generation_kwargs` are `GenerationConfig` fields (``max_new_tokens``, ``do_sample``,
        ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``min_new_tokens``,
        ``eos_token_id``, ``stop_strings``, ...), ``seed`` for sampling, ``logprobs=k`` and
        ``prompt_logprobs=k`` (0 to 20: record the log-probability of each new, or prompt, token with the
        `k` most likely; read them from the handle), and as for ``generate`` ``generation_config``,
        ``logits_processor``, ``stopping_criteria`` and ``prefix_allowed_tokens_fn``. Every argument is checked here (`hf_paged_cache.engine.validation`): `ValueError` names one that
        would fail later or that the batcher cannot honour (beam search, ``num_return_sequences``,
        ``assistant_model``, ``output_scores``, ...), `TypeError` an unknown one. `QueueFullError` past
        `max_waiting`, `BatcherClosed` once closed.
        """
        prompt, inputs, generation_kwargs = self._inputs(input_ids, generation_kwargs)
        request = self._request(prompt, generation_kwargs, **inputs)
        self._enqueue(request)
        return request.handle

    def submit_group(
        self, input_ids: Sequence[int] | torch.Tensor | None, n: int, **generation_kwargs: Any
    ) -> list[RequestHandle]:
        """Queue `n` choices of one prompt (OpenAI's ``n``); returns their handles at once, in order.

        The prompt is prefilled once: each choice picks its first token from the same logits, then decodes in
        a row of its own that shares the prompt's blocks (copy-on-write). Arguments as for `submit`; with
        ``seed=s``, choice ``i`` samples with seed ``s + i``. The group takes one place in ``max_waiting``.
        """
        prompt, inputs, generation_kwargs = self._inputs(input_ids, generation_kwargs)
        count = as_count("n", n, 1)
        seed = generation_kwargs.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        requests = [
            self._request(prompt, generation_kwargs if seed is None else {**generation_kwargs, "seed": seed + i}, **inputs)
            for i in range(count)
        ]
        requests[0].followers = requests[1:]
        self._enqueue(requests[0])
        return [request.handle for request in requests]

    def generate(self, prompts: Sequence[Sequence[int] | torch.Tensor], **generation_kwargs: Any) -> list[list[int]]:
        """Generate for every prompt; each result is the list of new token ids, in the order of `prompts`."""
        handles = [self.submit(prompt, **generation_kwargs) for prompt in prompts]
        return [handle.result() for handle in handles]

    def stats(self) -> BatcherStats:
        """Requests by state (at the last step boundary), preemptions, packed steps, prefix hits, each layer
        group's blocks used and free, and the steps run and their time. Safe from any thread."""
        counts = self._scheduler.counts
        caches = [self._scheduler.running_cache, *(prefill.cache for prefill in list(self._scheduler.prefilling))]
        held = [cache.stats().groups for cache in caches]  # each cache's reads are safe from any thread
        groups = []
        for g, (group, blocks) in enumerate(zip(self.pool.layer_groups, self.pool.groups)):
            used, reserved = sum(stats[g].bytes_used for stats in held), sum(stats[g].bytes_reserved for stats in held)
            utilization = used / reserved if reserved else 0.0
            groups.append(GroupUsage(group.name, blocks.num_used, blocks.num_free, blocks.capacity, utilization,
                                     blocks.prefix_stats().cached_blocks))
        return BatcherStats(
            waiting=counts.waiting + self._inbox.pending, prefilling=counts.prefilling, running=counts.running,
            finished=counts.finished, failed=counts.failed, cancelled=counts.cancelled,
            preemptions=counts.preemptions, prefill_retries=counts.prefill_retries,
            packed_steps=self._executor.packed_steps,
            prefix_hit_tokens=counts.prefix_hit_tokens, groups=tuple(groups), steps=self._executor.times,
            speculation=self._roles.speculator.stats if self._roles.speculator else SpeculationStats(),
        )

    def close(self, timeout: float = 0.0) -> None:
        """Refuse new requests, let those submitted finish for up to `timeout` seconds, then fail what is left
        (`BatcherClosed`, a `RuntimeError`), stop the loop and give every block back. Waits for the step in progress to end."""
        self._inbox.close(timeout)
        with self._start:
            self._closed = True
            thread = self._thread
        if thread is None:
            _shut_down(self._scheduler, self._listeners)
        elif thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> ContinuousBatcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _inputs(
        self, input_ids: Sequence[int] | torch.Tensor | None, generation_kwargs: dict[str, Any]
    ) -> tuple[list[int], dict[str, Any], dict[str, Any]]:
        """A submission's prompt, its inputs besides tokens (``encoder=``, ``media=``: see `submit`) and the rest
        of its arguments."""
        kwargs = dict(generation_kwargs)
        if not is_encoder_decoder(self.model.config):
            prompt = _token_list(input_ids)
            pixels, digests = kwargs.pop("multimodal_inputs", None), kwargs.pop("image_digests", None)
            media = None if pixels is None else media_input(self.model, prompt, pixels, digests)
            return prompt, {"media": media}, kwargs
        encoder = encoder_input(self.model, input_ids, kwargs.pop("input_features", None))
        decoder_ids = kwargs.pop("decoder_input_ids", None)
        if decoder_ids is None:
            if self.decoder_prompt is None:
                raise ValueError(f"{type(self.model).__name__} names no decoder_start_token_id: pass decoder_input_ids")
            decoder_ids = list(self.decoder_prompt)
        return _token_list(decoder_ids), {"encoder": encoder}, kwargs

    def _request(self, prompt: list[int], generation_kwargs: dict[str, Any], **inputs: Any) -> Request:
        """A checked request (`ValueError` / `TypeError` for a bad argument), not yet queued; `inputs`: its
        ``encoder`` or ``media`` (`_inputs`)."""
        return Request(
            next(self._ids), prompt, self.model, generation_kwargs,
            tokenizer=self.tokenizer, context=self.context, on_cancel=self._inbox.wake, **inputs,
        )

    def _enqueue(self, request: Request) -> None:
        """Hand `request` (and its followers) to the loop, starting the loop on first use."""
        self._inbox.put(request)
        with self._start:
            if self._thread is None and not self._closed:
                release_openmp_pool()  # this thread's idle OpenMP workers would slow every op the loop runs
                self._thread = threading.Thread(
                    target=_serve, args=(self._inbox, self._scheduler, self._executor, self._listeners),
                    name="ContinuousBatcher", daemon=True,
                )
                self._thread.start()

    # ------------------------------------------------------------------ read by tests and benchmarks

    @property
    def running_cache(self) -> PagedCache:
        """The cache holding one row per running request."""
        return self._scheduler.running_cache

    @property
    def pack_steps(self) -> bool:
        """Whether steps are packed (turned off by itself for a model that cannot pack)."""
        return self._roles.pack_steps

    @property
    def packed_steps(self) -> int:
        return self._executor.packed_steps

    @property
    def preemptions(self) -> int:
        return self._scheduler.counts.preemptions


def _serve(inbox: Inbox, scheduler: Scheduler, executor: StepExecutor, listeners: list) -> None:
    """The loop, on the batcher's thread: one step per iteration, sleeping when nothing can run, until closed.

    It holds no reference to the `ContinuousBatcher`, so a dropped batcher is collected and its finalizer
    closes the inbox: the loop then finishes what it has and ends.
    """
    try:
        while True:
            seen = inbox.events
            scheduler.take_new()
            if inbox.closing and (scheduler.idle or inbox.past_deadline()):
                return
            plan = scheduler.plan()
            if plan is None:
                executor.idle()
                scheduler.roles.release()
                inbox.wait(seen)  # until a submission, a cancellation, freed blocks or closing
                continue
            try:
                with torch.no_grad():
                    result = executor.run(plan)
                scheduler.apply(plan, result)
            except Exception as error:  # noqa: BLE001 (outside any one request: no request may wait on it forever)
                scheduler.fail_in_flight(error)
    finally:
        executor.idle()
        scheduler.roles.release()
        _shut_down(scheduler, listeners)


def _shut_down(scheduler: Scheduler, listeners: list) -> None:
    scheduler.shutdown(BatcherClosed("the ContinuousBatcher was closed before this request finished"))
    for remove in listeners:
        remove()


def generate_many(model: PreTrainedModel, prompts: Sequence[Sequence[int] | torch.Tensor], **kwargs: Any) -> list[list[int]]:
    """`ContinuousBatcher.generate` with a batcher built for this one call (batcher arguments go to it)."""
    batcher_kwargs = {name: kwargs.pop(name) for name in _BATCHER_ARGUMENTS if name in kwargs}
    with ContinuousBatcher(model, **batcher_kwargs) as batcher:
        return batcher.generate(prompts, **kwargs)


_BATCHER_ARGUMENTS = (
    "pool", "num_blocks", "max_memory", "block_size", "max_running", "max_waiting", "max_step_tokens", "tokenizer",
    "reserve_new_tokens", "pack_steps", "kv_dtype", "batch_invariant", "reuse_prompt_scores",
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


def compiled_forward(model: PreTrainedModel, batch_invariant: bool) -> CompiledForward:
    """The compiled forward of `model` (`compiled.CompiledForward`) that the batcher's decode forwards run: the
    element-wise work between the kernels fused, the modules' Python gone; the first one compiles it (about a minute
    for SmolLM2-135M on two cores, about 25 s from inductor's disk cache). Prompt chunks and packed steps stay eager.

    Raises:
        NotImplementedError: naming the reason, for a model it cannot run (only decoder-only attention models).
        ValueError: with `batch_invariant`, which inductor's kernels cannot keep.
    """
    if batch_invariant:
        raise ValueError("compile=True cannot keep batch_invariant: inductor's kernels sum in orders that depend "
                         "on the rows of a step")
    return CompiledForward(model)


def _decoder_start(model: PreTrainedModel) -> tuple[int, ...] | None:
    """An encoder-decoder model's decoder prompt when none is given: its ``decoder_start_token_id`` (None when it
    names none)."""
    start = model.generation_config.decoder_start_token_id
    if start is None:
        start = model.config.decoder_start_token_id
    return None if start is None else tuple(flat_token_ids(start)[:1])


def _states_kept_elsewhere(model: PreTrainedModel) -> list[int]:
    """The layers whose conv / recurrent states `model` keeps in its own modules, outside any cache (RecurrentGemma
    does): they would not follow the batch's rows. From a forward of one token on a `PagedCache`."""
    with PagedCache(model) as probe, torch.no_grad():
        model(input_ids=one_token(model), cache=probe, use_cache=True)
        return probe.states_kept_elsewhere()
