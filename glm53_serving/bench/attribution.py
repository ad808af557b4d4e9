"""Where the plugin's CPU goes: per process and per guard, plugin on vs. upstream, in one run.

    python -m glm53_serving.bench.attribution                    # single, c8, 128 in / 32 out
    python -m glm53_serving.bench.attribution --topology pd      # prefill + decode + router
    python -m glm53_serving.bench.attribution --rounds 3 --num-prompts 96 --out DIR

Both sides of the launcher's default config are up at once, as in `python -m glm53_serving.bench`:
"on" (client -> gateway -> router or server, every guard on) and "off" (GLM53_SERVING_DISABLE=1,
the client straight to the router or server). After one warm-up run per side, each counted round
drives one side and then the other with SGLang's load generator (fixed lengths), and while it
runs py-spy samples every Python process of that side (`record --nonblocking --format raw`: the
target is never paused, so the profiler costs the machine a little CPU but the target none).

Printed, per process (HTTP/tokenizer, scheduler, detokenizer, router, gateway): CPU µs per
request and per output token from the processes' own accounting (psutil), on and off, and
their ratio; then, per process of the "on" side, the share of its py-spy samples spent inside
each of our modules and our top functions (inclusive: a frame counts once per stack it is on)
and that share of its CPU in µs per request. A module is a guard (kv_owner, validation,
tenant_guard, ...); SGLang's hook wrappers (`plugins/hook_registry.py`) are counted as one
more row, since every hooked call pays them. The scheduler's rows are paid every batch step;
the HTTP process's and the gateway's once per request (per chunk for streaming). Writes the raw
profiles and a summary JSON to --out. Not a test: numbers, for docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import psutil

from glm53_serving.bench.__main__ import SIDES, deploy, endpoint, stop_all
from glm53_serving.bench.serving import bench, credential
from glm53_serving.topology import Topology, default_config_path

# py-spy names a frame's file relative to its sys.path entry: "glm53_serving/kv_owner.py:12",
# SGLang's hook wrappers "plugins/hook_registry.py:356" (or absolute, outside sys.path).
OURS = "glm53_serving/"
# The pinned py-spy beside this interpreter (a venv run without activating it), else on PATH.
PY_SPY = (
    str(Path(sys.executable).with_name("py-spy")) if Path(sys.executable).with_name("py-spy").exists() else "py-spy"
)
HOOK_WRAPPER = "plugins/hook_registry.py"


def roles(info: dict, side: str) -> dict[str, psutil.Process]:
    """'server', 'server/scheduler', 'server/detokenizer', 'prefill/...', 'router', 'gateway' ->
    process: every process of the side's request path (the off side's idle gateway is not on it)."""
    out = {}
    for p in info["processes"]:
        if side == "off" and p["name"] == "gateway":
            continue
        root = psutil.Process(p["pid"])
        out[p["name"]] = root
        for child in root.children(recursive=True):
            title = " ".join(child.cmdline())  # SGLang names its children by process title
            role = next((r for r in ("scheduler", "detokenizer") if r in title), None)
            if role is not None:  # (else multiprocessing's resource tracker: idle)
                out[f"{p['name']}/{role}"] = child
    return out


def is_python(p: psutil.Process) -> bool:
    return "python" in p.exe() or "sglang::" in " ".join(p.cmdline())


def profile(procs: dict[str, psutil.Process], out: Path, rate: int) -> dict[str, subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    spies = {}
    for role, p in procs.items():
        if is_python(p):
            cmd = [PY_SPY, "record", "--pid", str(p.pid), "--rate", str(rate), "--nonblocking"]
            cmd += ["--format", "raw", "--output", str(out / f"{role.replace('/', '.')}.txt")]
            spies[role] = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
    return spies


def stop_profiling(spies: dict[str, subprocess.Popen]) -> None:
    for spy in spies.values():
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
    for spy in spies.values():
        spy.wait(60)


def module_of(frame: str) -> str | None:
    """'fn (/x/glm53_serving/kv_owner.py:12)' -> 'kv_owner'; the hook wrappers -> 'hook wrappers'."""
    path = frame[frame.rfind("(") + 1 :]
    if HOOK_WRAPPER in path:
        return "hook wrappers"
    if not (path.startswith(OURS) or "/" + OURS in path):
        return None
    return path.split(OURS, 1)[1].rsplit(".py", 1)[0].replace("/", ".")


def shares(raw: Path) -> tuple[int, Counter, Counter, Counter, Counter]:
    """Samples in all; per our module, samples that are on it (inclusive) and samples whose
    innermost frame is its (self: its own lines and the C calls they make, additive across
    modules); per our function, self samples; per function of any code, self samples. The hook
    wrappers count by self only: every hooked call runs under one, so their inclusive share is
    the hooked functions'."""
    total, inclusive, own, functions, anyone = 0, Counter(), Counter(), Counter(), Counter()
    for line in raw.read_text().splitlines() if raw.exists() else ():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():  # a frame name with a newline in it continues on the next line
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        for m in {module_of(f) for f in frames} - {None, "hook wrappers"}:
            inclusive[m] += n
        anyone[frames[-1].rsplit(":", 1)[0] + ")"] += n  # "fn (file)", without the line
        leaf = module_of(frames[-1])
        if leaf is not None:
            own[leaf] += n
            functions[f"{leaf}.{frames[-1][: frames[-1].rfind(' (')]}"] += n
    return total, inclusive, own, functions, anyone


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", choices=("single", "pd"), default="single")
    p.add_argument("--rounds", type=int, default=2, help="counted rounds per side (default 2)")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=12, help="our functions listed per process")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--config", type=Path, default=None, help="topology file (TOML); default: the launcher's")
    a = p.parse_args(argv)
    a.config = a.config or default_config_path()
    a.model = Topology.load(a.config).model.served_model_name
    a.request_rate, a.client = "inf", "rust"
    tmp = Path(tempfile.mkdtemp(prefix="glm53-attribution-"))
    a.out = a.out or tmp
    print(
        f"attribution: {a.topology}, {a.model}, c{a.concurrency}, {a.num_prompts} x {a.input_len}/{a.output_len}, "
        f"{a.rounds} rounds per side; logs in {tmp}, profiles in {a.out}",
        flush=True,
    )

    up = deploy(tmp, SimpleNamespace(config=a.config), [a.topology])
    cpu = {side: Counter() for side in SIDES}  # role -> CPU seconds over the counted rounds
    done = {side: Counter() for side in SIDES}  # requests, output tokens
    tput = {side: [] for side in SIDES}
    ttft = {side: [] for side in SIDES}
    try:
        procs = {side: roles(up[a.topology, side][1], side) for side in SIDES}
        for i in range(a.rounds + 1):
            for side in list(SIDES)[:: 1 if i % 2 else -1]:
                info = up[a.topology, side][1]
                url, as_who = endpoint(info, side, a.topology)
                spies = profile(procs[side], a.out / f"{side}-{i}", a.rate) if i else {}
                before = {r: sum(p.cpu_times()[:2]) for r, p in procs[side].items()}
                job = (url, tmp / f"{side}-{i}.jsonl", credential(info, as_who), 1 + i)
                [r] = bench([job], a, a.concurrency)
                after = {r_: sum(p.cpu_times()[:2]) for r_, p in procs[side].items()}
                stop_profiling(spies)
                if not i:
                    continue  # warm-up
                for role in after:
                    cpu[side][role] += after[role] - before[role]
                done[side]["requests"] += r["completed"]
                done[side]["tokens"] += r["total_output_tokens"]
                tput[side].append(r["output_throughput"])
                ttft[side].append(r["median_ttft_ms"])
    finally:
        stop_all(up)

    summary = {"args": {k: str(v) for k, v in vars(a).items()}, "processes": {}, "modules": {}, "functions": {}}
    print(f"\n{'process':<22} {'on us/req':>10} {'off us/req':>10} {'on us/tok':>10} {'off us/tok':>10} {'on/off':>7}")
    per_req = {side: {r: 1e6 * s / done[side]["requests"] for r, s in cpu[side].items()} for side in SIDES}
    per_tok = {side: {r: 1e6 * s / done[side]["tokens"] for r, s in cpu[side].items()} for side in SIDES}
    for role in sorted(set(cpu["on"]) | set(cpu["off"]), key=lambda r: (r.split("/")[0], r)):
        on, off = per_tok["on"].get(role), per_tok["off"].get(role)
        ratio = f"{on / off:.3f}" if on and off else "-"
        cells = [per_req["on"].get(role), per_req["off"].get(role), on, off]
        print(
            f"{role:<22} " + " ".join(f"{x:>10,.0f}" if x is not None else f"{'-':>10}" for x in cells) + f" {ratio:>7}"
        )
        summary["processes"][role] = dict(zip(("on_us_req", "off_us_req", "on_us_tok", "off_us_tok"), cells))
    tot = {side: sum(per_tok[side].values()) for side in SIDES}
    print(
        f"{'all':<22} {sum(per_req['on'].values()):>10,.0f} {sum(per_req['off'].values()):>10,.0f} "
        f"{tot['on']:>10,.0f} {tot['off']:>10,.0f} {tot['on'] / tot['off']:>7.3f}"
    )
    for side in SIDES:
        print(
            f"{side}: output tok/s {', '.join(f'{x:.1f}' for x in tput[side])}; TTFT p50 "
            f"{', '.join(f'{x:.1f}' for x in ttft[side])} ms"
        )
    ratios = [x / y for x, y in zip(tput["on"], tput["off"])]
    print(
        f"throughput on/off per round: {', '.join(f'{x:.3f}' for x in ratios)} (median {statistics.median(ratios):.3f})"
    )
    summary["throughput"], summary["ttft_p50_ms"] = tput, ttft

    profiles = {}  # (side, role) -> the rounds' shares() summed
    for side in SIDES:
        for role in procs[side]:
            total, inc, own, fns, anyone = 0, Counter(), Counter(), Counter(), Counter()
            for i in range(1, a.rounds + 1):
                t, m, o, f, y = shares(a.out / f"{side}-{i}" / f"{role.replace('/', '.')}.txt")
                total, inc, own, fns, anyone = total + t, inc + m, own + o, fns + f, anyone + y
            profiles[side, role] = total, anyone
            if not total or not (inc or own):
                continue
            us = per_req[side][role]
            print(f"\n{side} {role}: {total} samples, {us:,.0f} CPU us/request")
            print(f"  {'our module':<40} {'self %':>7} {'us/req':>9} {'incl. %':>8} {'us/req':>9}")
            for name in sorted(set(inc) | set(own), key=lambda k: -own[k]):
                s_, i_ = own[name] / total, inc[name] / total
                print(f"  {name:<40} {100 * s_:7.2f} {us * s_:9,.1f} {100 * i_:8.2f} {us * i_:9,.1f}")
            print(f"  {'our functions (self)':<40}")
            for name, n in fns.most_common(a.top):
                print(f"  {name:<40} {100 * n / total:7.2f} {us * n / total:9,.1f}")
            summary["modules"][f"{side} {role}"] = {
                k: {"self": own[k] / total, "inclusive": inc[k] / total} for k in set(inc) | set(own)
            }
            summary["functions"][f"{side} {role}"] = {k: n / total for k, n in fns.most_common(40)}
    # What the plugin adds outside our own frames (SGLang's, Starlette's, logging's, a thread's):
    # the functions whose self share grew most from off to on, per process on both sides.
    for role in procs["on"]:
        (t_on, on), (t_off, off) = profiles["on", role], profiles.get(("off", role), (0, Counter()))
        if not (t_on and t_off):
            continue
        grew = sorted(set(on) | set(off), key=lambda k: off[k] / t_off - on[k] / t_on)[:8]
        print(f"\n{role}: largest self-share growth, on vs off")
        for k in grew:
            print(f"  {k[:70]:<70} {100 * on[k] / t_on:6.2f} % vs {100 * off[k] / t_off:6.2f} %")
    (a.out / "attribution.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nwrote {a.out}/attribution.json")


if __name__ == "__main__":
    main()
