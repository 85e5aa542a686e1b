"""The decode cycle's time model as a picture: the 27B's tok/s by context depth, and where a token's time goes.

    .venv/bin/python bench/gpu_model_plot.py [--out docs/perf/gpu_time_model.png] [--json OUT]

Left: decode tok/s of the 27B Q4_K_M with draft-mtp (n_max 2 at the deployment's 63% acceptance) from 4,096 to
262,144 tokens of context, log-log:
* the static model (bench/gpu_time_model.py: today's kernels, streaming at 80% of HBM, their issue bounds, the
  measured host time) on an H200, on 2 x RTX 2080 Ti with the layer split, and with the row split over PCIe;
* the H200 and the 2080 Ti recalibrated by the first H200 run (bench/gpu_calibrated.py: the kernels of 2026-12-04
  at their measured efficiencies; the 2080 Ti's a pessimistic carry-over of the H200's);
* what that run measured (bench/gpu.py at 4,096 and 65,536 tokens), issue 38's goals at 4,096, and the
  deployment's llama.cpp on the two 2080 Ti (34 tok/s; its context depth was not recorded).
Right: ms a token by part at 4,096 and 131,072 tokens, draft-mtp, for the same rows.

Nothing is measured here: the inputs are the committed JSONs (the host time in gpu_time_model.json, the kernel
counts and attention bounds in gpu_static_after.json, the run in h200_decode_2026-12-04.json), so the picture is
the tables of docs/gpu-decode.md drawn, and `--json` writes its series.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_calibrated as gc  # noqa: E402
import gpu_time_model as tm  # noqa: E402

PERF = REPO / "docs" / "perf"
CONTEXTS = tuple(4096 * 2**i for i in range(7))  # 4,096 .. 262,144
BAR_CONTEXTS = (4096, 131072)
SPEC = "draft-mtp"
LLAMA_CPP_DEPLOYMENT = 34.0  # tok/s, the deployment's llama-server on 2 x RTX 2080 Ti with draft-mtp (mission)
GOALS = {"H200": 250.0, "2x2080Ti": 55.0}  # issue 38, draft-mtp at 4,096 tokens
# (series, source, device in that source's rows, colour, line style)
SERIES = (
    ("H200, static model (today's kernels)", "static", "H200", "#2b6cb0", "-"),
    ("H200, the 2026-12-04 kernels as measured", "calibrated", "H200", "#2b6cb0", ":"),
    ("2 x 2080 Ti layer split, static model (today's kernels)", "static", "2x2080Ti", "#c05621", "-"),
    (
        "2 x 2080 Ti layer split, the 2026-12-04 kernels at the H200's efficiencies",
        "calibrated",
        "2x2080Ti",
        "#c05621",
        ":",
    ),
    ("2 x 2080 Ti row split over PCIe, static model (today's kernels)", "static", "2x2080Ti-row-pcie", "#2f855a", "--"),
)
PARTS = ("weights", "attention", "small_kernels", "other", "launches", "host")
PART_COLOURS = ("#4a5568", "#c53030", "#d69e2e", "#805ad5", "#38a169", "#3182ce")


def series(contexts: tuple[int, ...] = CONTEXTS) -> dict:
    """Each model's draft-mtp rows at `contexts`, and the measured run's points."""
    static = json.loads((PERF / "gpu_static_after.json").read_text())
    host = json.loads((PERF / "gpu_time_model.json").read_text())
    measured = json.loads(gc.MEASURED.read_text())
    static_model = tm.model(static, (host["host_ms_per_token"], host["host_ms_per_mtp_cycle"]), contexts)
    rows = {
        "static": static_model["predicted"] + static_model["predicted_row_split"],
        "calibrated": gc.predict(gc.fit(measured), host["host_ms_per_token"], host["host_ms_per_mtp_cycle"], contexts),
    }
    out: dict = {"spec": SPEC, "contexts": list(contexts), "series": {}}
    for label, source, device, _, _ in SERIES:
        picked = [r for r in rows[source] if r["device"] == device and r["spec"] == SPEC]
        out["series"][label] = {
            "tok_s": [r["tok_s"] for r in picked],
            "ms": {r["context"]: r["ms"] for r in picked if r["context"] in BAR_CONTEXTS},
        }
    out["measured_h200"] = {r["depth"]: round(r["mtp_tokens_per_s"], 1) for r in measured["decode"]}
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, *bars_axes) = plt.subplots(1, 3, figsize=(18, 6.2), gridspec_kw={"width_ratios": [1.25, 1, 1]})
    x = data["contexts"]
    for label, _, _, colour, style in SERIES:
        left.plot(x, data["series"][label]["tok_s"], style, color=colour, marker="o", markersize=3, label=label)
    depths = sorted(data["measured_h200"])
    left.plot(depths, [data["measured_h200"][d] for d in depths], "D", color="#1a365d", markersize=8,
              label="H200, measured 2026-12-04 (its kernels)")  # fmt: skip
    left.axhline(LLAMA_CPP_DEPLOYMENT, color="#718096", linewidth=1)
    left.text(x[0], LLAMA_CPP_DEPLOYMENT * 0.9, "llama.cpp, the deployment on 2 x 2080 Ti (34)", va="top",
              color="#4a5568", fontsize=8)  # fmt: skip
    for device, goal in GOALS.items():
        left.plot([x[0]], [goal], "*", color="#2b6cb0" if device == "H200" else "#c05621", markersize=13)
    left.plot([], [], "*", color="#718096", markersize=11, label="issue 38's goals at 4,096 tokens")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    left.set_xticks(x, [f"{c // 1024}k" for c in x])
    left.set_xlabel("context (tokens in the KV cache)")
    left.set_ylabel("decode tokens/s, draft-mtp n_max 2 at 63% acceptance")
    left.set_title("Qwen3.6-27B Q4_K_M: decode speed by depth")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8, loc="lower left")

    for ax, device in zip(bars_axes, ("H200", "2 x 2080 Ti"), strict=True):
        bars = [(label, c) for label, *_ in SERIES if label.startswith(device) for c in BAR_CONTEXTS]
        for i, (label, context) in enumerate(bars):
            ms = data["series"][label]["ms"][context]
            bottom = 0.0
            for part, colour in zip(PARTS, PART_COLOURS, strict=True):
                value = ms.get(part, 0.0)
                ax.barh(i, value, left=bottom, color=colour, label=part.replace("_", " ") if i == 0 else None)
                bottom += value
            ax.text(bottom, i, f" {bottom:.1f}", va="center", fontsize=8)
        names = [f"{label[len(device) :].strip(' ,')}\n{c // 1024}k tokens" for label, c in bars]
        ax.set_yticks(range(len(bars)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ms a token (draft-mtp)")
        ax.set_title(f"{device}: where a token's time goes")
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(PERF / "gpu_time_model.png"))
    parser.add_argument("--json", default=None, help="write the plotted series here")
    args = parser.parse_args(argv)
    data = series()
    plot(data, Path(args.out))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    for label, s in data["series"].items():
        print(f"{label}: " + ", ".join(f"{c // 1024}k {t}" for c, t in zip(data["contexts"], s["tok_s"], strict=True)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
