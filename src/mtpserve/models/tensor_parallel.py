"""Which share of each block a tensor-parallel rank holds (`--split-mode row`, issue 40), Megatron's split:

- attention: the rank's query heads (rows of q, and of its gate in qwen35), the KV heads they read (a KV head whose
  query group spans ranks is held by each of them, as vLLM replicates KV heads when there are fewer than ranks),
  and the matching columns of the output projection, whose partial sums are added over the ranks;
- Gated DeltaNet: the rank's K heads and the V heads that read them (qwen35 GGUFs store V heads tiled: V head j
  reads K head j % n_k), their rows of every projection, conv channel and state, and the out projection's columns;
- FFN: whole blocks of the down projection's columns, and the gate and up rows that feed them;
- the output layer: the rank's rows of the vocabulary, the logits gathered.

A row-parallel matrix is cut at its quant blocks (their values share scales); where a block's share would cut one
(a toy model's 64-wide heads in a 256-wide Q4_K block) the whole block is held by every rank instead and computed
on each, the same bits on all. Shares follow `--tensor-split` by cumulative rounding, as the layer rule does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ops.collective import Collective, SingleRank
from ..quant.qtensor import columns_split
from ..quant.types import GGMLType, block_geometry

Runs = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Partition:
    """Rank `group.rank` of `group.size`, its share of each split dimension in proportion to `shares`."""

    group: Collective = field(default_factory=SingleRank)
    shares: tuple[float, ...] = ()

    @property
    def split(self) -> bool:
        return self.group.size > 1

    def units(self, n: int) -> range | None:
        """This rank's contiguous run of n units (heads, quant blocks, vocabulary rows) in proportion to the shares;
        None where some rank would get none (fewer units than ranks): the block is then held whole by every rank."""
        runs = self.every_rank_units(n)
        return None if runs is None else runs[self.group.rank]

    def every_rank_units(self, n: int) -> list[range] | None:
        """`units(n)` of every rank, in rank order."""
        shares = self.shares or (1.0,) * self.group.size
        total, bounds, acc = float(sum(shares)), [0], 0.0
        for share in shares[:-1]:
            acc += share
            bounds.append(max(bounds[-1], int(n * acc / total)))
        bounds.append(n)
        if any(b <= a for a, b in zip(bounds, bounds[1:])):
            return None
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]


WHOLE = Partition()  # a block every rank holds whole


def scaled(units: range, width: int, offset: int = 0) -> Runs:
    """The rows (or columns) of `units` units of `width` each, after `offset`."""
    return ((offset + units.start * width, offset + units.stop * width),)


def vocab_share(p: Partition, n_vocab: int) -> dict:
    """`WeightStore.matrix`'s arguments for a rank's rows of an output layer, the logits gathered."""
    every_rank = p.every_rank_units(n_vocab)
    if every_rank is None:
        raise ValueError(f"--tensor-split {p.shares} leaves a rank no row of the {n_vocab}-token vocabulary")
    rows = every_rank[p.group.rank]
    return {"rows": scaled(rows, 1), "partition": p, "gathered_widths": tuple(len(r) for r in every_rank)}


@dataclass(frozen=True)
class AttentionShare:
    heads: range  # query heads
    kv_heads: range
    partition: Partition  # WHOLE when the output projection cannot be cut at the heads

    def q_rows(self, width: int) -> Runs:
        return scaled(self.heads, width)

    def kv_rows(self, width: int) -> Runs:
        return scaled(self.kv_heads, width)

    def out_columns(self, head_dim: int) -> Runs:
        return scaled(self.heads, head_dim)


def attention_share(p: Partition, n_head: int, n_head_kv: int, head_dim: int, out_type: GGMLType) -> AttentionShare:
    """The rank's heads of an attention block whose output projection is stored as `out_type`."""
    heads, group = p.units(n_head), n_head // n_head_kv
    whole = AttentionShare(range(n_head), range(n_head_kv), WHOLE)
    if heads is None:
        return whole
    if heads.start % group == 0 and len(heads) % group == 0:
        kv = range(heads.start // group, heads.stop // group)
    elif group % len(heads) == 0 and heads.start // group == (heads.stop - 1) // group:  # a KV head several share
        kv = range(heads.start // group, heads.start // group + 1)
    else:
        return whole
    share = AttentionShare(heads, kv, p)
    return share if not p.split or columns_split(out_type, share.out_columns(head_dim)) else whole


@dataclass(frozen=True)
class DeltaNetShare:
    k_heads: range
    v_heads: tuple[int, ...]  # ascending: tiled over the rank's K heads as the stored order is over all of them
    partition: Partition

    def v_runs(self, width: int, offset: int = 0) -> Runs:
        """Rows (or columns) of the V heads, `width` a head, merged where adjacent."""
        runs: list[tuple[int, int]] = []
        for j in self.v_heads:
            a = offset + j * width
            if runs and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], a + width)
            else:
                runs.append((a, a + width))
        return tuple(runs)

    def qkv_rows(self, head_dim: int, key_dim: int) -> Runs:
        """q | k | v rows of the joint projection (and of the conv channels): the rank's K heads twice, its V heads."""
        return (
            *scaled(self.k_heads, head_dim),
            *scaled(self.k_heads, head_dim, key_dim),
            *self.v_runs(head_dim, 2 * key_dim),
        )


def deltanet_share(p: Partition, n_k: int, n_v: int, head_dim: int, out_type: GGMLType) -> DeltaNetShare:
    k = p.units(n_k)
    whole = DeltaNetShare(range(n_k), tuple(range(n_v)), WHOLE)
    if k is None:
        return whole
    share = DeltaNetShare(k, tuple(j for j in range(n_v) if j % n_k in k), p)
    return share if not p.split or columns_split(out_type, share.v_runs(head_dim)) else whole


@dataclass(frozen=True)
class FFNShare:
    columns: Runs  # of the down projection; the gate and up rows
    partition: Partition


def ffn_share(p: Partition, n_ff: int, down_type: GGMLType) -> FFNShare:
    block = block_geometry(down_type)[0]
    units = None if n_ff % block else p.units(n_ff // block)
    if not p.split or units is None:
        return FFNShare(((0, n_ff),), WHOLE)
    return FFNShare(scaled(units, block), p)
