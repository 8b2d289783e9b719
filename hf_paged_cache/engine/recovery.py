"""Running a step's forwards apart, so that a failure falls on the request that causes it, and on no other.

Every cache of the batcher keeps its forwards pending (``manual_commit``) until each request of the forward has
picked its next token; only then is the forward committed. A forward that raises anywhere (any layer, after the
last layer, in the LM head) leaves every cache, block table, reference count and prefix entry of the pool as it
was, and no request's tokens have changed. A step planned apart runs here, and so does a packed step whose
forward failed (`StepExecutor`), computed again so that the cause is isolated:

1. the decode rows run in one forward, then each prompt chunk in a forward of its own;
2. each of those forwards is tried twice (`token_choice.attempts`, as each token choice is), so that a fault
   that does not come back costs nobody anything;
3. a prompt chunk that fails twice fails its request alone, with the real exception;
4. decode rows that fail twice are tried one by one, each on a throwaway fork of the running cache: the rows
   that fail alone fail on their handles, and the others run at the next step without them. When no row
   fails alone, the rows run once more together, and if that fails too, the fault is no single request's:
   every row of the step fails with it (never with a wrong token).

A forward that finds no blocks is not tried again (the pool is as full the second time): the decode rows'
`PoolExhaustedError` goes to the scheduler, which makes room; a chunk's sends its request back to the queue.
"""

from __future__ import annotations

import torch

from ..cache.paged_cache import PagedCache
from ..errors import PoolExhaustedError
from .forwards import StepForwards
from .plan import Chunk, StepPlan
from .request import Request
from .step_result import StepResult
from .token_choice import attempts, choose_for_chunk, choose_rows


def run_apart(forwards: StepForwards, plan: StepPlan, result: StepResult) -> None:
    """The plan's decode rows in one forward, then each prompt chunk in its own, isolated as the module
    docstring says; what each request kept, or why it failed, in `result`."""
    if plan.running:  # decode rows first: a long prefill never takes the blocks their next tokens need
        _run_decode(forwards, plan.running_cache, plan.running, result)
    try:
        forwards.encode(plan.chunks)  # the step's encoder inputs in one batch (encoder-decoder models)
    except Exception:  # noqa: BLE001 (each chunk then encodes its own input, and fails alone)
        pass
    for chunk in plan.chunks:
        if not _run_chunk(forwards, chunk, result):
            break  # out of blocks: the later chunks wait for the next step, as they are


def _run_chunk(forwards: StepForwards, chunk: Chunk, result: StepResult) -> bool:
    """One prompt chunk in a forward of its own; False when the pool had no blocks for it."""
    try:
        logits = attempts(lambda: forwards.chunk(chunk))
    except PoolExhaustedError as error:
        result.exhausted[chunk.request] = error
        return False
    except Exception as error:  # noqa: BLE001 (failed twice alone: the request's own failure)
        result.failures[chunk.request] = error
        return True
    try:
        choose_for_chunk(chunk, logits, result)
    except BaseException:
        chunk.cache.settle()
        raise
    chunk.cache.commit()
    return True


def _run_decode(forwards: StepForwards, cache: PagedCache, requests: list[Request], result: StepResult) -> None:
    """Every running request's next token in one forward; failures isolated as the module docstring says."""
    try:
        logits = _decode_isolating(forwards, cache, requests, result)
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


def _decode_isolating(
    forwards: StepForwards, cache: PagedCache, requests: list[Request], result: StepResult
) -> torch.Tensor | None:
    """The decode forward's logits ``[B, V]``, tried twice; then None with the rows that fail alone in
    `result`, or, when none does, the logits of one last try together (whose failure propagates)."""
    try:
        return attempts(lambda: forwards.decode(cache, requests))
    except PoolExhaustedError:
        raise
    except Exception:  # noqa: BLE001 (failed twice: find the rows that fail alone)
        culprits = _rows_failing_alone(forwards, cache, requests)
    if culprits:
        result.failures.update(culprits)
        return None
    return forwards.decode(cache, requests)


def _rows_failing_alone(
    forwards: StepForwards, cache: PagedCache, requests: list[Request]
) -> dict[Request, BaseException]:
    """Each request whose decode row fails when run alone, on a fork of `cache` dropped afterwards."""
    culprits: dict[Request, BaseException] = {}
    for row, request in enumerate(requests):
        probe = cache.fork()  # shares every block; its writes copy the block they go to first
        try:
            probe.batch_select_indices(torch.tensor([row]))
            attempts(lambda: _forward_and_drop(forwards, probe, request))  # a transient fault convicts nobody
        except PoolExhaustedError:
            pass  # no room to try it alone: no evidence against it
        except Exception as error:  # noqa: BLE001 (what it fails with alone)
            culprits[request] = error
        finally:
            probe.release()
    return culprits


def _forward_and_drop(forwards: StepForwards, probe: PagedCache, request: Request) -> None:
    """`request`'s decode row alone on `probe` (a one-row fork), its step dropped whatever happens."""
    try:
        forwards.decode(probe, [request])
    finally:
        probe.settle()
