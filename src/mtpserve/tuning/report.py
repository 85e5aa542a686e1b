"""The benchmark's report: the deployment guide's per-request table and cumulative acceptance, one row
per configuration (medians over rounds, ratios to the first configuration and to the peer), acceptance
and speed by context depth; as Markdown, JSON and PNG plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from .runner import Run
from .workload import RequestResult, Summary, per_position, summarize


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def request_table(results: list[RequestResult]) -> str:
    head = (
        "| request | prompt tokens | prompt t/s | generated | decode t/s | accepted / drafted | acceptance | TTFT ms "
        "| tokens/step |"
    )
    rows = [head, "|" + "---|" * 9]
    for r in results:
        if not r.ok:
            rows.append(f"| {r.label} | failed: {r.error[:60]} |" + " |" * 7)
            continue
        rows.append(
            f"| {r.label} | {r.prompt_n} | {r.prompt_per_second:.1f} | {r.predicted_n} | "
            f"{r.predicted_per_second:.1f} | {r.draft_n_accepted} / {r.draft_n} | {_f(r.acceptance, '.3f')} | "
            f"{r.ttft_ms:.0f} | {r.tokens_per_step:.2f} |"
        )
    s = summarize(results)
    rows.append(
        f"| **all** | | {s.prompt_per_second:.1f} | | {s.predicted_per_second:.1f} | "
        f"{s.draft_n_accepted} / {s.draft_n} | "
        f"**{_f(s.acceptance, '.3f')}** | {s.ttft_ms:.0f} | {s.tokens_per_step:.2f} |"
    )
    return "\n".join(rows)


def _median_summary(per_round: list[Summary]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        values = [getattr(s, key) for s in per_round if getattr(s, key) is not None]
        return statistics.median(values) if values else None

    keys = ("prompt_per_second", "predicted_per_second", "acceptance", "ttft_ms", "tokens_per_step")
    return {k: med(k) for k in keys} | {
        "failed": sum(s.failed for s in per_round),
        "requests": sum(s.requests for s in per_round),
    }


def configurations(run: Run) -> list[dict[str, Any]]:
    """Per configuration: medians over rounds, and per-round ratios (decode t/s) to the first
    configuration and to the peer, medians of those."""
    base = run.points[0].name
    out = []
    for point in run.points:
        summaries = [summarize(r[point.name]) for r in run.rounds]
        row = {"configuration": point.name, **_median_summary(summaries)}
        ratios = [
            summarize(r[point.name]).predicted_per_second / summarize(r[base]).predicted_per_second
            for r in run.rounds
            if summarize(r[base]).predicted_per_second
        ]
        row["vs_first"] = statistics.median(ratios) if ratios else None
        if run.peer_rounds:
            peer = [summarize(r[point.name]) for r in run.peer_rounds]
            row["peer"] = _median_summary(peer)
            peer_ratios = [
                o.predicted_per_second / p.predicted_per_second
                for o, p in zip(summaries, peer)
                if p.predicted_per_second
            ]
            row["vs_peer"] = statistics.median(peer_ratios) if peer_ratios else None
        out.append(row)
    return out


def configuration_table(rows: list[dict[str, Any]], peer: bool) -> str:
    head = "| configuration | decode t/s | vs first | prompt t/s | acceptance | tokens/step | TTFT ms | failed |"
    if peer:
        head += " peer decode t/s | peer acceptance | ours / peer |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (
            f"| {r['configuration']} | {_f(r['predicted_per_second'])} | {_f(r['vs_first'], '.2f')}x | "
            f"{_f(r['prompt_per_second'])} | {_f(r['acceptance'], '.3f')} | {_f(r['tokens_per_step'], '.2f')} | "
            f"{_f(r['ttft_ms'], '.0f')} | {r['failed']}/{r['requests']} |"
        )
        if peer:
            peer_rate, peer_acceptance = _f(r["peer"]["predicted_per_second"]), _f(r["peer"]["acceptance"], ".3f")
            line += f" {peer_rate} | {peer_acceptance} | {_f(r['vs_peer'], '.2f')}x |"
        lines.append(line)
    return "\n".join(lines)


def depth_rows(run: Run) -> list[dict[str, Any]]:
    rows = []
    for point in run.points:
        depths = sorted({r.depth for r in run.rounds[0][point.name] if r.label.startswith("depth")})
        for depth in depths:
            picked = [
                r
                for rnd in run.rounds
                for r in rnd[point.name]
                if r.depth == depth and r.label.startswith("depth") and r.ok
            ]
            if not picked:
                continue
            drafted = sum(r.draft_n for r in picked)
            rows.append(
                {
                    "configuration": point.name,
                    "depth": depth,
                    "prompt_n": statistics.median(r.prompt_n for r in picked),
                    "predicted_per_second": statistics.median(r.predicted_per_second for r in picked),
                    "acceptance": sum(r.draft_n_accepted for r in picked) / drafted if drafted else None,
                }
            )
    return rows


def position_table(run: Run) -> str | None:
    """Acceptance by draft position, every round's requests together (None when the server reports none)."""
    rows = {p.name: per_position([r for rnd in run.rounds for r in rnd[p.name] if r.ok]) for p in run.points}
    depth = max((len(v) for v in rows.values()), default=0)
    if not depth:
        return None
    lines = ["| configuration | " + " | ".join(f"position {i + 1}" for i in range(depth)) + " |"]
    lines.append("|---|" + "---:|" * depth)
    for name, values in rows.items():
        cells = [f"{v.accepted} / {v.drafted} = {v.rate:.3f}" if v.drafted else "-" for v in values]
        lines.append(f"| {name} | " + " | ".join(cells + ["-"] * (depth - len(cells))) + " |")
    return "\n".join(lines)


def markdown(run: Run) -> str:
    parts = ["# mtpserve bench", ""]
    for point in run.points:
        parts += [f"## {point.name} (round 1)", "", request_table(run.rounds[0][point.name]), ""]
        if run.peer_rounds:
            parts += ["### peer, same requests (round 1)", "", request_table(run.peer_rounds[0][point.name]), ""]
    rounds = len(run.rounds)
    parts += [
        f"## Configurations (median of {rounds} round{'s' * (rounds > 1)}; ratios per round, then median)",
        "",
        configuration_table(configurations(run), bool(run.peer_rounds)),
        "",
    ]
    positions = position_table(run)
    if positions:
        parts += ["## Acceptance by draft position (accepted / drafted, all rounds)", "", positions, ""]
    depth = depth_rows(run)
    if depth:
        parts += [
            "## By context depth",
            "",
            "| configuration | depth (prompt tokens) | decode t/s | acceptance |",
            "|---|---|---|---|",
        ]
        parts += [
            f"| {d['configuration']} | {d['prompt_n']:.0f} | {d['predicted_per_second']:.1f} | "
            f"{_f(d['acceptance'], '.3f')} |"
            for d in depth
        ]
        parts.append("")
    return "\n".join(parts)


def to_json(run: Run, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "meta": meta,
        "configurations": configurations(run),
        "depth": depth_rows(run),
        "rounds": [{name: [r.as_dict() for r in results] for name, results in rnd.items()} for rnd in run.rounds],
        "peer_rounds": [
            {name: [r.as_dict() for r in results] for name, results in rnd.items()} for rnd in run.peer_rounds
        ],
    }


def plots(run: Run, out_dir: Path, title: str) -> list[Path]:
    """PNG plots: decode speed and acceptance per configuration; decode speed over the output length;
    speed and acceptance by context depth (when measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = configurations(run)
    names = [r["configuration"] for r in rows]
    written = []

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) + 4), 4.5))
    x = range(len(rows))
    width = 0.38 if run.peer_rounds else 0.6
    ax1.bar(
        [i - (width / 2 if run.peer_rounds else 0) for i in x],
        [r["predicted_per_second"] or 0 for r in rows],
        width,
        label="mtpserve" if run.peer_rounds else None,
        color="#2b6cb0",
    )
    if run.peer_rounds:
        ax1.bar(
            [i + width / 2 for i in x],
            [r["peer"]["predicted_per_second"] or 0 for r in rows],
            width,
            label="peer",
            color="#a0aec0",
        )
        ax1.legend()
    ax1.set_title("Decode speed")
    ax1.set_ylabel("tokens / s (median over rounds)")
    ax2.bar(x, [100 * (r["acceptance"] or 0) for r in rows], 0.6, color="#2f855a")
    ax2.set_title("Draft acceptance")
    ax2.set_ylabel("accepted / drafted (%)")
    ax2.set_ylim(0, 100)
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
        ax.set_xlabel("configuration")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    written.append(out_dir / "bench_configurations.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for point in run.points:
        times = [r.chunk_times for r in run.rounds[0][point.name] if r.ok and len(r.chunk_times) > 8]
        if not times:
            continue
        longest = max(len(t) for t in times)
        window = max(4, longest // 16)
        xs, ys = [], []
        for end in range(window, longest + 1, max(1, window // 2)):
            rates = [
                window / (t[end - 1] - t[end - window]) for t in times if len(t) >= end and t[end - 1] > t[end - window]
            ]
            if rates:
                xs.append(end)
                ys.append(statistics.median(rates))
        ax.plot(xs, ys, marker=".", label=point.name, color=f"C{run.points.index(point)}")
    ax.set_title(f"Decode speed over the output length ({title})")
    ax.set_xlabel("output position (streamed chunks, about one token each)")
    ax.set_ylabel("tokens / s (client side, moving window)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out_dir / "bench_speed_over_length.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    depth = depth_rows(run)
    if depth:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.5))
        for index, point in enumerate(run.points):  # one colour per configuration in both panels
            mine = [d for d in depth if d["configuration"] == point.name]
            if not mine:
                continue
            style = {"marker": "o", "label": point.name, "color": f"C{index}"}
            ax1.plot([d["prompt_n"] for d in mine], [d["predicted_per_second"] for d in mine], **style)
            if any(d["acceptance"] is not None for d in mine):
                ax2.plot([d["prompt_n"] for d in mine], [100 * (d["acceptance"] or 0) for d in mine], **style)
        ax1.set_title("Decode speed by context depth")
        ax1.set_ylabel("tokens / s")
        ax2.set_title("Draft acceptance by context depth")
        ax2.set_ylabel("accepted / drafted (%)")
        ax2.set_ylim(0, 100)
        for ax in (ax1, ax2):
            ax.set_xlabel("prompt tokens")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        written.append(out_dir / "bench_depth.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def write(run: Run, out_dir: Path, meta: dict[str, Any], title: str) -> tuple[str, list[Path]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(run)
    (out_dir / "bench.md").write_text(text)
    (out_dir / "bench.json").write_text(json.dumps(to_json(run, meta), indent=1))
    return text, [out_dir / "bench.md", out_dir / "bench.json", *plots(run, out_dir, title)]
