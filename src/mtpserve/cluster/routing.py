"""Which engine replica serves a request, as plain policies (router.py runs them in Ray Serve; docs/cluster-routing.md).

A conversation's prompt cache (KV rows and Gated DeltaNet checkpoints) lives on the replica that served its last turn;
sent anywhere else, the next turn re-reads the whole history. `PrefixPolicy` keeps each prompt where the longest part
of it was seen before; `SessionPolicy` keeps each session key on one replica by consistent hashing. Both fall back to
the least-loaded replica and spill past a full one. Nothing here imports Ray, so the CLI can validate `--router` and
the tests run the policies as they are.

Replicas are any hashable ids (Ray's `ReplicaID` in router.py); `name` turns one into the stable string that tie-breaks
and the hash ring use (Python's `hash` of a string differs from process to process).
"""

from __future__ import annotations

import bisect
import hashlib
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

# --router: the request router's class path for Serve's RequestRouterConfig; None is Serve's default
# (PowerOfTwoChoicesRequestRouter: two random replicas, the shorter queue wins; no affinity).
ROUTERS: dict[str, str | None] = {
    "prefix": "mtpserve.cluster.router:PrefixRouter",
    "session": "mtpserve.cluster.router:SessionRouter",
    "pow2": None,
}

BLOCK = 16  # tokens per hashed block: fine enough to catch a short user turn, coarse enough to hash a long prompt fast
MAX_BLOCKS_PER_REPLICA = 200_000  # ~3.2M tokens of history per replica, ~30 MB of hashes at worst
PICK_TTL_S = 30.0  # a pick not confirmed nor completed by then was abandoned (its caller gave up before sending)
VIRTUAL_NODES = 64  # points per replica on the hash ring: shares typically within ~15% of even (1/sqrt(64))

K = TypeVar("K", bound=Hashable)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


def _hash(data: bytes) -> int:
    return int.from_bytes(_digest(data), "little")


def prefix_block_hashes(tokens: Sequence[int], block: int = BLOCK) -> list[int]:
    """Chained hashes of the prompt's whole blocks of `block` tokens: the i-th covers blocks 0..i, so two prompts share
    the i-th hash when their first (i + 1) * block tokens are equal (barring a 64-bit collision). A partial last block
    is not hashed (the next turn extends it, so it would never match)."""
    if block < 1:
        raise ValueError(f"block must be at least 1, not {block}")
    n_blocks = len(tokens) // block
    data = array("q", tokens[: n_blocks * block]).tobytes()  # 8 bytes a token: any id fits
    step = block * 8
    hashes: list[int] = []
    previous = b""
    for start in range(0, n_blocks * step, step):
        previous = _digest(previous + data[start : start + step])
        hashes.append(int.from_bytes(previous, "little"))
    return hashes


class LoadBook(Generic[K]):
    """Requests in flight per replica as this router sees them: routed and not yet completed, plus recent picks.

    A pick is the replica a request was ranked first for and is counted until Serve reports where it went (`start`)
    or that it ended (`finish`), or until it expires: routing waits on the replicas' answers, so without picks a burst
    of requests would all be ranked against the same stale counts and pile onto one replica. Calls are keyed by
    request id and replica together, since calls made while serving one HTTP request share Serve's internal id.
    """

    def __init__(self, pick_ttl_s: float = PICK_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._pick_ttl_s = pick_ttl_s
        self._clock = clock
        self._picks: OrderedDict[str, tuple[K, float]] = OrderedDict()  # request id -> (replica, when), oldest first
        self._picked: Counter[K] = Counter()
        self._running: Counter[tuple[str, K]] = Counter()
        self._in_flight: Counter[K] = Counter()

    def pick(self, request_id: str, replica: K) -> None:
        """The request is about to be offered to `replica` first (replacing its earlier pick, if any)."""
        self._drop_pick(request_id)
        self._picks[request_id] = (replica, self._clock())
        self._picked[replica] += 1

    def start(self, request_id: str, replica: K) -> None:
        """The replica accepted the request."""
        self._drop_pick(request_id)
        self._running[(request_id, replica)] += 1
        self._in_flight[replica] += 1

    def finish(self, request_id: str, replica: K) -> None:
        """The request ended on `replica` (also called for a request the replica refused: then nothing was started
        there and only the pick goes)."""
        self._drop_pick(request_id)
        key = (request_id, replica)
        if self._running[key] > 0:
            self._running[key] -= 1
            self._in_flight[replica] -= 1
        if self._running[key] <= 0:
            self._running.pop(key, None)
            if self._in_flight[replica] <= 0:
                self._in_flight.pop(replica, None)

    def release_pick(self, request_id: str) -> None:
        """Forget the request's pick, so it is not counted against the replicas it is being ranked for again."""
        self._drop_pick(request_id)

    def load(self, replica: K, observed: int | None = None) -> int:
        """Requests in flight on `replica`: `observed` (a count seen elsewhere, e.g. Serve's queue lengths, which
        include other routers' requests) when above this router's own, plus the picks not yet routed."""
        self._expire()
        running = self._in_flight[replica]
        if observed is not None and observed > running:
            running = observed
        return running + self._picked[replica]

    def replicas(self) -> set[K]:
        """The replicas with requests counted."""
        return set(self._in_flight) | set(self._picked)

    def forget(self, replica: K) -> None:
        """Drop everything about a replica that is gone."""
        for request_id in [r for r, (picked, _) in self._picks.items() if picked == replica]:
            self._drop_pick(request_id)
        for key in [k for k in self._running if k[1] == replica]:
            del self._running[key]
        self._in_flight.pop(replica, None)
        self._picked.pop(replica, None)

    def _drop_pick(self, request_id: str) -> None:
        entry = self._picks.pop(request_id, None)
        if entry is not None:
            self._picked[entry[0]] -= 1
            if self._picked[entry[0]] <= 0:
                del self._picked[entry[0]]

    def _expire(self) -> None:
        deadline = self._clock() - self._pick_ttl_s
        while self._picks:
            request_id, (_, at) = next(iter(self._picks.items()))
            if at > deadline:
                break
            self._drop_pick(request_id)


class BlockIndex:
    """The block hashes of the prompts routed to one replica: an LRU of at most `max_blocks`, oldest evicted first;
    and its conversations' ends: the last block of each prompt routed there that no later prompt has extended yet
    (a conversation's next turn replaces its previous end), so their count is the conversations it holds."""

    def __init__(self, max_blocks: int = MAX_BLOCKS_PER_REPLICA) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, not {max_blocks}")
        self._max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._ends: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def conversations(self) -> int:
        return len(self._ends)

    def add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        if hashes:
            for h in hashes[:-1]:  # the conversation this prompt continues ends here no more
                self._ends.pop(h, None)
            self._ends[hashes[-1]] = None
            self._ends.move_to_end(hashes[-1])
        while len(self._blocks) > self._max_blocks:
            self._ends.pop(self._blocks.popitem(last=False)[0], None)

    def depth(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt this replica has seen: the deepest hash it holds, + 1. Each hash
        stands for its whole prefix, so a held deep hash counts even when eviction took shallower ones."""
        blocks = self._blocks
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in blocks:
                return i + 1
        return 0

    def continued(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt end a conversation held here (0: it continues none of them)."""
        ends = self._ends
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in ends:
                return i + 1
        return 0


_EMPTY_INDEX = BlockIndex(1)


class PrefixPolicy(Generic[K]):
    """Conversation affinity by prompt prefix: a prompt that continues a conversation goes to the replica that served
    its previous turn, unless that replica is full; a new conversation goes to the least-loaded replica.

    A conversation's next turn is its previous prompt, the reply and a new user message, so its block hashes hold the
    previous prompt's last block: the replica where that block ended a routed prompt (`BlockIndex.continued`) holds
    the conversation's cache, with no session key needed. The ranking, most preferred first, one replica per rank so
    Serve tries them in exactly this order:

    - one replica holds the conversation (the owner): the owner, then the others by load (where Serve spills to when
      the owner refuses, full);
    - a new conversation (no replica holds one this prompt continues, or several do): all by load.

    "By load" is in-flight requests (`LoadBook`), then the conversations a replica holds, then the deeper prefix
    match, then the replica's name (stable ties). Full is in-flight >= the replica's capacity (Serve's
    max_ongoing_requests). A prefix shared by every conversation (a system prompt) does not make an owner: that would
    send every new conversation to the replica that saw the first, more than its slots can keep cached. (For a
    hybrid model a shorter shared prefix is rarely reusable anyway: the Gated DeltaNet state exists only at
    checkpoints.)
    """

    def __init__(
        self,
        block: int = BLOCK,
        max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA,
        capacity: int = 4,
        pick_ttl_s: float = PICK_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        name: Callable[[K], str] = str,
    ) -> None:
        if block < 1:
            raise ValueError(f"block must be at least 1, not {block}")
        if max_blocks_per_replica < 1:
            raise ValueError(f"max_blocks_per_replica must be at least 1, not {max_blocks_per_replica}")
        self.block = block
        self.max_blocks_per_replica = max_blocks_per_replica
        self.capacity = capacity  # for replicas `capacities` does not name
        self.load_book: LoadBook[K] = LoadBook(pick_ttl_s, clock)
        self._name = name
        self._indexes: dict[K, BlockIndex] = {}

    def blocks(self, tokens: Sequence[int]) -> list[int]:
        """The prompt's block hashes at this policy's block size."""
        return prefix_block_hashes(tokens, self.block)

    def depth(self, replica: K, blocks: Sequence[int]) -> int:
        """Leading blocks of the prompt that `replica` has seen."""
        index = self._indexes.get(replica)
        return index.depth(blocks) if index is not None else 0

    def rank(
        self,
        candidates: Sequence[K],
        tokens: Sequence[int],
        capacities: Mapping[K, int] | None = None,
        observed: Mapping[K, int] | None = None,
    ) -> list[list[K]]:
        """The candidates for this prompt, most preferred first (see the class). No side effects."""
        return self.rank_blocks(candidates, self.blocks(tokens), capacities, observed)

    def rank_blocks(
        self,
        candidates: Sequence[K],
        blocks: Sequence[int],
        capacities: Mapping[K, int] | None = None,
        observed: Mapping[K, int] | None = None,
    ) -> list[list[K]]:
        """`rank` for a prompt already hashed (`blocks`)."""
        if not candidates:
            return []
        depth = {r: self.depth(r, blocks) for r in candidates}
        continued = {r: self._index(r).continued(blocks) for r in candidates}
        conversations = {r: self._index(r).conversations for r in candidates}
        load = {r: self.load_book.load(r, (observed or {}).get(r)) for r in candidates}
        full = {r: load[r] >= (capacities or {}).get(r, self.capacity) for r in candidates}
        by_load = sorted(candidates, key=lambda r: (full[r], load[r], conversations[r], -depth[r], self._name(r)))
        best = max(continued.values())
        owners = [r for r in candidates if continued[r] == best]
        if best == 0 or len(owners) > 1:
            return [[r] for r in by_load]
        # The owner first even when this count says it is full: the count lags (Serve reports a completion after the
        # reply reached the client, whose next turn often comes sooner), and a replica that is full refuses, so Serve
        # goes on down the ranks: the spill is decided by the replica, which knows.
        owner = owners[0]
        return [[owner], *([r] for r in by_load if r != owner)]

    def _index(self, replica: K) -> BlockIndex:
        index = self._indexes.get(replica)
        return index if index is not None else _EMPTY_INDEX

    def choose(
        self,
        request_id: str,
        candidates: Sequence[K],
        blocks: Sequence[int],
        capacities: Mapping[K, int] | None = None,
        observed: Mapping[K, int] | None = None,
    ) -> list[list[K]]:
        """Rank the request's replicas and pick the first: it counts as load there until routed or completed. The
        request's own earlier pick (an earlier attempt) is not counted against it."""
        self.load_book.release_pick(request_id)
        ranks = self.rank_blocks(candidates, blocks, capacities, observed)
        if ranks:
            self.load_book.pick(request_id, ranks[0][0])
        return ranks

    def routed(self, request_id: str, replica: K, blocks: Sequence[int] = ()) -> None:
        """The replica accepted the request: count it in flight there and remember its prompt's blocks."""
        self.load_book.start(request_id, replica)
        if blocks:
            index = self._indexes.get(replica)
            if index is None:
                index = self._indexes[replica] = BlockIndex(self.max_blocks_per_replica)
            index.add(blocks)

    def completed(self, request_id: str, replica: K) -> None:
        """The request ended on `replica` (or was refused there)."""
        self.load_book.finish(request_id, replica)

    def forget(self, replica: K) -> None:
        """The replica is gone: its cache went with it."""
        self._indexes.pop(replica, None)
        self.load_book.forget(replica)

    def retain(self, replicas: Iterable[K]) -> None:
        """Forget every replica not in `replicas` (the deployment's current set)."""
        keep = set(replicas)
        for replica in (set(self._indexes) | self.load_book.replicas()) - keep:
            self.forget(replica)


class HashRing(Generic[K]):
    """Consistent hashing: each replica owns `vnodes` points on a 64-bit ring and a key belongs to the first point
    clockwise from its hash. A replica that joins takes over only the keys now closest to its points, one that leaves
    hands over only its own; the points depend only on replica names, so every router builds the same ring."""

    def __init__(self, vnodes: int = VIRTUAL_NODES, name: Callable[[K], str] = str) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be at least 1, not {vnodes}")
        self._vnodes = vnodes
        self._name = name
        self._members: set[K] = set()
        self._points: list[int] = []
        self._owners: list[K] = []

    @property
    def members(self) -> frozenset[K]:
        return frozenset(self._members)

    def sync(self, replicas: Iterable[K]) -> None:
        """Make the ring hold exactly `replicas` (rebuilt only when the set changed)."""
        replicas = set(replicas)
        if replicas == self._members:
            return
        points = sorted(
            ((_hash(f"{self._name(r)}#{i}".encode()), self._name(r), r) for r in replicas for i in range(self._vnodes)),
            key=lambda point: point[:2],
        )
        self._points = [p for p, _, _ in points]
        self._owners = [r for _, _, r in points]
        self._members = replicas

    def walk(self, key: str) -> list[K]:
        """Every replica once, in ring order from the key's owner."""
        if not self._points:
            return []
        start = bisect.bisect_right(self._points, _hash(key.encode()))
        order: list[K] = []
        seen: set[K] = set()
        n = len(self._points)
        for i in range(n):
            replica = self._owners[(start + i) % n]
            if replica not in seen:
                seen.add(replica)
                order.append(replica)
                if len(order) == len(self._members):
                    break
        return order


class SessionPolicy(Generic[K]):
    """Session affinity by consistent hashing on the session key (a client's x-session-id, else a key the gateway
    derives from the conversation's first user turn).

    A key goes to its owner on the ring, or when the owner is full to the next replicas clockwise (the same spill
    replica each time, so the spilled turns find their cache there too); full replicas go last, in ring order. No
    key: the least loaded (in-flight, then name). Membership follows the candidates Serve offers, so a replica that
    joins or leaves moves only its share of the keys.
    """

    def __init__(
        self,
        vnodes: int = VIRTUAL_NODES,
        capacity: int = 4,
        pick_ttl_s: float = PICK_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        name: Callable[[K], str] = str,
    ) -> None:
        self.capacity = capacity  # for replicas `capacities` does not name
        self.load_book: LoadBook[K] = LoadBook(pick_ttl_s, clock)
        self.ring: HashRing[K] = HashRing(vnodes, name)
        self._name = name

    def rank(
        self,
        candidates: Sequence[K],
        session: str | None,
        capacities: Mapping[K, int] | None = None,
        observed: Mapping[K, int] | None = None,
    ) -> list[list[K]]:
        """The candidates for this session key, most preferred first, one replica per rank. No side effects beyond
        syncing the ring to the candidates."""
        if not candidates:
            return []
        load = {r: self.load_book.load(r, (observed or {}).get(r)) for r in candidates}
        full = {r: load[r] >= (capacities or {}).get(r, self.capacity) for r in candidates}
        if not session:
            return [[r] for r in sorted(candidates, key=lambda r: (full[r], load[r], self._name(r)))]
        self.ring.sync(candidates)
        order = self.ring.walk(session)
        return [[r] for r in order if not full[r]] + [[r] for r in order if full[r]]

    def choose(
        self,
        request_id: str,
        candidates: Sequence[K],
        session: str | None,
        capacities: Mapping[K, int] | None = None,
        observed: Mapping[K, int] | None = None,
    ) -> list[list[K]]:
        """Rank and pick the first (counted as load there until routed or completed), as PrefixPolicy.choose."""
        self.load_book.release_pick(request_id)
        ranks = self.rank(candidates, session, capacities, observed)
        if ranks:
            self.load_book.pick(request_id, ranks[0][0])
        return ranks

    def routed(self, request_id: str, replica: K) -> None:
        self.load_book.start(request_id, replica)

    def completed(self, request_id: str, replica: K) -> None:
        self.load_book.finish(request_id, replica)

    def forget(self, replica: K) -> None:
        """The replica is gone: off the ring (its keys move to their next replica) and out of the counts."""
        self.ring.sync(self.ring.members - {replica})
        self.load_book.forget(replica)

    def retain(self, replicas: Iterable[K]) -> None:
        """Forget every replica not in `replicas` (the deployment's current set)."""
        keep = set(replicas)
        for replica in (self.ring.members | self.load_book.replicas()) - keep:
            self.forget(replica)
