"""The Ray Serve routers (cluster/router.py) driven as Serve drives them, with no Ray cluster: built with the keyword
arguments Serve's router passes, fed replicas that only carry what a router reads, and called back as Serve calls."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

pytest.importorskip("ray.serve", reason="mtpserve[cluster] (ray[serve]) is not installed")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter  # noqa: E402

from mtpserve.cluster.router import PrefixRouter, SessionRouter  # noqa: E402
from mtpserve.engine.request import Request  # noqa: E402

DEPLOYMENT = DeploymentID(name="engine", app_name="mtpserve")
SYSTEM = list(range(1000, 1100))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # Serve's routers run on asyncio


@dataclass
class FakeReplica:
    """What a router reads of Serve's RunningReplica (and what update_replicas probes)."""

    replica_id: ReplicaID
    max_ongoing_requests: int = 4

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def replicas(*names: str, capacity: int = 4) -> list[FakeReplica]:
    return [FakeReplica(ReplicaID(unique_id=n, deployment_id=DEPLOYMENT), capacity) for n in names]


def build(cls: type[RequestRouter], **router_kwargs) -> RequestRouter:
    """As Serve's Router.request_router builds one, then initialize_state with request_router_kwargs."""
    router = cls(
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.REPLICA,
        self_node_id="node",
        self_actor_id="gateway",
        self_actor_handle=None,
        use_replica_queue_len_cache=True,
        create_replica_wrapper_func=lambda info: info,
        prefer_local_node_routing=False,
        prefer_local_az_routing=False,
        self_availability_zone=None,
    )
    router.initialize_state(**router_kwargs)
    return router


def generate(request_id: str, prompt: list[int], session: str | None = None) -> PendingRequest:
    """A `generate.remote(request, session=...)` call as Serve hands it to the router."""
    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id, call_method="generate")
    return PendingRequest(args=[Request(prompt=prompt)], kwargs={"session": session}, metadata=metadata)


def names(ranks) -> list[str]:
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0].replica_id.unique_id for rank in ranks]


async def send(router: RequestRouter, pr: PendingRequest, candidates: list[FakeReplica]) -> FakeReplica:
    """One routing round: rank, the first rank accepts, Serve reports it routed."""
    ranks = await router.choose_replicas(candidates, pr)
    assert pr.routing_context.should_backoff  # all candidates offered: Serve must back off before asking again
    chosen = ranks[0][0]
    router.on_request_routed(pr, chosen.replica_id, result=None)
    return chosen


@pytest.mark.anyio
async def test_prefix_router_keeps_conversations_and_splits_them():
    router = build(PrefixRouter)
    pool = replicas("a", "b")
    rng = random.Random(1)
    histories = [SYSTEM + [rng.randrange(5000, 9000) for _ in range(40)] for _ in range(8)]
    placed: dict[int, set[str]] = {s: set() for s in range(8)}
    for turn in range(3):
        sent = [(f"t{turn}s{s}", await send(router, generate(f"t{turn}s{s}", histories[s]), pool)) for s in range(8)]
        for s, (request_id, replica) in enumerate(sent):
            placed[s].add(replica.replica_id.unique_id)
            router.on_request_completed(replica.replica_id, request_id)
            histories[s] += [rng.randrange(5000, 9000) for _ in range(60)]
    assert all(len(p) == 1 for p in placed.values()), placed
    assert Counter(next(iter(p)) for p in placed.values()) == {"a": 4, "b": 4}


@pytest.mark.anyio
async def test_prefix_router_puts_the_owner_first_and_counts_serve_queue_lengths():
    router = build(PrefixRouter)
    pool = replicas("a", "b", "c", capacity=2)
    conversation = SYSTEM + list(range(7000, 7100))
    owner = await send(router, generate("r1", conversation), pool)
    router.on_request_completed(owner.replica_id, "r1")
    assert names(await router.choose_replicas(pool, generate("r2", conversation + [5] * 30)))[0] == "a"
    router.on_request_completed(pool[0].replica_id, "r2")  # refused: only the pick goes
    # Serve's cache says b is at max_ongoing_requests (other gateways' requests): the owner a first, then c, then b.
    router.use_serve_queue_lengths = True  # several gateways; off by default (one gateway counts it all)
    router.replica_queue_len_cache.update(pool[1].replica_id, 2)
    assert names(await router.choose_replicas(pool, generate("r3", conversation))) == ["a", "c", "b"]


@pytest.mark.anyio
async def test_prefix_router_accounting_follows_serve_callbacks():
    router = build(PrefixRouter)
    pool = replicas("a", "b", capacity=1)
    first = await send(router, generate("r1", list(range(200))), pool)
    assert first.replica_id.unique_id == "a"
    # a is busy with r1: a new prompt goes to b, and a refusal report on a must not free r1's place.
    router.on_request_completed(first.replica_id, "r-refused")
    assert names(await router.choose_replicas(pool, generate("r2", list(range(500, 700)))))[0] == "b"
    router.on_request_completed(pool[1].replica_id, "r2")
    router.on_request_completed(first.replica_id, "r1")
    # both idle again: a new conversation goes where fewer are held (r2 was only ranked, never routed: b holds none)
    assert names(await router.choose_replicas(pool, generate("r3", list(range(900, 1100)))))[0] == "b"


@pytest.mark.anyio
async def test_prefix_router_forgets_a_dead_replica():
    router = build(PrefixRouter)
    pool = replicas("a", "b")
    conversation = SYSTEM + list(range(7000, 7100))
    owner = await send(router, generate("r1", conversation), pool)
    assert owner.replica_id.unique_id == "a"
    router.on_replica_actor_died(owner.replica_id)
    router.on_request_completed(owner.replica_id, "r1")  # late report for the dead replica
    ranks = await router.choose_replicas(pool[1:], generate("r2", conversation))
    assert names(ranks) == ["b"]
    # A replica back under the same id would hold nothing of the conversation: no owner, the least loaded first.
    router.on_request_completed(pool[1].replica_id, "r2")
    router.on_request_routed(generate("r3", [1] * 32), pool[1].replica_id, result=None)
    assert names(await router.choose_replicas(pool, generate("r4", conversation))) == ["a", "b"]


@pytest.mark.anyio
async def test_update_replicas_drops_stopped_replicas():
    router = build(PrefixRouter)
    pool = replicas("a", "b")
    router.update_replicas(pool)
    conversation = SYSTEM + list(range(7000, 7100))
    owner = await send(router, generate("r1", conversation), pool)
    router.on_request_completed(owner.replica_id, "r1")
    router.update_replicas([r for r in pool if r is not owner])  # scaled down
    assert router._policy.depth(owner.replica_id, router._policy.blocks(conversation)) == 0


@pytest.mark.anyio
async def test_calls_without_a_prompt_go_to_the_least_loaded():
    router = build(PrefixRouter)
    pool = replicas("a", "b")
    await send(router, generate("r1", list(range(100))), pool)
    stats = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata("s", "s", call_method="stats"))
    assert names(await router.choose_replicas(pool, stats)) == ["b", "a"]
    assert await router.choose_replicas([], stats) == []


@pytest.mark.anyio
async def test_router_kwargs_reach_the_policy():
    router = build(PrefixRouter, block=32, max_blocks_per_replica=10)
    assert (router._policy.block, router._policy.max_blocks_per_replica) == (32, 10)
    with pytest.raises(TypeError):
        build(PrefixRouter, blocks=32)  # a misspelt kwarg fails loudly, not silently ignored


@pytest.mark.anyio
async def test_session_router_sticks_to_the_key_and_spills_when_full():
    router = build(SessionRouter)
    pool = replicas("a", "b", "c", "d", capacity=1)
    ranks = names(await router.choose_replicas(pool, generate("r1", [1, 2, 3], session="user-7")))
    router.on_request_completed(pool[0].replica_id, "r1")  # (refused somewhere: the pick goes)
    for i in range(3):
        pr = generate(f"s{i}", list(range(10 * i, 10 * i + 5)), session="user-7")
        assert names(await router.choose_replicas(list(reversed(pool)), pr)) == ranks
        router.on_request_completed(pool[0].replica_id, f"s{i}")
    owner = next(r for r in pool if r.replica_id.unique_id == ranks[0])
    router.on_request_routed(generate("busy", [0], session="user-7"), owner.replica_id, result=None)
    assert names(await router.choose_replicas(pool, generate("r2", [9], session="user-7"))) == ranks[1:] + ranks[:1]
    # No key: the least loaded.
    assert names(await router.choose_replicas(pool, generate("r3", [9])))[-1] == ranks[0]


@pytest.mark.anyio
async def test_session_router_forgets_a_dead_replica():
    router = build(SessionRouter)
    pool = replicas("a", "b", "c")
    first = names(await router.choose_replicas(pool, generate("r1", [1], session="k")))[0]
    dead = next(r for r in pool if r.replica_id.unique_id == first)
    router.on_replica_actor_died(dead.replica_id)
    rest = [r for r in pool if r is not dead]
    assert first not in names(await router.choose_replicas(rest, generate("r2", [1], session="k")))
    assert dead.replica_id not in router._policy.ring.members
