"""`PrefixAwareRouter`: send a request to the replica that holds the longest prefix of its prompt.

A Ray Serve request router (``serve.request_router.RequestRouter``) for the engine deployment. The policy,
per request:

1. **Hits.** For each candidate replica, the leading blocks of the prompt it holds: by the `PrefixSummary` it
   last published (its routing stats, every ``request_routing_stats_period_s``), or by this router's memory
   of where it sent recent prompts (their block chains, the newest `memory` blocks), which covers the time
   before the replica's next summary: a burst of requests sharing a new system prompt follows the first.
2. **Affinity, bounded by load.** The replica with the most hits (ties: the least loaded) comes first, unless
   its load (requests in flight, from Serve's queue-length cache or its summary) exceeds the least loaded
   candidate's by more than `imbalance`: then one hot prefix spills over to the others instead of piling up.
3. **No hit** (or too imbalanced): power of two choices, Serve's default: two random candidates, the less
   loaded taken.

Serve then sends the request to the first replica of the first rank that accepts it (its queue below
``max_ongoing_requests``), or tries the next ranks. A replica that dies is dropped from the candidates by
Serve; its summary and this router's memory of it go with it.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .summary import PrefixSummary, prompt_block_keys

SUMMARY_STAT = "prefix_summary"  # the key of a replica's routing stats that holds its PrefixSummary
DEFAULT_IMBALANCE = 4  # requests
DEFAULT_MEMORY = 16384  # blocks
ROUTER_ROOT = b""  # the root this router's own memory of routed prompts chains from


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    """Prefix affinity balanced against load, then power of two choices (see the module docstring).

    Options (``request_router_kwargs``): ``imbalance`` (the most requests the replica with the best prefix
    may have in flight beyond the least loaded one; default 4), ``memory`` (blocks of recently routed
    prompts remembered, each a 16-byte key and a replica id; default 16,384) and ``block_size`` (of the
    replicas' pools, for the memory; default 16).
    """

    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, memory: int = DEFAULT_MEMORY,
                         block_size: int = 16) -> None:
        self._imbalance = imbalance
        self._memory_limit = memory
        self._block_size = block_size
        self._routed: OrderedDict[bytes, ReplicaID] = OrderedDict()  # a prompt block's chained key -> replica

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if len(candidate_replicas) < 2:
            return [candidate_replicas] if candidate_replicas else []
        prompt = _prompt_of(pending_request)
        if prompt:
            routed = self._routed_hits(prompt)
            hits = {r.replica_id: max(_summary_hits(r, prompt), routed.get(r.replica_id, 0)) for r in candidate_replicas}
            load = {r.replica_id: self._load(r) for r in candidate_replicas}
            best = max(candidate_replicas, key=lambda r: (hits[r.replica_id], -load[r.replica_id]))
            if hits[best.replica_id] > 0 and load[best.replica_id] <= min(load.values()) + self._imbalance:
                others = sorted((r for r in candidate_replicas if r is not best),
                                key=lambda r: (-hits[r.replica_id], load[r.replica_id]))
                return [[best], others]
        return [random.sample(candidate_replicas, 2)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: object) -> None:
        """Remember where the prompt went, so that requests sharing its prefix follow it before the next summary."""
        prompt = _prompt_of(pending_request)
        if not prompt:
            return
        for key in prompt_block_keys(prompt, self._block_size, ROUTER_ROOT):
            self._routed[key] = replica_id
            self._routed.move_to_end(key)
        while len(self._routed) > self._memory_limit:
            self._routed.popitem(last=False)

    def _routed_hits(self, prompt: Sequence[int]) -> dict[ReplicaID, int]:
        """The replica the prompt's first block was last sent to, with how many leading blocks went there."""
        first, run = None, 0
        for key in prompt_block_keys(prompt, self._block_size, ROUTER_ROOT):
            replica = self._routed.get(key)
            if replica is None or (first is not None and replica != first):
                break
            first, run = replica, run + 1
        return {} if first is None else {first: run}

    def _load(self, replica: RunningReplica) -> int:
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        if queued is not None:
            return queued
        summary = replica.routing_stats.get(SUMMARY_STAT)
        return summary.in_flight if isinstance(summary, PrefixSummary) else 0


def _prompt_of(request: PendingRequest | None) -> list[int] | None:
    """The prompt's token ids of an engine request (``generate(prompt=...)``), or None for any other call."""
    if request is None:
        return None
    prompt = request.kwargs.get("prompt")
    return prompt if isinstance(prompt, list) else None


def _summary_hits(replica: RunningReplica, prompt: Sequence[int]) -> int:
    summary = replica.routing_stats.get(SUMMARY_STAT)
    return summary.cached_blocks(prompt) if isinstance(summary, PrefixSummary) else 0

