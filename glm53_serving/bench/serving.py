"""End-to-end costs against upstream, each in one run, with SGLang's own load generator.

    python -m glm53_serving.bench.serving gateway   # PD: client -> gateway -> router vs. client -> router
    python -m glm53_serving.bench.serving gateway --topology single  # gateway -> server vs. server
    python -m glm53_serving.bench.serving gateway --gateway-own-core --simultaneous  # the hop's latency alone
    python -m glm53_serving.bench.serving kv_guard  # single server: KV guard on vs. GLM53_KV_GUARD_OFF=zero,owner,handoff
    python -m glm53_serving.bench.serving kv_guard --vs-upstream  # ... vs. GLM53_SERVING_DISABLE=1
    python -m glm53_serving.bench.serving kv_guard --config launch/cpu-gqa.toml  # ... on the GQA stand-in

Each side runs SGLang's load generator (`sglang.bench_serving`'s Rust client by default,
`--client python` for the Python one; dataset random-ids, greedy) once to warm up (not counted),
then the same number of times, alternating between the sides and which side goes first
(kv_guard: two servers up at once; gateway: one deployment reached two ways). Printed: every
round, each side's medians and their ratio, and the ratio and latency differences per pair of
back-to-back rounds with their medians (the robust figures on a machine whose speed drifts).
On 2 cores the rounds of one side swing by ±20%, and the gateway's CPU is taken from the
server's. `--gateway-own-core` puts the gateway on a core of its own, as on a GPU host, and
`--simultaneous` runs both sides at once in the same batches (half the concurrency each, two
tenants with different prompts), so that what is measured is the hop's latency, not the machine's drift or
the 2 cores' CPU share. The gateway also times the upstream's share of every answer (its
`glm53_gateway_upstream_*_seconds` summaries): the load generator's mean TTFT and e2e over a
round less the gateway's mean over the same requests is the gateway's own addition, free of the
server's round-to-round noise ("in-band"). Not a test: numbers, for docs/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from glm53_serving import tenants
from glm53_serving.env import KV_GUARD_OFF, SERVING_DISABLE
from glm53_serving.hooks import KV_PARTS
from glm53_serving.launch import Tenancy
from glm53_serving.models import tiny
from glm53_serving.topology import Topology, default_config_path


class LaunchFailed(SystemExit):
    """The launcher exited before its deployment was ready; the message ends with its last lines
    (which name the child that failed and quote that child's log)."""


def start(run_dir: Path, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, dict]:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "launcher.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "glm53_serving.launch", "--run-dir", str(run_dir), *args],
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    ready = run_dir / "ready.json"
    while not ready.exists():
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-40:]
            raise LaunchFailed(
                f"launcher failed (exit {proc.returncode}): see {run_dir}; last lines of {log}:\n" + "\n".join(tail)
            )
        time.sleep(0.5)
    return proc, json.loads(ready.read_text())


def process(info: dict, name: str) -> dict:
    """One of the deployment's processes from its ready.json: name, pid, url, log."""
    return next(x for x in info["processes"] if x["name"] == name)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    proc.wait(120)


def credential(info: dict, side: str, tenant: str = "demo") -> str:
    """What the load generator sends as `Authorization: Bearer`: a demo tenant's API key at the
    gateway; straight to the router or a server, the assertion the gateway would have sent."""
    t = info["tenants"]
    if side == "gateway":
        return json.loads(Path(t["demo_keys_file"]).read_text())[tenant]
    # The longest a tenant assertion may live; the bench asks for one per round.
    key = tenants.load_assertion_key(t["assertion_key_file"])
    return tenants.mint(key, tenant, ttl_s=tenants.MAX_TTL_S["tenant"], deployment=t["deployment"])


def fixed_length_prompts(a) -> list[str]:
    """The load generator's dataset arguments here: random-ids, every prompt a.input_len tokens in
    and a.output_len out."""
    return [
        "--dataset-name",
        "random-ids",
        "--tokenizer",
        str(tiny.ensure()),  # every embedded preset has the same tokenizer (models/tiny.py)
        "--random-input-len",
        str(a.input_len),
        "--random-output-len",
        str(a.output_len),
        "--random-range-ratio",
        "1.0",
    ]


def bench(jobs: list[tuple[str, Path, str, int]], a, concurrency: int, dataset: list[str] | None = None) -> list[dict]:
    """SGLang's own load generator, one client per (url, result file, credential, dataset seed),
    all at once; each one's result record (bench_serving's keys). `dataset`: its dataset arguments
    (default fixed_length_prompts(a))."""
    procs = []
    for url, out, key, seed in jobs:
        args = [
            "--backend",
            "sglang",
            "--base-url",
            url,
            *(fixed_length_prompts(a) if dataset is None else dataset),
            "--model",
            a.model,
            "--num-prompts",
            str(a.num_prompts),
            "--request-rate",
            str(a.request_rate),
            "--max-concurrency",
            str(concurrency),
            "--disable-tqdm",
            "--output-file",
            str(out),
            "--seed",
            str(seed),
            # The warm-up rounds warm up; a request outside the counted ones would also enter the
            # gateway's upstream timing, which must cover exactly the round's requests.
            "--warmup-requests",
            "0",
        ]
        if a.client == "rust":
            # sglang.bench_serving's Rust port (its --rust-client): same dataset, metrics and result
            # keys; starts in milliseconds instead of ~20 s and parses streams off the interpreter.
            cmd = [
                sys.executable,
                "-m",
                "glm53_serving.bench.rust_client",
                *args,
                "--worker-threads",
                "1",
                "--header",
                f"Authorization: Bearer {key}",
            ]
            env = dict(os.environ)
        else:
            cmd = [sys.executable, "-m", "sglang.bench_serving", *args]
            env = {**os.environ, "OPENAI_API_KEY": key}
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env))
    results = []
    for (_, out, _, _), proc in zip(jobs, procs):
        _, err = proc.communicate()
        if proc.returncode:
            raise SystemExit(
                f"{proc.args[2]} failed ({proc.returncode}):\n{err[-3000:]}\n"
                "(the Python client's datasets dependency: GLM53_BENCH=1 scripts/setup)"
            )
        results.append(json.loads(out.read_text().splitlines()[-1]))
    return results


def compare(name_a: str, runs_a: list[dict], name_b: str, runs_b: list[dict]) -> None:
    """Every round, each side's medians over its rounds, and the same per pair of rounds (round i
    of each side ran back to back, so a pair shares the machine's state: on 2 shared cores the
    rounds of one side swing by far more than the difference between the sides)."""
    keys = ("output_throughput", "median_e2e_latency_ms", "p99_e2e_latency_ms", "median_ttft_ms")
    for name, runs in ((name_a, runs_a), (name_b, runs_b)):
        for i, r in enumerate(runs):
            print(
                f"{name:>22} round {i}: {r['output_throughput']:8.1f} tok/s, e2e p50 {r['median_e2e_latency_ms']:8.2f} ms, "
                f"ttft p50 {r['median_ttft_ms']:8.2f} ms, itl p50 {r['median_itl_ms']:6.2f} ms"
            )

    ta, pa50, pa99, fa50 = (statistics.median(r[k] for r in runs_a) for k in keys)
    tb, pb50, pb99, fb50 = (statistics.median(r[k] for r in runs_b) for k in keys)
    print(f"{name_a:>22}: {ta:8.1f} output tok/s, e2e p50 {pa50:8.2f} ms, p99 {pa99:8.2f} ms, ttft p50 {fa50:8.2f} ms")
    print(f"{name_b:>22}: {tb:8.1f} output tok/s, e2e p50 {pb50:8.2f} ms, p99 {pb99:8.2f} ms, ttft p50 {fb50:8.2f} ms")
    print(
        f"{'ratio':>22}: throughput {ta / tb:.3f}x, added p50 {pa50 - pb50:+.2f} ms, added p99 {pa99 - pb99:+.2f} ms, "
        f"added ttft p50 {fa50 - fb50:+.2f} ms"
    )
    pairs = list(zip(runs_a, runs_b))
    ratio = [a["output_throughput"] / b["output_throughput"] for a, b in pairs]
    added = {k: [a[k] - b[k] for a, b in pairs] for k in keys[1:]}
    print(
        f"{'paired rounds':>22}: throughput ratio {', '.join(f'{x:.3f}' for x in ratio)}; "
        f"median {statistics.median(ratio):.3f}x"
    )
    print(
        f"{'':>22}  added e2e p50 {', '.join(f'{x:+.1f}' for x in added['median_e2e_latency_ms'])} ms; "
        f"median {statistics.median(added['median_e2e_latency_ms']):+.2f} ms, "
        f"p99 median {statistics.median(added['p99_e2e_latency_ms']):+.2f} ms, "
        f"ttft p50 median {statistics.median(added['median_ttft_ms']):+.2f} ms"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("gateway", "kv_guard"))
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--topology", choices=("pd", "single"), default="pd", help="gateway: the deployment to drive")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--gateway-own-core",
        action="store_true",
        help="gateway: run it on the last core and everything else (workers, router, load generator) on "
        "the others, as on a GPU host where the gateway's CPU is not the serving path's",
    )
    p.add_argument(
        "--simultaneous",
        action="store_true",
        help="gateway: run both sides at once, each at half the concurrency, in the same batches, so "
        "that the machine's drift cancels; the gateway's CPU then slows both sides alike, so this "
        "measures the hop's latency: use it with --gateway-own-core",
    )
    p.add_argument("--vs-upstream", action="store_true", help="kv_guard: compare with the whole plugin off")
    p.add_argument(
        "--client",
        choices=("rust", "python"),
        default="rust",
        help="the load generator: sglang.bench_serving's Rust client (default) or its Python one",
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="counted rounds per side, after one warm-up round each (default 8)"
    )
    p.add_argument("--config", type=Path, default=None, help="topology file (TOML); default: the launcher's")
    a = p.parse_args(argv)
    a.rounds = a.rounds or 8
    a.config = a.config or default_config_path()
    a.model = Topology.load(a.config).model.served_model_name
    tmp = Path(tempfile.mkdtemp(prefix="glm53-bench-"))
    print(
        f"{a.what}: {a.num_prompts} prompts x {a.input_len} in / {a.output_len} out, concurrency {a.concurrency}, "
        f"{a.model} ({a.config}), {a.rounds} rounds per side ({'both sides at once' if a.simultaneous else 'alternating'}); logs in {tmp}"
    )
    if a.what == "gateway":
        if a.gateway_own_core:  # inherited by the launcher's children and the load generator
            serving_cores, gateway_core = own_core_split()
            os.sched_setaffinity(0, serving_cores)
        proc, info = start(tmp / a.topology, "--config", str(a.config), "--topology", a.topology)
        if a.gateway_own_core:
            pin(process(info, "gateway")["pid"], {gateway_core})
            print(f"gateway on core {gateway_core}; workers, router and load generator on cores {serving_cores}")
        behind = "router" if a.topology == "pd" else "server"  # what the gateway forwards to
        router = process(info, behind)["url"]
        try:
            runs = {"gateway": [], "router": []}
            hop = {name: psutil.Process(process(info, name)["pid"]) for name in ("gateway", behind)}
            cpu_s, requests = {name: 0.0 for name in hop}, {name: 0 for name in hop}
            sides = [("gateway", info["client_url"]), ("router", router)]
            inband = {
                "ttft": [],
                "e2e": [],
                "admission": [],
            }  # per round: the client's mean less the gateway's upstream mean
            for i in range(a.rounds + 1):
                if a.simultaneous:  # both sides in the same batches, each at half the concurrency
                    rounds = [sides]
                else:  # one side at a time; who goes first alternates too
                    rounds = [[side] for side in sides[:: 1 if i % 2 else -1]]
                for together in rounds:
                    before = {name: cpu_seconds([p]) for name, p in hop.items()}
                    timing = upstream_timing(info["operator_url"])
                    # At once, the two sides are two tenants (the demo tenants, swapped each round) with
                    # different prompts (seeds, likewise): SGLang defers a waiting request whose first 32+
                    # tokens match another waiting one in the same cache namespace, and glm53-tiny's
                    # 512-token vocabulary makes such twins common, so with one tenant the later copy,
                    # always the gateway's, waited a whole request (~400 ms) behind the straight one.
                    # (Two tenants alone with the same prompts were not enough: p99 +262 ms, measured.)
                    order = [(k + i) % len(together) for k in range(len(together))]
                    results = bench(
                        [
                            (url, tmp / f"{side}-{i}.jsonl", credential(info, side, Tenancy.DEMO_TENANTS[o]), 1 + o)
                            for (side, url), o in zip(together, order)
                        ],
                        a,
                        a.concurrency // len(together),
                    )
                    if not i:
                        continue
                    for (side, _), r in zip(together, results):
                        runs[side].append(r)
                    if any(side == "gateway" for side, _ in together):  # what each hop spends per request
                        for name, p in hop.items():
                            cpu_s[name] += cpu_seconds([p]) - before[name]
                        for (side, _), r in zip(together, results):
                            requests[behind] += r["completed"]  # every request crosses what is behind the gateway
                            requests["gateway"] += r["completed"] if side == "gateway" else 0
                        [via] = [r for (side, _), r in zip(together, results) if side == "gateway"]
                        now = upstream_timing(info["operator_url"])
                        upstream = {k: (now[k][0] - timing[k][0], now[k][1] - timing[k][1]) for k in now}
                        assert all(n == via["completed"] for _, n in upstream.values()), (upstream, via["completed"])
                        inband["ttft"].append(
                            via["mean_ttft_ms"] - 1000 * upstream["upstream_first_chunk"][0] / via["completed"]
                        )
                        inband["e2e"].append(
                            via["mean_e2e_latency_ms"] - 1000 * upstream["upstream_response"][0] / via["completed"]
                        )
                        inband["admission"].append(1000 * upstream["admission"][0] / via["completed"])
        finally:
            stop(proc)
        compare("via gateway", runs["gateway"], f"straight to {behind}", runs["router"])
        per = {name: 1000 * cpu_s[name] / requests[name] for name in cpu_s}
        print(
            f"{'CPU per request':>22}: gateway {per['gateway']:.2f} ms, {behind} {per[behind]:.2f} ms "
            f"(process CPU time over the counted rounds with the gateway, {requests['gateway']} requests through it)"
        )
        print(
            f"{'in-band, per round':>22}: added mean ttft {', '.join(f'{x:+.2f}' for x in inband['ttft'])} ms; "
            f"median {statistics.median(inband['ttft']):+.2f} ms"
        )
        print(
            f"{'':>22}  added mean e2e {', '.join(f'{x:+.2f}' for x in inband['e2e'])} ms; "
            f"median {statistics.median(inband['e2e']):+.2f} ms "
            "(the same requests: the load generator's mean less the gateway's own view of the upstream's)"
        )
        print(
            f"{'':>22}  of which before forwarding (key, body, validation, count) "
            f"{', '.join(f'{x:.3f}' for x in inband['admission'])} ms; median {statistics.median(inband['admission']):.3f} ms"
        )
    else:
        # Both deployments up at once (an idle one sleeps: --sleep-on-idle), rounds alternating,
        # so that drift of the machine hits both sides alike.
        runs, deployments = {"on": [], "off": []}, {}
        try:
            # Off: the KV guard's three parts only (tenants, validation, admission stay on, so the
            # difference is the KV guard's); --vs-upstream: the whole plugin off.
            off = {SERVING_DISABLE.name: "1"} if a.vs_upstream else {KV_GUARD_OFF.name: ",".join(KV_PARTS)}
            for side, env in (("on", {}), ("off", off)):
                deployments[side] = start(tmp / side, "--config", str(a.config), "--topology", "single", env=env)
            # The server's CPU (HTTP process + scheduler) per output token: what the guard adds,
            # less exposed than throughput to what else the 2 cores run in a round.
            tree = {side: server_tree(info) for side, (_, info) in deployments.items()}
            cpu = {side: [] for side in deployments}
            for i in range(a.rounds + 1):
                for side, (_, info) in deployments.items():
                    before = cpu_seconds(tree[side])
                    [r] = bench(
                        [(process(info, "server")["url"], tmp / f"{side}-{i}.jsonl", credential(info, "server"), 1)],
                        a,
                        a.concurrency,
                    )
                    if i:
                        runs[side].append(r)
                        cpu[side].append(1e6 * (cpu_seconds(tree[side]) - before) / r["total_output_tokens"])
        finally:
            for proc, _ in deployments.values():
                stop(proc)
        off_name = "whole plugin off" if a.vs_upstream else "kv guard off"
        compare("kv guard on", runs["on"], off_name, runs["off"])
        c_on, c_off = statistics.median(cpu["on"]), statistics.median(cpu["off"])
        print(
            f"{'server CPU per token':>22}: on {c_on:.0f} us, off {c_off:.0f} us -> {c_off / c_on:.3f}x "
            f"(rounds: on {', '.join(f'{x:.0f}' for x in cpu['on'])}; off {', '.join(f'{x:.0f}' for x in cpu['off'])})"
        )


def upstream_timing(gateway_url: str) -> dict[str, tuple[float, int]]:
    """The gateway's summaries of its own time before forwarding and of the upstream's time to its
    first chunk and to its last byte: name -> (seconds, requests) so far."""
    with urllib.request.urlopen(gateway_url + "/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    out = {}
    for name in ("admission", "upstream_first_chunk", "upstream_response"):
        samples = {s.name: s.value for s in families[f"glm53_gateway_{name}_seconds"].samples}
        out[name] = (samples[f"glm53_gateway_{name}_seconds_sum"], int(samples[f"glm53_gateway_{name}_seconds_count"]))
    return out


def own_core_split() -> tuple[set[int], int]:
    """--gateway-own-core: (the cores for everything but the gateway; the gateway's, the last of
    this process's), or SystemExit where there is only one."""
    *serving, gateway = sorted(os.sched_getaffinity(0))
    if not serving:
        raise SystemExit("--gateway-own-core needs 2 or more cores")
    return set(serving), gateway


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of the process (affinity is per thread; a new thread inherits its creator's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cores)


def server_tree(info: dict) -> list[psutil.Process]:
    root = psutil.Process(process(info, "server")["pid"])
    return [root, *root.children(recursive=True)]


def cpu_seconds(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


if __name__ == "__main__":
    main()
