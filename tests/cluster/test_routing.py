"""The routing policies (cluster/routing.py) as plain Python: prefix affinity, spill, ties, picks, the hash ring."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from mtpserve.cluster.routing import (
    ROUTERS,
    BlockIndex,
    HashRing,
    LoadBook,
    PrefixPolicy,
    SessionPolicy,
    prefix_block_hashes,
)

SYSTEM = list(range(1000, 1100))  # a shared system prompt: 6 whole blocks and a partial one


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def words(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(5000, 50000) for _ in range(rng.randrange(lo, hi))]


def test_routers_map_names_to_class_paths():
    assert ROUTERS == {
        "prefix": "mtpserve.cluster.router:PrefixRouter",
        "session": "mtpserve.cluster.router:SessionRouter",
        "pow2": None,
    }


def test_block_hashes_chain_whole_blocks_only():
    tokens = list(range(50))
    hashes = prefix_block_hashes(tokens, block=16)
    assert len(hashes) == 3  # 48 tokens hashed, the last 2 are a partial block
    assert prefix_block_hashes(tokens[:48]) == hashes
    assert prefix_block_hashes(tokens + [7] * 20)[:3] == hashes  # an extension shares every earlier block
    changed = [99] + tokens[1:]
    assert all(a != b for a, b in zip(prefix_block_hashes(changed), hashes))  # each hash covers its whole prefix
    assert prefix_block_hashes(tokens[:15]) == []
    with pytest.raises(ValueError):
        prefix_block_hashes(tokens, block=0)


def test_block_index_depth_and_lru_bound():
    a = prefix_block_hashes(list(range(64)))
    b = prefix_block_hashes(list(range(100, 164)))
    index = BlockIndex(max_blocks=6)
    index.add(a)
    assert index.depth(a) == 4
    assert index.depth(prefix_block_hashes(list(range(32)) + [5] * 32)) == 2  # shares a's first two blocks
    assert index.depth(b) == 0
    index.add(b)  # 8 hashes into 6: a's two oldest go
    assert len(index) == 6
    assert index.depth(b) == 4
    assert index.depth(a) == 4  # a's deepest hash is still held and stands for its whole prefix
    assert index.depth(a[:2]) == 0


def route(policy: PrefixPolicy, request_id: str, candidates: list[str], tokens: list[int]) -> str:
    """Rank as the router would, then let the first rank take it (a replica that is full would refuse)."""
    blocks = policy.blocks(tokens)
    ranks = policy.choose(request_id, candidates, blocks)
    replica = ranks[0][0]
    policy.routed(request_id, replica, blocks)
    return replica


@pytest.mark.parametrize("burst", [False, True], ids=["routed-one-by-one", "picked-in-a-burst"])
def test_sessions_stay_on_one_replica_and_split_evenly(burst: bool):
    """8 conversations x 4 turns over one system prompt, 2 replicas of capacity 4: each turn goes where the
    conversation's earlier turns went, and the conversations split 4/4."""
    rng = random.Random(0)
    policy: PrefixPolicy[str] = PrefixPolicy(capacity=4)
    replicas = ["a", "b"]
    histories = [SYSTEM + words(rng, 20, 60) for _ in range(8)]
    placed: dict[int, list[str]] = {s: [] for s in range(8)}
    for turn in range(4):
        ids = [f"t{turn}s{s}" for s in range(8)]
        if burst:
            # Serve asks for all 8 before any is confirmed: only the picks tell them apart.
            ranks = [policy.choose(ids[s], replicas, policy.blocks(histories[s])) for s in range(8)]
            for s in range(8):
                policy.routed(ids[s], ranks[s][0][0], policy.blocks(histories[s]))
                placed[s].append(ranks[s][0][0])
        else:
            for s in range(8):
                placed[s].append(route(policy, ids[s], replicas, histories[s]))
        for s in range(8):
            policy.completed(ids[s], placed[s][-1])
            histories[s] += words(rng, 30, 90) + words(rng, 10, 40)  # the reply and the next user turn
    assert all(len(set(p)) == 1 for p in placed.values()), placed
    assert Counter(p[0] for p in placed.values()) == {"a": 4, "b": 4}
    assert policy.load_book.load("a") == policy.load_book.load("b") == 0


def test_next_turn_matches_every_block_of_the_previous_prompt():
    policy: PrefixPolicy[str] = PrefixPolicy()
    turn1 = SYSTEM + list(range(7000, 7040))
    policy.routed("r1", "b", policy.blocks(turn1))
    policy.completed("r1", "b")
    turn2 = turn1 + list(range(8000, 8050))
    assert policy.depth("b", policy.blocks(turn2)) == len(turn1) // 16
    assert policy.rank(["a", "b"], turn2) == [["b"], ["a"]]


def test_the_owner_comes_first_even_counted_full_and_the_others_by_load_after_it():
    """The count of a replica's requests lags its replica (a completion is reported after the client has the reply,
    and its next turn is often sooner): the owner is offered first whatever the count, and a full owner refuses, so
    Serve spills down the ranks, least loaded first."""
    policy: PrefixPolicy[str] = PrefixPolicy(capacity=2)
    conversation = SYSTEM + list(range(7000, 7100))
    policy.routed("first", "a", policy.blocks(conversation))
    policy.completed("first", "a")
    policy.routed("x1", "c", ())  # c busier than b
    assert policy.rank(["a", "b", "c"], conversation) == [["a"], ["b"], ["c"]]
    policy.routed("x2", "a", ())
    policy.routed("x3", "a", ())  # a counted at capacity
    assert policy.rank(["a", "b", "c"], conversation) == [["a"], ["b"], ["c"]]
    policy.routed("x4", "b", ())
    policy.routed("x5", "b", ())  # b full as well: c is the spill
    assert policy.rank(["a", "b", "c"], conversation) == [["a"], ["c"], ["b"]]


def test_new_conversations_go_to_the_least_loaded_then_the_one_holding_fewest():
    """A shared system prompt makes no owner: new conversations spread by load, then by the conversations each
    replica holds (so sequential ones alternate instead of piling onto the replica that saw the system prompt first),
    then the deeper match, then the name."""
    policy: PrefixPolicy[str] = PrefixPolicy(capacity=4)
    for i, replica in enumerate(["a", "b"]):
        policy.routed(f"seed{i}", replica, policy.blocks(SYSTEM + list(range(7000 + 100 * i, 7040 + 100 * i))))
        policy.completed(f"seed{i}", replica)
    fresh = SYSTEM + list(range(9000, 9040))  # a new conversation: a and b both hold only the system prompt
    assert policy.rank(["a", "b", "c"], fresh) == [["c"], ["a"], ["b"]]  # c holds none; a, b tie: name
    policy.routed("busy", "c", ())
    assert policy.rank(["a", "b", "c"], fresh) == [["a"], ["b"], ["c"]]  # load first
    policy.routed("busy2", "a", ())
    assert policy.rank(["a", "b", "c"], fresh) == [["b"], ["c"], ["a"]]  # a and c busy: c holds fewer
    fresh_without_system = list(range(20000, 20100))
    assert policy.rank(["b", "a"], fresh_without_system)[0] == ["b"]  # no match at all: the same order


def test_picks_spread_a_burst_and_expire():
    clock = Clock()
    policy: PrefixPolicy[str] = PrefixPolicy(pick_ttl_s=10.0, clock=clock)
    firsts = [
        policy.choose(f"r{i}", ["a", "b", "c"], policy.blocks(list(range(i * 100, i * 100 + 40)))) for i in range(6)
    ]
    assert [ranks[0][0] for ranks in firsts] == ["a", "b", "c", "a", "b", "c"]
    # A request ranked again does not count its own earlier pick.
    assert policy.choose("r0", ["a", "b", "c"], ())[0] == ["a"]
    clock.now = 11.0
    assert [policy.load_book.load(r) for r in "abc"] == [0, 0, 0]


def test_load_book_counts_routed_requests_until_completed():
    book: LoadBook[str] = LoadBook()
    book.pick("r", "a")
    assert book.load("a") == 1
    book.finish("r", "a")  # refused by a: only the pick goes, nothing goes negative
    assert book.load("a") == 0
    book.pick("r", "a")
    book.start("r", "b")  # a refused it, b took it
    assert (book.load("a"), book.load("b")) == (0, 1)
    book.finish("r", "a")  # a late report of the refusal on a
    assert book.load("b") == 1
    book.start("s", "b")
    book.start("s", "b")  # two calls made while serving one HTTP request share an id
    book.finish("s", "b")
    assert book.load("b") == 2
    book.finish("s", "b")
    book.finish("r", "b")
    book.finish("r", "b")
    assert book.load("b") == 0
    assert book.load("b", observed=3) == 3


def test_dead_replica_is_forgotten():
    policy: PrefixPolicy[str] = PrefixPolicy()
    conversation = SYSTEM + list(range(7000, 7100))
    policy.choose("r1", ["a", "b"], policy.blocks(conversation))
    policy.routed("r1", "a", policy.blocks(conversation))
    policy.choose("r2", ["a", "b"], ())
    policy.forget("a")
    assert policy.depth("a", policy.blocks(conversation)) == 0
    assert policy.load_book.load("a") == 0
    assert policy.rank(["b"], conversation) == [["b"]]
    policy.completed("r1", "a")  # a report arriving after the death changes nothing
    assert policy.load_book.load("a") == 0
    policy.routed("r3", "b", policy.blocks(conversation))
    policy.retain(["c"])
    assert policy.depth("b", policy.blocks(conversation)) == 0
    assert policy.rank([], conversation) == []


def test_session_key_sticks_and_spills_clockwise_when_full():
    policy: SessionPolicy[str] = SessionPolicy(capacity=2)
    replicas = ["a", "b", "c", "d"]
    ranks = policy.rank(replicas, "conversation-1")
    assert sorted(r for (r,) in ranks) == replicas
    assert policy.rank(list(reversed(replicas)), "conversation-1") == ranks  # candidate order does not matter
    assert policy.rank(replicas, "conversation-2") != ranks  # (another key, another owner or order)
    policy.routed("r0", ranks[0][0])
    assert policy.rank(replicas, "conversation-1") == ranks
    policy.routed("r1", ranks[0][0])  # the owner is full: the next replica clockwise, the owner last
    assert policy.rank(replicas, "conversation-1") == ranks[1:] + ranks[:1]
    policy.completed("r1", ranks[0][0])
    assert policy.rank(replicas, "conversation-1") == ranks


def test_no_session_key_goes_to_the_least_loaded():
    policy: SessionPolicy[str] = SessionPolicy(capacity=4)
    policy.routed("x", "a")
    assert policy.rank(["a", "b"], None) == [["b"], ["a"]]
    assert [policy.choose(f"r{i}", ["a", "b"], "")[0][0] for i in range(3)] == ["b", "a", "b"]


def test_consistent_hashing_moves_only_the_new_replicas_share():
    keys = [f"session-{i}" for i in range(4000)]
    ring: HashRing[str] = HashRing(vnodes=64)
    ring.sync(["a", "b", "c", "d"])
    before = {k: ring.walk(k)[0] for k in keys}
    shares = Counter(before.values())
    assert all(0.15 < n / len(keys) < 0.35 for n in shares.values()), shares
    ring.sync(["a", "b", "c", "d", "e"])
    after = {k: ring.walk(k)[0] for k in keys}
    moved = [k for k in keys if after[k] != before[k]]
    assert all(after[k] == "e" for k in moved)  # keys only move to the newcomer
    assert 0.1 < len(moved) / len(keys) < 0.3  # about a fifth
    ring.sync(["a", "b", "d", "e"])  # c leaves: only its keys move
    gone = {k: ring.walk(k)[0] for k in keys}
    assert all(gone[k] == after[k] for k in keys if after[k] != "c")
    # Another router (another process) builds the same ring from the same names.
    other: HashRing[str] = HashRing(vnodes=64)
    other.sync(["e", "d", "b", "a"])
    assert all(other.walk(k)[0] == gone[k] for k in keys[:200])


def test_session_policy_forgets_a_dead_replica():
    policy: SessionPolicy[str] = SessionPolicy()
    replicas = ["a", "b", "c"]
    owner = policy.rank(replicas, "k")[0][0]
    policy.routed("r", owner)
    policy.forget(owner)
    assert owner not in policy.ring.members
    assert policy.load_book.load(owner) == 0
    rest = [r for r in replicas if r != owner]
    assert policy.rank(rest, "k")[0][0] in rest
