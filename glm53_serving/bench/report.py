"""What `python -m glm53_serving.bench` prints and writes: per point (topology, concurrency), each
side's medians over its rounds and the on/off ratio per pair of rounds with the median of those
(a pair ran back to back and shares the machine's state, which on 2 shared cores swings by more
than the difference between the sides); results.json, results.md and plot.png."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

# bench_serving's result keys, and cpu_us_per_token (the bench's own): label, unit
METRICS = {
    "output_throughput": ("output", "tok/s"),
    "request_throughput": ("requests", "req/s"),
    "median_ttft_ms": ("TTFT p50", "ms"),
    "p99_ttft_ms": ("TTFT p99", "ms"),
    "median_itl_ms": ("ITL p50", "ms"),
    "p99_itl_ms": ("ITL p99", "ms"),
    "cpu_us_per_token": ("CPU/token", "µs"),
}
NAMES = {"on": "full stack", "off": "upstream"}


def point(topology: str, concurrency: int, prompts: int, runs: dict[str, list[dict]], first: list[str]) -> dict:
    rounds = {
        side: [{k: r[k] for k in (*METRICS, "completed", "total_output_tokens")} for r in rs]
        for side, rs in runs.items()
    }
    # None where upstream's is 0 (PD's ITL p50 with short outputs: two tokens in one chunk)
    ratios = {k: [on[k] / off[k] if off[k] else None for on, off in zip(rounds["on"], rounds["off"])] for k in METRICS}
    return {
        "topology": topology,
        "concurrency": concurrency,
        "prompts": prompts,
        "first": first,  # which side ran first in each round
        "rounds": rounds,
        "median": {side: {k: statistics.median(r[k] for r in rs) for k in METRICS} for side, rs in rounds.items()},
        "ratios": ratios,  # on / off per pair of rounds: above 1 is more throughput, or more latency and CPU
        "ratio_median": {k: median(v) for k, v in ratios.items()},
    }


def median(xs: list[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return statistics.median(known) if known else None


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def print_point(p: dict) -> None:
    print(f"{p['topology']} c{p['concurrency']} ({p['prompts']} prompts a run, first: {', '.join(p['first'])})")
    for side in ("on", "off"):
        for i, r in enumerate(p["rounds"][side]):
            print(f"  {NAMES[side]:>10} round {i}: " + ", ".join(f"{METRICS[k][0]} {r[k]:.1f}" for k in METRICS))
    for side in ("on", "off"):
        m = p["median"][side]
        print(
            f"  {NAMES[side]:>10} median:  " + ", ".join(f"{METRICS[k][0]} {m[k]:.1f} {METRICS[k][1]}" for k in METRICS)
        )
    print(
        f"  {'on/off':>10} paired:  "
        + "; ".join(
            f"{METRICS[k][0]} {', '.join(fmt(x) for x in p['ratios'][k])} (median {fmt(p['ratio_median'][k])})"
            for k in METRICS
        ),
        flush=True,
    )


def markdown(meta: dict, points: list[dict]) -> str:
    head = ["topology", "conc.", "side", *(f"{label} ({unit})" for label, unit in METRICS.values())]
    rows = []
    for p in points:
        for side in ("on", "off"):
            m = p["median"][side]
            rows.append([p["topology"], str(p["concurrency"]), NAMES[side], *(f"{m[k]:,.1f}" for k in METRICS)])
        ratio = [f"**{p['ratio_median'][k]:.3f}×** ({', '.join(f'{x:.2f}' for x in p['ratios'][k])})" for k in METRICS]
        rows.append([p["topology"], str(p["concurrency"]), "on/off", *ratio])
    lines = [
        f"`{meta['command']}`, {meta['date']}, {meta['machine']['cpus']} CPUs, no GPU, {meta['model']}: "
        f"medians over {meta['load']['rounds']} round(s); on/off: median of the per-round ratios (each round's in "
        "parentheses). Full stack: gateway + every guard; upstream: GLM53_SERVING_DISABLE=1, client straight to "
        "the router (pd) or server (single). CPU/token: the side's server, router and gateway processes' CPU time "
        "per output token.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    topologies = list(dict.fromkeys(p["topology"] for p in points))
    fig, axes = plt.subplots(1, len(topologies), figsize=(6 * len(topologies), 4.2), squeeze=False)
    for ax, topology in zip(axes[0], topologies):
        mine = [p for p in points if p["topology"] == topology]
        conc = [p["concurrency"] for p in mine]
        ttft = ax.twinx()
        lines = (("output_throughput", ax, "o-", "tok/s"), ("median_ttft_ms", ttft, "s--", "TTFT p50"))
        for side, color in (("on", "tab:blue"), ("off", "tab:orange")):
            for key, axis, style, label in lines:
                ys = [p["median"][side][key] for p in mine]
                axis.plot(conc, ys, style, color=color, label=f"{NAMES[side]} {label}")
        ax.set(title=topology, xlabel="concurrency", ylabel="output tok/s (solid)", xscale="log", xticks=conc)
        ax.set_xticklabels([str(c) for c in conc])
        ax.minorticks_off()  # a log axis's minor labels (2×10⁰, ...) only clutter 1, 4, 16
        ttft.set_ylabel("TTFT p50, ms (dashed)")
        ax.set_ylim(bottom=0)
        ttft.set_ylim(bottom=0)
        handles = [h for a in (ax, ttft) for h in a.get_legend_handles_labels()[0]]
        ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path, meta: dict, points: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "points": points}, indent=2) + "\n")
    (out / "results.md").write_text(markdown(meta, points))
    plot(points, out / "plot.png")
