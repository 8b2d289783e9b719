"""`Scheduler`: what each step of a `ContinuousBatcher` runs, and what becomes of each request after it.

Requests wait in `waiting` (oldest first), then prefill (`prefilling`: each in its own cache, its prompt in
chunks), then decode (`running`: one row each of the running cache, in order). Each step:

1. **admit** waiting requests, oldest first, while the pool can hold every request in flight at every step
   until each reaches its longest (prompt and ``max_new_tokens``; `engine.admission`), or, with
   ``reserve_new_tokens=False``, while its prompt fits with one block of headroom per request in flight,
   and fewer than `max_running` are in flight; an admitted request starts from the longest prefix the pool
   has cached, and a request whose prompt starts with full blocks a prefilling request has still to compute
   waits for them (behind it, the requests that share nothing are admitted) rather than computing them twice;
2. **plan** a decode row for every running request and the prompt chunks of the prefilling ones, oldest
   first, `max_step_tokens` prompt tokens in all (`plan`); `StepRoles` gives each row the rest of its role
   (packed or apart, drafts, constraints: `engine.roles`), and the executor runs the plan as it says; on a
   model with conv / recurrent states a chunk ends at a block boundary (`snapshot_chunk_end`), where its
   states are kept as a snapshot a later prompt can start from;
3. **apply** what the step kept (`apply`): the roles learn from it, each picked token joins its request (and
   its constraints follow it); a request whose prompt is
   done joins the running batch by block table (no key or value is copied); a finished request leaves at
   once and its blocks go back (full ones stay findable by prefix); a failed one fails alone.

When the pool runs out for the decode rows (without reservation, or when another cache on the pool takes
blocks), the newest prefilling request gives its blocks back, or, when none is prefilling, the newest
running request is preempted: its blocks are freed and it waits at the front of the queue, to be computed
again (prompt and tokens so far) when blocks free up, so its output is what it would have been. Decode rows
run before prompt chunks, and a prompt chunk that finds no blocks sends its request back to the front of
the queue the same way: a prompt never starves a running request. A request that can never fit fails on
its own handle with `PoolExhaustedError`: a prompt larger than the pool at admission, or a request running
alone whose own blocks fill a layer group.

The choices of one prompt (`ContinuousBatcher.submit_group`) wait, prefill and are admitted together, as
their leader with its followers: the prompt is computed once, each choice picks its first token from its
last logits, and each joins the running batch in a row that shares the prompt's blocks (copy-on-write); from
then on each is a request of its own. Cancelling a choice leaves the others as they are: a follower takes the
lead when the leader goes. A prompt whose log-probabilities are asked for starts from the prefix cache only as
far as `prompt_scores` holds its blocks' log-probabilities (cached blocks hold keys and values, not logits), and
keeps them there for the prompts that follow (`engine.prompt_scores`); without it, it is computed whole.

Only the loop's thread calls the scheduler. Other threads read `counts`, replaced whole after each step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..cache.paged_cache import PagedCache
from ..errors import PoolExhaustedError
from .admission import lifetimes_in_flight, pool_holds
from .admission_rules import (
    blocks_needed,
    fills_a_group,
    fits_with_headroom,
    larger_than_pool,
    never_fits,
    snapshot_chunk_end,
    start_from_cache,
    starts_from_cache,
    waits_for_prefix,
)
from .inbox import Inbox
from .outcomes import Counts, Outcomes
from .plan import Chunk, StepPlan
from .prompt_scores import PromptScores, record_prompt_logprobs
from .request import Request
from .roles import StepRoles
from .step_result import StepResult


@dataclass
class Prefill:
    """A request whose prompt is being computed into its own cache, `done` tokens so far."""

    request: Request
    cache: PagedCache
    done: int

    def next_chunk(self, budget: int, keeps_states: bool) -> Chunk:
        """Its next prompt chunk, at most `budget` tokens (the rest of the prompt when it reads images: see
        `engine.media`); on a model with states (`keeps_states`) it ends where `snapshot_chunk_end` says, so
        that its states are kept at the prompt's last block boundary."""
        end, tokens = self.done + budget, self.request.tokens
        if self.request.media is not None and self.done < self.request.media.end:
            end = len(tokens)  # the images are read in one forward, with every placeholder of theirs
        elif keeps_states:
            end = snapshot_chunk_end(self.done, end, len(tokens), self.cache.pool.block_size)
        return Chunk(self.request, self.cache, self.done, tokens[self.done : end])


class Scheduler:
    """Decides what runs next on one pool; see the module docstring for the policy (its rules for one request
    are in `admission_rules` and `admission`; what became of the requests that left, in `outcomes`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        running_cache: PagedCache,
        inbox: Inbox,
        roles: StepRoles,
        *,
        max_running: int,
        max_step_tokens: int,
        reserve_new_tokens: bool,
        prompt_scores: PromptScores | None = None,
    ):
        self.model = model
        self.prompt_scores = prompt_scores  # prompt log-probabilities by block, kept for the prompts that follow
        self.running_cache = running_cache  # one row per running request (manual_commit: the executor commits)
        self.pool = running_cache.pool
        self.inbox = inbox
        self.roles = roles  # the rest of each step's plan: packing, drafts, constraints
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.reserve_new_tokens = reserve_new_tokens
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Prefill] = []
        self.running: list[Request] = []
        self._requeued: set[Request] = set()  # waiting requests that started before (not counted by the inbox)
        self.outcomes = Outcomes()  # what became of the requests that left, and the totals
        self.counts = Counts()

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.running)

    # ------------------------------------------------------------------ each step

    def take_new(self) -> None:
        """Queue what was submitted since the last step, and let cancelled requests leave."""
        self.waiting.extend(self.inbox.take())
        waiting = deque()
        for request in self.waiting:
            leader = self._without_cancelled(request)
            if leader is None:
                self._left_queue(request)
                continue
            if leader is not request and request in self._requeued:
                self._requeued.discard(request)
                self._requeued.add(leader)
            waiting.append(leader)
        self.waiting = waiting
        for prefill in list(self.prefilling):
            prefill.request = self._without_cancelled(prefill.request)
            if prefill.request is None:
                self.prefilling.remove(prefill)
                prefill.cache.release()  # its full blocks stay findable by prefix
        rows = [row for row, request in enumerate(self.running) if request.handle.cancel_requested]
        for row in rows:
            self.outcomes.cancel(self.running[row])
        self._drop_rows(rows)
        self._publish()

    def plan(self) -> StepPlan | None:
        """Admit what fits, then this step's decode rows and prompt chunks; None when nothing can run."""
        self._admit()
        self._publish()
        if not (self.prefilling or self.running):
            return None
        budget, chunks = self.max_step_tokens, []
        for prefill in self.prefilling:
            if budget <= 0:
                break
            chunks.append(prefill.next_chunk(budget, self.running_cache.keeps_states))
            budget -= len(chunks[-1].tokens)
        return self.roles.plan(list(self.running), self.running_cache, chunks)

    def apply(self, plan: StepPlan, result: StepResult) -> None:
        """Let each request of `plan` take what the step kept for it (see `StepResult`)."""
        self.roles.learn(plan, result)
        leaving = []
        for row, request in enumerate(plan.running):
            if request in result.failures:
                self.outcomes.finish(request, result.failures[request])
                leaving.append(row)
            elif request in result.choices:
                for choice in result.accepted.get(request, ()):
                    request.accept(choice)
                request.accept(result.choices[request])
                if result.choices[request].finished:
                    self.outcomes.finish(request)
                    leaving.append(row)
        self._drop_rows(leaving)
        for chunk in reversed(plan.chunks):  # reversed: requests sent back queue up in their order
            self._apply_chunk(chunk, result)
        if result.decode_exhausted is not None:
            self._make_room(result.decode_exhausted)
        for row in plan.constrained:  # forward by the tokens kept, back past drafts the step did not keep
            row.constraint.follow(row.request.generated)
        self._publish()

    def _apply_chunk(self, chunk: Chunk, result: StepResult) -> None:
        request = chunk.request
        prefill = next(p for p in self.prefilling if p.request is request)
        members = request.group
        picked = [member for member in members if member in result.choices]
        if request in result.kept:
            record_prompt_logprobs(request, result, self.prompt_scores)
            prefill.done += len(chunk.tokens)
            return
        if not (picked or request in result.failures or request in result.exhausted):
            return  # did not run this step
        self.prefilling.remove(prefill)
        if request in result.exhausted and not larger_than_pool(result.exhausted[request]):  # others hold the blocks
            prefill.cache.release()  # its full blocks stay findable by prefix: they are reused when it starts again
            self._requeue(request, "prefill_retries")
            return
        if not picked:  # the prompt's forward failed (or every choice's pick, or it can never fit): each choice fails
            prefill.cache.release()
            cause = result.failures.get(request, result.exhausted.get(request))
            for member in members:
                self.outcomes.finish(member, result.failures.get(member, cause))
            return
        record_prompt_logprobs(request, result, self.prompt_scores)
        request.followers = []  # from here on each choice is a request of its own
        joining = []
        for member in members:
            if member not in result.choices:
                self.outcomes.finish(member, result.failures[member])
                continue
            member.prompt_logprobs = list(request.prompt_logprobs)
            member.accept(result.choices[member])
            if result.choices[member].finished:
                self.outcomes.finish(member)
            else:
                joining.append(member)
        for member in joining[:-1]:  # the other choices share every block of the prompt (copy-on-write)
            self.running_cache.add_rows_from(prefill.cache.fork())
            self.running.append(member)
        if joining:
            self.running_cache.add_rows_from(prefill.cache)  # its blocks change hands, no copy
            self.running.append(joining[-1])
        else:
            prefill.cache.release()

    # ------------------------------------------------------------------ admission

    def _admit(self) -> None:
        """Start waiting requests, oldest first, while the pool can hold their tokens; those waiting for a prefix
        in progress stay where they are in the queue."""
        waiting_for_prefix: list[Request] = []
        while self.waiting and self._in_flight() < self.max_running:
            request = self.waiting[0]
            if self._prefix_in_progress(request):
                waiting_for_prefix.append(self.waiting.popleft())
                continue
            needed = blocks_needed(self.pool, len(request.tokens) + 1)
            error = never_fits(self.pool, needed)
            if error is not None:  # more than the whole (fixed) pool: it could never run
                self.waiting.popleft()
                self._left_queue(request)
                for member in request.group:
                    self.outcomes.finish(member, error)
                continue
            if not self._admissible(request, needed):
                if not (request.followers and self._in_flight() == 0):
                    break
                self._split(request)  # its choices do not fit the pool at once: they run one by one
                continue
            self.waiting.popleft()
            self._left_queue(request)
            cache = self.running_cache.empty_like()
            done = start_from_cache(cache, request, self.prompt_scores)
            self.outcomes.tally["prefix_hit_tokens"] += done
            self.prefilling.append(Prefill(request, cache, done))
        self.waiting.extendleft(reversed(waiting_for_prefix))

    def _prefix_in_progress(self, request: Request) -> bool:
        """Whether `request` should wait for full blocks a prefilling request is computing (`waits_for_prefix`)."""
        if not starts_from_cache(request, self.prompt_scores) or self.running_cache.keeps_states:
            return False  # states: no prefix to wait for
        prefilling = ((prefill.request.key_tokens, prefill.done) for prefill in self.prefilling)
        return waits_for_prefix(request.key_tokens, prefilling, self.pool.block_size)

    def _admissible(self, request: Request, needed: list[int]) -> bool:
        """Whether `request` may start now, beside the requests in flight, in every layer group.

        With `reserve_new_tokens`: while the pool can hold every request in flight at every step until each
        reaches ``max_length`` (`peak_blocks`), so that none is preempted later. Otherwise while `needed` (its
        prompt and next token) fits with one block of headroom per request in flight.
        """
        if not self.reserve_new_tokens:
            return fits_with_headroom(self.pool, needed, self._in_flight() + len(request.group))
        prefilling = [(p.request, p.done) for p in self.prefilling]
        lifetimes = lifetimes_in_flight(self.running, prefilling, request, self.max_step_tokens, self.pool.block_size)
        return pool_holds(self.pool, lifetimes, [self.running_cache, *(p.cache for p in self.prefilling)])

    def _split(self, request: Request) -> None:
        """Queue `request`'s followers right after it, each a request of its own (their tokens are the same:
        each samples with its own generator)."""
        for follower in reversed(request.followers):
            self.waiting.insert(1, follower)
            self._requeued.add(follower)  # never counted by the inbox, which counted the group once
        request.followers = []

    def _in_flight(self) -> int:
        """Requests prefilling (each choice of a prompt counted) or running."""
        return len(self.running) + sum(len(prefill.request.group) for prefill in self.prefilling)

    # ------------------------------------------------------------------ leaving

    def _drop_rows(self, rows: list[int]) -> None:
        """Drop running rows `rows` from the running batch (their blocks go back unless shared)."""
        if not rows:
            return
        keep = [row for row in range(len(self.running)) if row not in set(rows)]
        self.running = [self.running[row] for row in keep]
        self.running_cache.batch_select_indices(torch.tensor(keep, dtype=torch.long))
        self.running_cache.drop_leading_padding()

    def _make_room(self, error: PoolExhaustedError) -> None:
        """The decode rows found no blocks: free the newest prefilling request's blocks (a prompt never starves a
        running row), else the newest running request's, and queue it first, to be computed again later. A
        request running alone whose own blocks fill a layer group can never grow: it fails with `error`. When
        the step itself gave back enough blocks (a request finished), nothing is preempted: the rows run at
        the next step."""
        if all(blocks.can_allocate(len(self.running)) for blocks in self.pool.groups):
            return  # one block per row is the most a decode step takes (a new block, or a copy of a shared one)
        if self.prefilling:
            prefill = self.prefilling.pop()
            prefill.cache.release()  # its full blocks stay findable by prefix
            self._requeue(prefill.request, "prefill_retries")
            return
        if len(self.running) == 1 and fills_a_group(self.pool, self.running_cache):
            self.outcomes.finish(self.running[0], error)
        else:
            self._requeue(self.running[-1], "preemptions")
        self._drop_rows([len(self.running) - 1])

    def _requeue(self, request: Request, counter: str) -> None:
        """Queue a started request first again (its blocks are freed by the caller)."""
        self.waiting.appendleft(request)
        self._requeued.add(request)
        self.outcomes.tally[counter] += 1

    def _left_queue(self, request: Request) -> None:
        """`request` leaves the waiting queue (started, or gone): the inbox counts the ones it queued."""
        if request in self._requeued:
            self._requeued.discard(request)
        else:
            self.inbox.started()

    def _without_cancelled(self, request: Request) -> Request | None:
        """`request`'s choices that are not cancelled (the cancelled ones end now), led by the first of them;
        None when every choice is cancelled. A follower that takes the lead takes the prompt's progress too."""
        members = [member for member in request.group if not member.handle.cancel_requested]
        if len(members) == len(request.group):
            return request
        for member in request.group:
            if member.handle.cancel_requested:
                self.outcomes.cancel(member)
        request.followers = []
        if not members:
            return None
        leader, leader.followers = members[0], members[1:]
        leader.prompt_logprobs = request.prompt_logprobs
        return leader

    def _publish(self) -> None:
        """Show the state in `counts`, then end the handles of the requests that left (so that a caller woken by
        its handle reads counts that include it)."""
        waiting = sum(len(request.group) for request in self.waiting)
        prefilling = sum(len(prefill.request.group) for prefill in self.prefilling)
        self.counts = self.outcomes.counts(waiting, prefilling, len(self.running))
        self.outcomes.end_handles()

    def fail_in_flight(self, error: BaseException) -> None:
        """A step failed outside any one request: fail every request in flight with `error`, free their blocks."""
        for prefill in self.prefilling:
            prefill.cache.release()
            for member in prefill.request.group:
                self.outcomes.finish(member, error)
        for request in self.running:
            self.outcomes.finish(request, error)
        self.prefilling, self.running = [], []
        self.running_cache.reset()
        self._publish()

    def shutdown(self, error: BaseException) -> None:
        """Fail every request left, queued ones included, with `error`, and give every block back."""
        self.waiting.extend(self.inbox.take())
        for request in self.waiting:
            self._left_queue(request)
            for member in request.group:
                self.outcomes.finish(member, error)
        self.waiting.clear()
        self.fail_in_flight(error)

