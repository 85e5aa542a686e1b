"""Ray Serve request routers for the engine deployment: routing.py's policies behind Serve's RequestRouter API.

Serve calls `choose_replicas` for each attempt to place a request and tries the returned ranks in order (a replica at
its max_ongoing_requests refuses and the next rank is tried); `on_request_routed` when a replica accepted it,
`on_request_completed` when it ended (also for a refused attempt), `on_replica_actor_died` when a replica is gone.
The engine is called as `generate.remote(request, session=key)` (remote.py): `args[0]` is the `Request`, whose
`prompt` the prefix router hashes, and `kwargs["session"]` is the session router's key. Calls without a prompt
(anything but `generate`) go to the least-loaded replica.

No FIFOMixin: it hands a replica found for one request to the oldest waiting request instead, which would send a
conversation's turn to the replica chosen for some other conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .routing import BLOCK, MAX_BLOCKS_PER_REPLICA, PICK_TTL_S, VIRTUAL_NODES, PrefixPolicy, SessionPolicy


def replica_name(replica_id: ReplicaID) -> str:
    """A replica's stable name: its unique id, the same in every process and across controller restarts."""
    return replica_id.unique_id


def prompt_tokens(pending_request: PendingRequest) -> Sequence[int] | None:
    """The prompt of a `generate` call (its first argument's `prompt`), None for any other call."""
    if not pending_request.args:
        return None
    prompt = getattr(pending_request.args[0], "prompt", None)
    return prompt if isinstance(prompt, list | tuple) else None


def session_key(pending_request: PendingRequest) -> str | None:
    """The call's `session` keyword (remote.py), else Serve's own session id (a handle's `session_id` option)."""
    session = pending_request.kwargs.get("session") if pending_request.kwargs else None
    return session or pending_request.metadata.session_id or None


class _PolicyRouter(RequestRouter):
    """What both routers share: the candidates' capacities and Serve's view of their queues, the ranks mapped back to
    replicas, and the policy kept in step with Serve's lifecycle calls."""

    _policy: PrefixPolicy[ReplicaID] | SessionPolicy[ReplicaID]

    def _capacities(self, candidates: Sequence[RunningReplica]) -> dict[ReplicaID, int]:
        return {r.replica_id: r.max_ongoing_requests for r in candidates}

    # Whether Serve's cached queue lengths raise the router's own counts: they count other gateways' requests, but
    # they also lag (an entry stays valid for seconds), and with the one gateway mtpserve deploys the router's own
    # counts are complete; a stale "full" sent every request of a test's burst to the other replica's queue.
    use_serve_queue_lengths = False

    def _observed(self, candidates: Sequence[RunningReplica]) -> dict[ReplicaID, int]:
        """Serve's cached queue lengths, with `use_serve_queue_lengths` (several gateways); stale entries left out."""
        if not (self.use_serve_queue_lengths and self._use_replica_queue_len_cache):
            return {}
        cache = self.replica_queue_len_cache
        lengths = {r.replica_id: cache.get(r.replica_id) for r in candidates}
        return {replica: n for replica, n in lengths.items() if n is not None}

    @staticmethod
    def _to_running(ranks: list[list[ReplicaID]], candidates: Sequence[RunningReplica]) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidates}
        return [[by_id[replica] for replica in rank] for rank in ranks]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is None:
            return [candidate_replicas]
        # The ranks cover every candidate: when none takes the request, back off before the next round (Serve
        # re-asks at once unless the router says so).
        pending_request.routing_context.should_backoff = True
        ids = [r.replica_id for r in candidate_replicas]
        ranks = self._rank(
            pending_request, ids, self._capacities(candidate_replicas), self._observed(candidate_replicas)
        )
        return self._to_running(ranks, candidate_replicas)

    def _rank(
        self,
        pending_request: PendingRequest,
        candidates: list[ReplicaID],
        capacities: dict[ReplicaID, int],
        observed: dict[ReplicaID, int],
    ) -> list[list[ReplicaID]]:
        raise NotImplementedError

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._policy.completed(internal_request_id, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._policy.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # Replicas the controller stopped (scale-down) never get on_replica_actor_died.
        self._policy.retain(r.replica_id for r in replicas)


class PrefixRouter(_PolicyRouter):
    """Sends a conversation's turn to the replica that served the prompt it extends, new conversations to the least
    loaded (routing.PrefixPolicy).

    request_router_kwargs: `block` (tokens per hashed block, default 16), `max_blocks_per_replica` (hashes kept per
    replica, default 200,000), `pick_ttl_s` (how long an unconfirmed pick counts as load, default 30).
    """

    _policy: PrefixPolicy[ReplicaID]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._policy = PrefixPolicy(name=replica_name)

    def initialize_state(
        self, block: int = BLOCK, max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA, pick_ttl_s: float = PICK_TTL_S
    ) -> None:
        self._policy = PrefixPolicy(
            block=block, max_blocks_per_replica=max_blocks_per_replica, pick_ttl_s=pick_ttl_s, name=replica_name
        )

    def _rank(
        self,
        pending_request: PendingRequest,
        candidates: list[ReplicaID],
        capacities: dict[ReplicaID, int],
        observed: dict[ReplicaID, int],
    ) -> list[list[ReplicaID]]:
        tokens = prompt_tokens(pending_request)
        if tokens is None:
            return self._policy.rank_blocks(candidates, (), capacities, observed)
        blocks = self._policy.blocks(tokens)
        return self._policy.choose(
            pending_request.metadata.internal_request_id, candidates, blocks, capacities, observed
        )

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        tokens = prompt_tokens(pending_request)
        blocks = self._policy.blocks(tokens) if tokens is not None else ()
        self._policy.routed(pending_request.metadata.internal_request_id, replica_id, blocks)


class SessionRouter(_PolicyRouter):
    """Keeps each session key on one replica by consistent hashing, spilling clockwise past a full one; no key: the
    least loaded (routing.SessionPolicy).

    request_router_kwargs: `vnodes` (points per replica on the ring, default 64), `pick_ttl_s` (default 30).
    """

    _policy: SessionPolicy[ReplicaID]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._policy = SessionPolicy(name=replica_name)

    def initialize_state(self, vnodes: int = VIRTUAL_NODES, pick_ttl_s: float = PICK_TTL_S) -> None:
        self._policy = SessionPolicy(vnodes=vnodes, pick_ttl_s=pick_ttl_s, name=replica_name)

    def _rank(
        self,
        pending_request: PendingRequest,
        candidates: list[ReplicaID],
        capacities: dict[ReplicaID, int],
        observed: dict[ReplicaID, int],
    ) -> list[list[ReplicaID]]:
        if prompt_tokens(pending_request) is None:
            return self._policy.rank(candidates, None, capacities, observed)
        session = session_key(pending_request)
        return self._policy.choose(
            pending_request.metadata.internal_request_id, candidates, session, capacities, observed
        )

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._policy.routed(pending_request.metadata.internal_request_id, replica_id)
