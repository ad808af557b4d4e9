"""What `python -m glm53_serving.bench` prints and writes: per point (topology, concurrency), each
side's medians over its rounds and the on/off ratio per pair of rounds with the median of those
(a pair ran back to back and shares the machine's state, which on 2 shared cores swings by more
than the difference between the sides); the full stack's gateway CPU per request against the rest
of its path's; results.json, results.md and plot.png."""

from __future__ import annotations

import json
import os
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
# The full stack's gateway against the rest of its request path (servers with their children,
# router), per completed request, from the same CPU readings as cpu_us_per_token: label, unit
GATEWAY = {
    "gateway_cpu_us_per_request": ("gateway CPU/request", "µs"),
    "servers_cpu_us_per_request": ("servers + router CPU/request", "µs"),
    "gateway_cpu_share": ("gateway share", "%"),
}
GATEWAY_TARGET_SHARE = 0.05  # issue 22: the gateway's CPU per request at most 5 % of the servers'


def gateway_cpu(gateway_s: float, servers_s: float, completed: int) -> dict:
    """One run of the full stack: the gateway's CPU seconds and those of the rest of the path
    (servers with their children, router) over the same interval, per completed request (µs),
    and the gateway's over the rest's (a fraction; None where a divisor is 0)."""
    return {
        "gateway_cpu_s": gateway_s,
        "servers_cpu_s": servers_s,
        "gateway_cpu_us_per_request": 1e6 * gateway_s / completed if completed else None,
        "servers_cpu_us_per_request": 1e6 * servers_s / completed if completed else None,
        "gateway_cpu_share": gateway_s / servers_s if servers_s > 0 else None,
    }


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
        "gateway": gateway_point(runs["on"]),
    }


def gateway_point(on: list[dict]) -> dict:
    """The full stack's gateway_cpu() of each round and their medians."""
    rounds = [{k: r[k] for k in ("gateway_cpu_s", "servers_cpu_s", *GATEWAY, "completed")} for r in on]
    return {
        "rounds": rounds,
        "median": {k: median([r[k] for r in rounds]) for k in GATEWAY},
        "target_share": GATEWAY_TARGET_SHARE,
    }


def median(xs: list[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return statistics.median(known) if known else None


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def gateway_line(g: dict) -> str:
    """The console's line for a point's gateway_point()."""
    m, rounds = g["median"], g["rounds"]
    return (
        f"  {'gateway':>10} CPU:     {fmt(m['gateway_cpu_us_per_request'], ',.0f')} µs/request, "
        f"{fmt(m['gateway_cpu_share'], '.2%')} of the servers' and router's "
        f"{fmt(m['servers_cpu_us_per_request'], ',.0f')} µs/request (median; target <= {g['target_share']:.0%}); "
        f"rounds: {', '.join(fmt(r['gateway_cpu_us_per_request'], ',.0f') for r in rounds)} µs, "
        f"{', '.join(fmt(r['gateway_cpu_share'], '.2%') for r in rounds)}"
    )


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
    )
    print(gateway_line(p["gateway"]), flush=True)


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
        "",
        *gateway_table(points),
    ]
    return "\n".join(lines) + "\n"


def gateway_table(points: list[dict]) -> list[str]:
    """The full stack's gateway CPU per request against the rest of its path's, per point."""
    target = points[0]["gateway"]["target_share"] if points else GATEWAY_TARGET_SHARE
    head = ["topology", "conc.", *(f"{label} ({unit})" for label, unit in GATEWAY.values()), f"≤ {target:.0%}"]
    spec = {"gateway_cpu_us_per_request": ",.0f", "servers_cpu_us_per_request": ",.0f", "gateway_cpu_share": ".2%"}
    rows = []
    for p in points:
        g = p["gateway"]
        cells = [
            f"{fmt(g['median'][k], spec[k])} ({', '.join(fmt(r[k], spec[k]) for r in g['rounds'])})" for k in GATEWAY
        ]
        share = g["median"]["gateway_cpu_share"]
        # judged as shown: CPU seconds are whole ticks, and 0.03 s / 0.6 s is 0.0500000000000003
        met = "—" if share is None else "yes" if round(share, 4) <= g["target_share"] else "**no**"
        rows.append([p["topology"], str(p["concurrency"]), *cells, met])
    return [
        "Gateway CPU per request (full stack): the gateway process's CPU time per completed request, the "
        "same for the side's other processes (servers with their schedulers and detokenizers, router), and "
        f"the gateway's over theirs (target: at most {target:.0%}); from the same readings as CPU/token; "
        "medians over the rounds, each round's in parentheses. The kernel counts each process's CPU time in "
        f"{1000 / os.sysconf('SC_CLK_TCK'):.0f} ms ticks: read each round's gateway seconds (results.json, "
        "`gateway_cpu_s`) against that.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


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
