"""The decode cycle's time model with the first H200 run's efficiencies in place of its assumptions.

    .venv/bin/python bench/gpu_calibrated.py [--measured docs/perf/h200_decode_2026-12-04.json] [--json OUT]

bench/gpu_time_model.py predicted the 27B Q4_K_M at 181 tok/s (323 with draft-mtp) on an H200 at 4096 tokens; the
H200 measured 72.1 (96.6). Its terms were right and three efficiencies wrong. This script takes them from the
measurement (bench/gpu.py's JSON: the per-kernel profile of a graphed decode step and of an MTP cycle at each depth)
and keeps gpu_time_model's bytes, kernel counts and host time:

* GEMVs: the trunk's weight bytes over the time its GEMV kernels took, as a fraction of HBM (1 row: a decode;
  3 rows: the MTP cycle's kernels less its two drafts' output layers at the 1-row rate). 0.38 and 0.22 of the
  H200's 4.8 TB/s, as the lent image's Triton 3.6 compiled them: 23-41% more instructions a K step than our 3.9
  for Q4_K, until the K-quant kernel's lane vectors made both compile it alike (docs/gpu-decode.md).
* decode attention, a latency model, since its time follows neither bytes nor issue: a program (a KV head and a
  key range) walks its range 16 keys a tile at a fixed time a tile, one program an SM at a time (210-254 registers
  a thread at 8 warps), so a layer costs waves x tiles a program x TILE_US. The split rule is the kernel's own
  (kernels.triton.attention: ranges of at least 256 keys, at most 256 of them, over the filled cells); a
  verification of 3 tokens doubles the programs (18 query rows, two 16-row blocks). TILE_US is fitted at both
  measured depths (12.1 and 12.7 us: the model holds across 16x the work) and taken as their mean.
* the small kernels (norms, the DeltaNet recurrence, SwiGLU, quantization, RoPE): their measured time a step and
  an MTP cycle.
* launches: a graph replay's time (unprofiled: the profiler's own span has 2.1 us between kernels) less its
  kernels' busy time, over its kernels: 0.86 us each.

The 2 x RTX 2080 Ti rows carry the H200's fractions and tile time (scaled by the clocks, 1.98 / 1.545 GHz) to a
card with 68 SMs: a pessimistic reading. The GEMVs' fraction is likely better there: the same programs are twice
as many an SM against a seventh of the bandwidth an SM, enough bytes in flight to stream (the H200's shortfall
looks like too few: ~5 one-warp programs an SM on a 5120-row matrix; bench/gemv_l2.py's tile choices will say).
Attention's latency-bound tiles have no such excuse. Each number says which kind it is: "fit" rows reproduce the
measurement they were fitted to, the others are predictions from it. A run on an H100 SXM (the JSON's `device`)
is fitted and predicted as that card: its 3.35 TB/s, the H200's SMs and clock.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_time_model as tm  # noqa: E402

from mtpserve.kernels.triton.attention import MAX_SPLITS, MIN_KEYS_PER_SPLIT  # noqa: E402  the kernel's split rule

MEASURED = REPO / "docs" / "perf" / "h200_decode_2026-12-04.json"
# SMs and boost clock of each card the rows are for (the H200 as the lent one read it, the others' specs); a run
# on an H100 SXM is fitted and predicted as its own card (gpu_time_model.DEVICES: its bandwidth)
CARDS = {"H200": (132, 1.98), "H100": (132, 1.98), "2x2080Ti": (68, 1.545)}
KEYS_PER_TILE = 16  # decode_attention's tile at D = 256
CONTEXTS = (4096, 65536, 131072, 262144)
GEMV_KERNELS = ("_kquant_kernel", "_q6k_kernel")
# the float kernel's pass 1 (the measured run's), the int8 one's (planar q8_0 on sm_80+, since b41a6bc), the merge
ATTENTION_KERNELS = ("_split_kernel", "_split_int8_kernel", "_combine_kernel")


@dataclass(frozen=True)
class Efficiencies:
    gemv_fraction_1: float  # of HBM, one activation row
    gemv_fraction_3: float  # three rows (a verification)
    tile_us: float  # decode attention: one 16-key tile of one program, on the H200
    small_kernels_ms: float  # a trunk step's other kernels
    small_kernels_cycle_ms: float  # an MTP cycle's (a verification's DeltaNet recurrence runs token by token)
    gap_us: float  # between kernels in a graph replay


def _kernel_us(profile: dict, names: tuple[str, ...]) -> float:
    return sum(k["us"] for k in profile["top"] if k["name"] in names)


def attention_programs(context: int, rows: int) -> tuple[int, int]:
    """(programs, tiles a program) of one layer's split pass at `context` filled cells of the 262,144-cell cache:
    the kernel's ranges over the filled cells, 6 query rows a token in the kernel's row blocks (one a decode step,
    two a verification: as many as the measured run's 16-row blocks)."""
    per = math.ceil(max(math.ceil(context / MAX_SPLITS), MIN_KEYS_PER_SPLIT) / KEYS_PER_TILE) * KEYS_PER_TILE
    splits = min(math.ceil(context / per), MAX_SPLITS)
    return splits * tm.KV_HEADS * tm.attention_passes(rows, "sm_90", "float"), per // KEYS_PER_TILE  # the run's kernel


def attention_ms(context: int, rows: int, sms: int, tile_us: float, layers: int = tm.ATTENTION_LAYERS) -> float:
    programs, tiles = attention_programs(context, rows)
    return layers * math.ceil(programs / sms) * tiles * tile_us / 1e3


def measured_on(measured: dict) -> str:
    """The card bench/gpu.py's JSON was measured on, as gpu_time_model.DEVICES names it."""
    name = measured.get("device", "")
    if "H100" in name and ("PCIe" in name or "NVL" in name):
        raise ValueError(f"{name}: only the SXM H100 (3.35 TB/s, 132 SMs) is among the modelled cards")
    return "H100" if "H100" in name else "H200"


def fit(measured: dict) -> Efficiencies:
    """The efficiencies from bench/gpu.py's JSON of a run (the first, on an H200; or an H100 SXM's)."""
    card = measured_on(measured)
    hbm = tm.DEVICES[card].hbm_tbps * 1e12
    w = tm.Bytes.of_deployment(shortlist=False)
    rows = {r["depth"]: r for r in measured["decode"]}
    shallow = rows[min(rows)]
    decode, cycle = shallow["decode_profile"], shallow["mtp_cycle_profile"]
    gemv_1 = _kernel_us(decode, GEMV_KERNELS)
    fraction_1 = w.trunk / (gemv_1 * 1e-6) / hbm
    drafts_head = 2 * (w.mtp_block + w.output_layer) / (w.trunk / gemv_1)  # the two drafts' GEMVs at the 1-row rate
    fraction_3 = w.trunk / ((_kernel_us(cycle, GEMV_KERNELS) - drafts_head) * 1e-6) / hbm
    tiles = []
    for depth, r in rows.items():
        programs, per = attention_programs(depth, 1)
        waves = math.ceil(programs / CARDS[card][0])
        tiles.append(_kernel_us(r["decode_profile"], ATTENTION_KERNELS) / tm.ATTENTION_LAYERS / (waves * per))
    small = decode["busy_us"] - gemv_1 - _kernel_us(decode, ATTENTION_KERNELS)
    small_cycle = cycle["busy_us"] - _kernel_us(cycle, GEMV_KERNELS) - _kernel_us(cycle, ATTENTION_KERNELS)
    return Efficiencies(
        gemv_fraction_1=fraction_1,
        gemv_fraction_3=fraction_3,
        tile_us=sum(tiles) / len(tiles),
        small_kernels_ms=small / 1e3,
        small_kernels_cycle_ms=small_cycle / 1e3,
        gap_us=max(0.0, shallow["decode_ms"] * 1e3 - decode["busy_us"]) / decode["kernels"],
    )


def predict(
    e: Efficiencies,
    host_ms_per_token: float,
    host_ms_per_mtp_cycle: float,
    contexts: tuple[int, ...] = CONTEXTS,
    card: str = "H200",
) -> list[dict]:
    """tok/s by device, context and speculation, and ms a token by part (the layer split: cards in series), from
    efficiencies fitted on `card`."""
    w = tm.Bytes.of_deployment(shortlist=False)  # the measured run: the whole head, the float attention kernel
    k = tm.Kernels(decode=709, verify=725, draft=27, catch_up=22)
    out = []
    for name in (card, "2x2080Ti"):
        device = tm.DEVICES[name]
        sms, clock_ghz = CARDS[name]
        tile_us = e.tile_us * CARDS[card][1] / clock_ghz
        hbm = device.hbm_tbps * 1e9  # bytes a ms
        for context in contexts:
            plain = {
                "weights": w.trunk / (hbm * e.gemv_fraction_1),
                "attention": attention_ms(context, 1, sms, tile_us),
                "small_kernels": e.small_kernels_ms,
                "launches": k.decode * e.gap_us / 1e3,
                "host": host_ms_per_token + (tm.RANK_US + tm.COPY_LATENCY_US) / 1e3,
            }
            draft = (w.mtp_block + w.output_layer) / (hbm * e.gemv_fraction_1) + attention_ms(
                context, 1, sms, tile_us, 1
            )
            cycle = {
                "weights": w.trunk / (hbm * e.gemv_fraction_3) + tm.N_MAX * (w.mtp_block + w.output_layer) / (
                    hbm * e.gemv_fraction_1) + w.mtp_block / (hbm * e.gemv_fraction_1),
                "attention": attention_ms(context, 1 + tm.N_MAX, sms, tile_us)
                + (tm.N_MAX + 1) * (draft - (w.mtp_block + w.output_layer) / (hbm * e.gemv_fraction_1)),
                "small_kernels": e.small_kernels_cycle_ms,
                "launches": (k.verify + tm.N_MAX * k.draft + k.catch_up) * e.gap_us / 1e3,
                # a verification's rows ranked together, and each draft step's row (engine.sampling.rows_ranked)
                "host": host_ms_per_mtp_cycle + (1 + tm.N_MAX) * (tm.RANK_US + tm.COPY_LATENCY_US) / 1e3,
            }  # fmt: skip
            for spec, parts, tokens in (("none", plain, 1.0), ("draft-mtp", cycle, 1 + tm.N_MAX * tm.ACCEPTANCE)):
                total = sum(parts.values())
                out.append(
                    {
                        "device": name,
                        "context": context,
                        "spec": spec,
                        "tok_s": round(1e3 * tokens / total, 1),
                        "ms": {key: round(v / tokens, 3) for key, v in parts.items()},
                    }
                )
    return out


def compare(predicted: list[dict], measured: dict) -> list[dict]:
    """The measured card's rows beside what the run measured at the same depth (the fit's own check)."""
    got = {}
    for r in measured["decode"]:
        got[(r["depth"], "none")] = r["decode_tokens_per_s"]
        got[(r["depth"], "draft-mtp")] = r.get("mtp_tokens_per_s")
    return [
        {"context": p["context"], "spec": p["spec"], "calibrated": p["tok_s"], "measured": round(got[key], 1)}
        for p in predicted
        if p["device"] == measured_on(measured) and got.get(key := (p["context"], p["spec"]))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", default=str(MEASURED))
    parser.add_argument("--time-model", default=str(REPO / "docs" / "perf" / "gpu_time_model.json"),
                        help="gpu_time_model's JSON: its measured host time is reused")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    measured = json.loads(Path(args.measured).read_text())
    host = json.loads(Path(args.time_model).read_text())
    e = fit(measured)
    predicted = predict(e, host["host_ms_per_token"], host["host_ms_per_mtp_cycle"], card=measured_on(measured))
    result = {"efficiencies": e.__dict__, "predicted": predicted, "fit_check": compare(predicted, measured)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(", ".join(f"{k} {v:.3f}" for k, v in e.__dict__.items()))
    print("| device | context | spec | tok/s | weights | attention | small kernels | launches | host (ms a token) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for p in predicted:
        m = p["ms"]
        print(f"| {p['device']} | {p['context']:,} | {p['spec']} | {p['tok_s']} | {m['weights']:.2f} | "
              f"{m['attention']:.2f} | {m['small_kernels']:.2f} | {m['launches']:.2f} | {m['host']:.2f} |")  # fmt: skip
    for c in result["fit_check"]:
        print(f"fit check, {measured_on(measured)} {c['context']:,} {c['spec']}: calibrated {c['calibrated']}, "
              f"measured {c['measured']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
