"""`StepExecutor`: runs one planned step of the batcher on the model, all or nothing, failures isolated.

Every cache of the batcher keeps its forwards pending (``manual_commit``) until each request of the forward
has picked its next token; only then is the step committed. A forward that raises anywhere (any layer,
after the last layer, in the LM head) leaves every cache, block table, reference count and prefix entry of
the pool as it was, and no request's tokens have changed. The step is then computed again so that the cause
is isolated:

1. a packed step (`cache.packed_forward`) that fails runs again unpacked: the decode rows in one forward, then each
   prompt chunk in a forward of its own;
2. each of those forwards is tried twice, so that a fault that does not come back costs nobody anything;
3. a prompt chunk that fails twice fails its request alone, with the real exception;
4. decode rows that fail twice are tried one by one, each on a throwaway fork of the running cache: the rows
   that fail alone fail on their handles, and the others run at the next step without them. When no row
   fails alone, the rows run once more together, and if that fails too, the fault is no single request's:
   every row of the step fails with it (never with a wrong token).

With a `Speculator`, the decode rows of a step may carry draft tokens (`speculative.speculator`): the rows and
their drafts run in one forward of 1 + k positions per row (packed with the step's prompt chunks, if any),
each row keeps the drafts the model agrees with and one token of its own after them, and the cache drops the
rest (`PagedCache.commit` with ``keep``). A speculative step that fails in any way (a forward, a pick, no
blocks for the drafts) is dropped whole and the step runs again without drafts, isolated as above.

Rows held to a grammar have their masks filled while the forward runs (`MaskPrefetch`): a mask depends only on
the tokens a row has before the step.

Token choice is per request, tried twice as well (`engine.token_choice`); a request whose choice fails
twice fails alone and the others keep their tokens.
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from ..attention import PAGED_ATTENTION_NAMES
from ..cache.packed_caches import PackingUnsupported, Segment
from ..cache.paged_cache import PagedCache
from ..errors import PoolExhaustedError
from ..structured.mask_prefetch import MaskPrefetch
from ..structured.processor import GrammarLogitsProcessor
from ..cache.packed_forward import packed_forward
from .logprobs import token_logprobs
from .request import Choice, Request
from ..speculative.speculator import Drafts, Speculator
from .steps import Chunk, StepPlan, StepResult, StepTimes
from .token_choice import attempts, choose, choose_rows, verify_rows


class StepExecutor:
    """Runs `StepPlan`s on `model`, packed into one forward when it can (`pack_steps`), and reports a
    `StepResult`: what each request of the plan kept, or why it failed."""

    def __init__(self, model: PreTrainedModel, pack_steps: bool = True, speculator: Speculator | None = None):
        self.model = model
        self.pack_steps = pack_steps and model.config._attn_implementation in PAGED_ATTENTION_NAMES
        self.speculator = speculator  # drafts for decode steps (None: no speculative decoding)
        self.packed_steps = 0  # steps run as one packed forward so far
        self.times = StepTimes()  # replaced whole after each step: any thread may read it
        self._masks: MaskPrefetch | None = None  # made for the first step with a constrained row

    def run(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        prompt_tokens = sum(len(chunk.tokens) for chunk in plan.chunks)
        positions, picked = len(plan.running) + prompt_tokens, None  # positions computed, decode tokens kept
        # drafts ride on the decode rows of a step that runs as one forward (prompt chunks packed with them)
        speculates = self.speculator is not None and bool(plan.running) and (not plan.chunks or self.pack_steps)
        drafts = None
        self._prefetch_masks(plan)
        try:
            drafts = self.speculator.drafts(plan.running, prompt_tokens) if speculates else None
            result = self._run_speculative(plan, drafts) if drafts is not None else None
            if result is not None:
                positions += len(plan.running) * drafts.k
                picked = len(plan.running) + sum(len(kept) for kept in result.accepted.values())
                return result
            return self._run(plan)
        finally:
            seconds = time.perf_counter() - start
            self.times = self.times.adding(plan, seconds, picked)
            if speculates and not plan.chunks and (drafts is None or picked):  # the line is fitted to decode
                self.speculator.costs.add(positions, seconds)  # steps, not to one that ran twice (drafts dropped)

    def idle(self) -> None:
        """Nothing runs (the loop waits, or ends): give back what the steps held for requests (draft caches)."""
        if self.speculator is not None:
            self.speculator.release()
        if self._masks is not None:
            self._masks.wait()

    def _prefetch_masks(self, plan: StepPlan) -> None:
        """Start filling the grammar masks of the step's rows that will pick a token (`MaskPrefetch`)."""
        rows = [(processor, request.generated) for request in plan.choosing for processor in request.processors
                if isinstance(processor, GrammarLogitsProcessor)]
        if rows:
            self._masks = self._masks or MaskPrefetch()
            self._masks.start(rows)

    def _run(self, plan: StepPlan) -> StepResult:
        if self.pack_steps and plan.chunks and (plan.running or len(plan.chunks) > 1):
            result = StepResult()
            try:
                self._run_packed(plan, result)
                return result
            except PackingUnsupported:
                self.pack_steps = False
            except Exception:  # noqa: BLE001 (every cache is as it was: each part runs again on its own)
                pass
        result = StepResult()
        if plan.running:  # decode rows first: a long prefill never takes the blocks their next tokens need
            self._run_decode(plan, result)
        for chunk in plan.chunks:
            if not self._run_chunk(chunk, result):
                break  # out of blocks: the later chunks wait for the next step, as they are
        return result

    # ------------------------------------------------------------------ packed

    def _run_packed(self, plan: StepPlan, result: StepResult, drafts: Drafts | None = None) -> list[list[Choice]]:
        """The step's decode rows and prompt chunks in one packed forward, their picks in `result`. With
        `drafts`, each decode row carries its drafts (``1 + k`` positions) and keeps what `verify_rows` keeps:
        returned, for the caller to put in `result`. Any failure propagates with every cache as it was."""
        cache, running = plan.running_cache, plan.running
        q = 1 + (drafts.k if drafts is not None else 0)  # positions per decode row
        segments, logits_at, chunk_rows = [], [], []
        if running:
            segments.append(Segment(cache, *self._decode_inputs(cache, running, drafts)))
            logits_at += range(len(running) * q)  # row b's position j at b * q + j
        end = len(logits_at)
        for chunk in plan.chunks:
            positions = torch.arange(chunk.start, chunk.start + len(chunk.tokens)).unsqueeze(0)  # [1, c]
            segments.append(Segment(chunk.cache, torch.tensor([chunk.tokens]), positions))
            wanted = _logit_offsets(chunk)
            chunk_rows.append(slice(len(logits_at), len(logits_at) + len(wanted)))
            logits_at += [end + offset for offset in wanted]
            end += len(chunk.tokens)
        if drafts is not None:
            cache.expect_drafts(drafts.k)
        logits = packed_forward(self.model, segments, logits_at)  # [len(logits_at), vocab]; every cache pending
        kept: list[list[Choice]] = []
        try:
            if drafts is None:
                choose_rows(running, logits[: len(running)], result)
            elif running:
                kept = verify_rows(running, logits[: len(running) * q].unflatten(0, (len(running), q)), drafts)
            for chunk, rows in zip(plan.chunks, chunk_rows):
                self._chunk_done(chunk, logits[rows], result)
        except BaseException:
            for segment in segments:
                segment.cache.settle()
            raise
        for segment in segments:
            if segment.cache is cache and kept:
                cache.commit(keep=[len(choices) for choices in kept])
            else:
                segment.cache.commit()
        self.packed_steps += 1
        return kept

    # ------------------------------------------------------------------ unpacked

    def _run_chunk(self, chunk: Chunk, result: StepResult) -> bool:
        """One prompt chunk in a forward of its own; False when the pool had no blocks for it."""
        try:
            logits = attempts(lambda: self._chunk_forward(chunk))
        except PoolExhaustedError as error:
            result.exhausted[chunk.request] = error
            return False
        except Exception as error:  # noqa: BLE001 (failed twice alone: the request's own failure)
            result.failures[chunk.request] = error
            return True
        try:
            self._chunk_done(chunk, logits, result)
        except BaseException:
            chunk.cache.settle()
            raise
        chunk.cache.commit()
        return True

    def _chunk_done(self, chunk: Chunk, logits: torch.Tensor, result: StepResult) -> None:
        """What a computed chunk gives, from its logits ``[r, V]`` at `_logit_offsets`: its prompt's
        log-probabilities when asked for, then the first token of each choice of the prompt when it finishes."""
        request = chunk.request
        if request.needs_prompt_logprobs:
            first, targets = request.prompt_targets(chunk.start, len(chunk.tokens))
            computed = token_logprobs(logits[: len(targets)], targets, request.prompt_logprobs_k)
            result.prompt_logprobs[request] = (first, computed)
        if chunk.finishes:
            for member in request.group:  # the choices of one prompt pick from the same logits
                choose(member, logits[-1], result)
        else:
            result.kept.add(request)

    def _run_decode(self, plan: StepPlan, result: StepResult) -> None:
        """Every running request's next token in one forward; failures isolated as the module docstring says."""
        cache, requests = plan.running_cache, plan.running
        try:
            logits = self._decode_isolating(cache, requests, result)
        except PoolExhaustedError as error:
            result.decode_exhausted = error
            return
        except Exception as error:  # noqa: BLE001 (no single request's: the whole step fails with it)
            result.failures.update((request, error) for request in requests)
            return
        if logits is None:
            return  # some rows fail alone: the others did not run, and run at the next step without them
        choose_rows(requests, logits, result)
        cache.commit()

    def _decode_isolating(self, cache: PagedCache, requests: list[Request], result: StepResult) -> torch.Tensor | None:
        """The decode forward's logits ``[B, V]``, tried twice; then None with the rows that fail alone in
        `result`, or, when none does, the logits of one last try together (whose failure propagates)."""
        try:
            return attempts(lambda: self._decode_forward(cache, requests))
        except PoolExhaustedError:
            raise
        except Exception:  # noqa: BLE001 (failed twice: find the rows that fail alone)
            culprits = self._rows_failing_alone(cache, requests)
        if culprits:
            result.failures.update(culprits)
            return None
        return self._decode_forward(cache, requests)

    def _rows_failing_alone(self, cache: PagedCache, requests: list[Request]) -> dict[Request, BaseException]:
        """Each request whose decode row fails when run alone, on a fork of `cache` dropped afterwards."""
        culprits: dict[Request, BaseException] = {}
        for row, request in enumerate(requests):
            probe = cache.fork()  # shares every block; its writes copy the block they go to first
            try:
                probe.batch_select_indices(torch.tensor([row]))
                attempts(lambda: self._forward_and_drop(probe, request))  # a transient fault convicts nobody
            except PoolExhaustedError:
                pass  # no room to try it alone: no evidence against it
            except Exception as error:  # noqa: BLE001 (what it fails with alone)
                culprits[request] = error
            finally:
                probe.release()
        return culprits

    # ------------------------------------------------------------------ speculative

    def _run_speculative(self, plan: StepPlan, drafts: Drafts) -> StepResult | None:
        """The decode rows with their `drafts` verified in one forward (with the step's prompt chunks, packed),
        or None (every cache and every sampling generator as it was) when anything fails: the step then runs
        without drafts, and draws what it would have drawn."""
        sampling = [request for request in plan.choosing if request.config.do_sample]
        states = [request.generator.get_state() for request in sampling]
        result = self._try_speculative(plan, drafts)
        if result is None:
            for request, state in zip(sampling, states):
                request.generator.set_state(state)
        return result

    def _try_speculative(self, plan: StepPlan, drafts: Drafts) -> StepResult | None:
        """`_run_speculative`, but for the generators."""
        cache, requests = plan.running_cache, plan.running
        if plan.chunks:
            result = StepResult()
            try:
                kept = self._run_packed(plan, result, drafts)
            except Exception:  # noqa: BLE001 (rolled back: the plain step isolates the cause, or stops packing)
                return None
            return self._verified(requests, drafts, kept, result)
        try:
            logits = self._decode_forward(cache, requests, drafts)  # [B, 1 + k, V]
        except Exception:  # noqa: BLE001 (rolled back by the cache: the plain step isolates the cause)
            return None
        try:
            kept = verify_rows(requests, logits, drafts)
        except Exception:  # noqa: BLE001 (a pick failed: the plain step fails that request alone)
            cache.settle()
            return None
        except BaseException:
            cache.settle()
            raise
        cache.commit(keep=[len(choices) for choices in kept])
        return self._verified(requests, drafts, kept, StepResult())

    def _verified(
        self, requests: list[Request], drafts: Drafts, kept: list[list[Choice]], result: StepResult
    ) -> StepResult:
        """`result` with each decode row's `kept` tokens: the drafts it kept, then its own token."""
        self.speculator.verified(requests, drafts, [len(choices) - 1 for choices in kept])
        for request, choices in zip(requests, kept):
            result.accepted[request], result.choices[request] = choices[:-1], choices[-1]
        return result

    # ------------------------------------------------------------------ forwards

    def _forward_and_drop(self, probe: PagedCache, request: Request) -> None:
        """`request`'s decode row alone on `probe` (a one-row fork), its step dropped whatever happens."""
        try:
            self._decode_forward(probe, [request])
        finally:
            probe.settle()

    def _chunk_forward(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's forward on its request's cache (left pending); its logits ``[r, V]``: every position's
        when the prompt's log-probabilities are asked for, else the last position's."""
        device = self.model.device
        out = self.model(
            input_ids=torch.tensor([chunk.tokens], device=device),
            position_ids=torch.arange(chunk.start, chunk.start + len(chunk.tokens), device=device).unsqueeze(0),
            cache=chunk.cache, use_cache=True, logits_to_keep=0 if chunk.request.needs_prompt_logprobs else 1,
        )
        return out.logits[0]

    def _decode_forward(self, cache: PagedCache, requests: list[Request], drafts: Drafts | None = None) -> torch.Tensor:
        """One new token for each row of `cache` (left pending), after its `drafts` if any: the logits ``[B, V]``
        (with drafts ``[B, 1 + k, V]``, every position's)."""
        input_ids, positions, mask = self._decode_inputs(cache, requests, drafts)
        if drafts is not None:
            cache.expect_drafts(drafts.k)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                         logits_to_keep=0 if drafts is not None else 1)
        return out.logits if drafts is not None else out.logits[:, -1]

    def _decode_inputs(
        self, cache: PagedCache, requests: list[Request], drafts: Drafts | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Decode inputs of `cache`'s rows, each its last token then its drafts (``q = 1 + k``): input ids
        ``[B, q]``, positions ``[B, q]``, mask ``[B, L + q]``."""
        device = self.model.device
        rows = [[r.generated[-1], *(drafts.tokens[b] if drafts else ())] for b, r in enumerate(requests)]
        input_ids = torch.tensor(rows, device=device)  # [B, q]
        first = torch.tensor([[len(r.tokens) - 1] for r in requests], device=device)  # [B, 1]
        positions = first + torch.arange(input_ids.shape[1], device=device)  # [B, q]
        real = cache.is_real.to(device)
        mask = torch.cat([real, torch.ones_like(input_ids, dtype=torch.bool)], dim=1).long()  # [B, L + q]
        return input_ids, positions, mask

def _logit_offsets(chunk: Chunk) -> list[int]:
    """Positions of `chunk` (from 0) whose logits its step needs: all of them for the prompt's log-probabilities,
    else the last one when the chunk finishes the prompt, else none."""
    if chunk.request.needs_prompt_logprobs:
        return list(range(len(chunk.tokens)))
    return [len(chunk.tokens) - 1] if chunk.finishes else []
