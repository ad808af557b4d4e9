"""The whole stack against upstream SGLang, in one run, with SGLang's own load generator.

    python -m glm53_serving.bench                  # single and PD, concurrency 1, 4, 16, 3 rounds
    python -m glm53_serving.bench --quick          # both topologies and sides, c1 and c4, 1 round
    python -m glm53_serving.bench --out DIR        # default bench-results/<UTC time>
    python -m glm53_serving.bench --gateway-own-core  # the gateway on a core of its own, as on a GPU host

Per topology, two deployments of the launcher's default config are up at once (with --quick,
every topology's: its run is mostly startup): "on", our full stack (client -> gateway -> router
or server, every guard on), and "off", upstream (the plugin switched off with
GLM53_SERVING_DISABLE=1, the client straight to the router in PD or to the server in single). At each concurrency, after one warm-up run per side, each round runs
`sglang.bench_serving`'s Rust client against one side and then the other, the side that goes
first alternating, so that the machine's drift hits both alike. Prompts mix lengths (random-ids
with --random-range-ratio) and share prefixes: with the load generator's --vocab-size G every
prompt counts up mod G from its first token, so prompts with the same first token (G groups)
share the shorter one's length. Both sides of a round get the same prompts; rounds get new ones.

`--gateway-own-core` runs the gateways on the last core and everything else (servers, routers,
load generator, both sides) on the others: a GPU host's layout, where the gateway's CPU is not
taken from the servers'. Without it, on 2 cores, the gateway's CPU per request slows the servers
of the "on" side, and queueing amplifies that into TTFT (docs/performance.md).

Per point: output tok/s, requests/s, TTFT and ITL p50/p99, each side's CPU per output token (the
processes' own accounting: servers with their schedulers, router, gateway; the "off" side's idle
gateway is not on its path and not counted), the on/off ratio of each per pair of rounds and the
median of those; for the full stack, from the same CPU readings, the gateway process's CPU per
completed request and its share of the rest of the path's (servers with their children, router;
the target is at most 5 %), per round and the median. Writes results.json, results.md and
plot.png into --out. Not a test: numbers, for docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import psutil

from glm53_serving.bench import report
from glm53_serving.bench.serving import (
    LaunchFailed,
    bench,
    cpu_seconds,
    credential,
    own_core_split,
    pin,
    process,
    start,
    stop,
)
from glm53_serving.env import SERVING_DISABLE
from glm53_serving.topology import Topology, default_config_path

SIDES = {"on": {}, "off": {SERVING_DISABLE.name: "1"}}


def deploy(tmp: Path, a, topologies: list[str]) -> dict:
    """Both sides of each topology, started at once (a launch mostly waits on its children's
    imports and stages, so launches overlap well): (topology, side) -> (launcher, ready.json).

    A deployment whose launcher fails is started once more, alone, after the others are up, and
    the failure is printed: with --quick six servers start at once on two cores, and a start-up
    that loses that race (CI saw one PD launcher fail, its log gone with the machine) is not what
    the bench measures. A second failure ends the run with the launcher's last lines."""
    wanted = [(t, side) for t in topologies for side in SIDES]

    def launch(t: str, side: str, attempt: int):
        run_dir = tmp / (f"{t}-{side}" if attempt == 0 else f"{t}-{side}-retry{attempt}")
        return start(run_dir, "--config", str(a.config), "--topology", t, env=SIDES[side])

    up: dict = {}
    try:
        with ThreadPoolExecutor(len(wanted)) as pool:
            futures = {key: pool.submit(launch, *key, 0) for key in wanted}
            for key, f in futures.items():
                if f.exception() is None:
                    up[key] = f.result()
                elif isinstance(f.exception(), LaunchFailed):
                    print(f"{key[0]}-{key[1]}: {f.exception()}\nstarting it again, alone", file=sys.stderr, flush=True)
                else:
                    raise f.exception()
        for key in wanted:
            if key not in up:
                up[key] = launch(*key, 1)
    except BaseException:  # SystemExit included: stop those that did come up
        stop_all(up)
        raise
    return up


def stop_all(up: dict) -> None:
    with ThreadPoolExecutor(max(1, len(up))) as pool:
        list(pool.map(stop, [proc for proc, _ in up.values()]))


def endpoint(info: dict, side: str, topology: str) -> tuple[str, str]:
    """Where the client goes and which of the deployment's processes serve it there."""
    if side == "on":
        return info["client_url"], "gateway"
    return process(info, "router" if topology == "pd" else "server")["url"], "server"


def serving_processes(info: dict, side: str) -> list[tuple[str, list[psutil.Process]]]:
    """Every process on the side's request path, with its children (schedulers, detokenizers):
    (its name in ready.json, [it, *its children]) per launcher's child."""
    out = []
    for p in info["processes"]:
        if side == "off" and p["name"] == "gateway":
            continue
        root = psutil.Process(p["pid"])
        out.append((p["name"], [root, *root.children(recursive=True)]))
    return out


def cpu_readings(groups: list[tuple[str, list[psutil.Process]]]) -> list[float]:
    """CPU seconds so far of each of serving_processes()'s groups (one reading of each process)."""
    return [cpu_seconds(procs) for _, procs in groups]


def cpu_split(groups: list[tuple[str, list[psutil.Process]]], before: list[float], after: list[float]):
    """CPU seconds between two cpu_readings() of the gateway (with its children: it has none) and
    of every other group (servers with their children, router): (gateway, the others)."""
    spent = [b - a for a, b in zip(before, after)]
    gateway = sum(s for (name, _), s in zip(groups, spent) if name == "gateway")
    return gateway, sum(spent) - gateway


def dataset(a) -> list[str]:
    return [
        "--dataset-name",
        "random-ids",
        "--tokenize-prompt",
        "--vocab-size",
        str(a.prefix_groups),
        "--random-input-len",
        str(a.input_len),
        "--random-output-len",
        str(a.output_len),
        "--random-range-ratio",
        str(a.range_ratio),
    ]


def run_topology(tmp: Path, a, topology: str, up: dict) -> list[dict]:
    procs = {side: serving_processes(up[topology, side][1], side) for side in SIDES}

    def one(side: str, concurrency: int, prompts: int, seed: int, tag: str) -> dict:
        info = up[topology, side][1]
        url, as_who = endpoint(info, side, topology)
        load = SimpleNamespace(**{**vars(a), "num_prompts": prompts})
        before = cpu_readings(procs[side])
        job = (url, tmp / f"{topology}-{side}-{tag}.jsonl", credential(info, as_who), seed)
        [r] = bench([job], load, concurrency, dataset(a))
        gateway_s, servers_s = cpu_split(procs[side], before, cpu_readings(procs[side]))
        r["cpu_us_per_token"] = 1e6 * (gateway_s + servers_s) / r["total_output_tokens"]
        if side == "on":  # the gateway's own cost, against the rest of the path's, from the same readings
            r.update(report.gateway_cpu(gateway_s, servers_s, r["completed"]))
        return r

    for side in SIDES:  # not counted: first requests, caches, allocator
        one(side, max(a.concurrency), max(a.concurrency), 0, "warmup")
    points, k = [], 0  # k: rounds so far; who goes first alternates across levels too
    for c in a.concurrency:
        prompts = max(a.num_prompts, 4 * c)  # every run holds its concurrency for most of it
        runs, first = {side: [] for side in SIDES}, []
        for i in range(a.rounds):
            order = list(SIDES)[:: 1 if k % 2 == 0 else -1]
            for side in order:
                runs[side].append(one(side, c, prompts, 1000 * c + i + 1, f"c{c}-{i}"))
            first.append(order[0])
            k += 1
        points.append(report.point(topology, c, prompts, runs, first))
        report.print_point(points[-1])
    return points


def run(tmp: Path, a) -> list[dict]:
    """--quick: every deployment up at once, as its run is mostly startup; otherwise one topology
    at a time, so that the other's idle processes share no core with the measured ones."""
    points = []
    gateway_core = None
    if a.gateway_own_core:
        serving_cores, gateway_core = own_core_split()
        os.sched_setaffinity(0, serving_cores)  # inherited by the launchers' children and the load generator
    for group in [a.topologies] if a.quick else [[t] for t in a.topologies]:
        up = deploy(tmp, a, group)
        if gateway_core is not None:
            for _, info in up.values():
                pin(process(info, "gateway")["pid"], {gateway_core})
        try:
            for topology in group:
                points += run_topology(tmp, a, topology, up)
        finally:
            stop_all(up)
    return points


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m glm53_serving.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench-results/<UTC time>)")
    p.add_argument("--quick", action="store_true", help="c1 and c4, 1 round, 8 short prompts: a smoke run (~2 min)")
    p.add_argument("--topologies", nargs="+", choices=("single", "pd"), default=["single", "pd"])
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 1 4 16")
    p.add_argument("--rounds", type=int, default=None, help="rounds per point, each side once a round (default 3)")
    p.add_argument(
        "--num-prompts", type=int, default=None, help="prompts per run, at least 4x concurrency (default 32)"
    )
    p.add_argument("--input-len", type=int, default=None, help="longest prompt (default 256)")
    p.add_argument("--output-len", type=int, default=None, help="longest output (default 32)")
    p.add_argument("--range-ratio", type=float, default=0.25, help="shortest length over longest (default 0.25)")
    p.add_argument("--prefix-groups", type=int, default=16, help="prompts share prefixes in this many groups")
    p.add_argument("--config", type=Path, default=None, help="topology file (TOML); default: the launcher's")
    p.add_argument(
        "--gateway-own-core",
        action="store_true",
        help="the gateways on the last core, everything else on the others (a GPU host's layout)",
    )
    a = p.parse_args(argv)
    quick = {"concurrency": [1, 4], "rounds": 1, "num_prompts": 8, "input_len": 128, "output_len": 16}
    full = {"concurrency": [1, 4, 16], "rounds": 3, "num_prompts": 32, "input_len": 256, "output_len": 32}
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.config = a.config or default_config_path()
    a.model = Topology.load(a.config).model.served_model_name
    a.out = a.out or Path("bench-results") / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    a.request_rate, a.client = "inf", "rust"
    return a


def main(argv=None) -> None:
    a = parse(argv)
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="glm53-bench-"))
    print(
        f"whole stack vs upstream: {a.model} ({a.config}), {', '.join(a.topologies)}, concurrency {a.concurrency}, "
        f"{a.rounds} round(s), prompts {int(a.input_len * a.range_ratio)}-{a.input_len} in / "
        f"{max(1, int(a.output_len * a.range_ratio))}-{a.output_len} out in {a.prefix_groups} prefix groups; logs in {tmp}",
        flush=True,
    )
    points = run(tmp, a)
    meta = {
        "command": " ".join(["python -m glm53_serving.bench", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": psutil.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)},
        "gateway_own_core": a.gateway_own_core,
        "model": a.model,
        "config": str(a.config),
        "load": {
            k: vars(a)[k]
            for k in ("concurrency", "rounds", "num_prompts", "input_len", "output_len", "range_ratio", "prefix_groups")
        },
        "wall_s": round(time.monotonic() - t0, 1),
        "logs": str(tmp),
    }
    report.write(a.out, meta, points)
    print(
        f"wrote {a.out}/results.json, results.md, plot.png in {meta['wall_s']:.0f} s; median throughput ratios: "
        + ", ".join(f"{p['topology']} c{p['concurrency']} {p['ratio_median']['output_throughput']:.3f}" for p in points)
    )


if __name__ == "__main__":
    main()
