"""python -m glm53_serving.suite: the isolation suite against real topologies (see __init__.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import tomllib
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import tomli_w
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from glm53_serving import env, tenants
from glm53_serving.bench.serving import start, stop
from glm53_serving.suite import allocator, faults, oracles
from glm53_serving.suite.client import Target, kv_states, send, solo
from glm53_serving.suite.oracles import Finding
from glm53_serving.suite.workload import Call, Served, from_json, to_json, workloads
from glm53_serving.topology import default_config_path

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "support" / "kv_fault"  # test-only: the KV canary and the incident's fault
TENANTS = ["suite-a", "suite-b", "suite-c", "suite-d"]
INCIDENT_RID = "suite-incident"  # rids the harness gives another tenant's live slot (GLM53_TEST_KV_FOREIGN)


@dataclass(frozen=True, slots=True)
class Profile:
    interleavings: int  # per topology
    min_calls: int
    max_calls: int
    max_new_cap: int
    bound_s: float  # nothing waits longer
    machine_scale: float  # the allocator state machines' examples, times the unit suite's


PROFILES = {
    # 8 x >= 25 calls: at least 200 interleaved requests per topology, a few minutes each on 2 cores
    "ci": Profile(interleavings=8, min_calls=25, max_calls=32, max_new_cap=16, bound_s=180, machine_scale=1.0),
    # about 26 s per interleaving of up to 64 calls on 2 cores (2026-12-07): an hour for both
    "thorough": Profile(interleavings=60, min_calls=25, max_calls=64, max_new_cap=96, bound_s=600, machine_scale=10.0),
}


# --- deployments -------------------------------------------------------------------------------


def write_config(run: Path) -> tuple[Path, dict[str, str]]:
    """The launcher's default topology file in `run`, with a tenants file of the suite's four
    tenants; (the config's path, each tenant's API key). Paths in a topology file are read
    relative to the file's own directory: the tenants file is named by its absolute path, so a
    relative --out (the default, suite-out) names it once, not twice."""
    run = run.resolve()
    run.mkdir(parents=True, exist_ok=True)
    tenants_file = run / "suite-tenants.toml"
    keys = {t: tenants.add_tenant(tenants_file, t) for t in TENANTS}
    conf = tomllib.loads(default_config_path().read_text())
    conf["tenants"] = {**conf.get("tenants", {}), "mode": "file", "file": str(tenants_file)}
    cfg = run / "suite.toml"
    cfg.write_text(tomli_w.dumps(conf))
    return cfg, keys


def launch(topology: str, out: Path, reintroduce: bool) -> Target:
    """The launcher's default topology file, with four tenants of the suite's own, and the KV
    canary (and, to reintroduce the incident, the guards off and a stale-row read) in every
    process."""
    run = (out / f"run-{topology}").resolve()  # every path below goes to other processes
    cfg, keys = write_config(run)
    canary, fault_log = run / "kv-canary.jsonl", run / "kv-faults.jsonl"
    extra = {"PYTHONPATH": str(HARNESS), "GLM53_TEST_KV_CANARY": str(canary), "GLM53_TEST_KV_LOG": str(fault_log)}
    # A request's answer in a batch equals its solo run bit for bit, so the differential oracle
    # compares exactly (batch_invariant.py).
    extra[env.BATCH_INVARIANT.name] = "1"
    if reintroduce:
        extra |= {env.KV_GUARD_OFF.name: "zero,owner,handoff", "GLM53_TEST_KV_FOREIGN": INCIDENT_RID}
    elif topology == "pd":  # transfers the fault runs drop, by rid marker
        extra |= faults.HARNESS_ENV
    proc, info = start(run / "launch", "--config", str(cfg), "--topology", topology, env=extra)
    t = info["tenants"]
    operator = (tenants.load_assertion_key(t["assertion_key_file"]), t["deployment"])
    workers = {
        p["name"]: p["url"]
        for p in info["processes"]
        if p["name"] == "server" or p["name"].startswith(("prefill-", "decode-"))
    }
    return Target(topology, info["client_url"], keys, workers, operator, canary, fault_log, proc, run / "launch")


def attach(a) -> Target:
    """A running deployment (--url): its tenants' keys, and the workers the drain oracle reads
    when given with the operator's assertion key. No KV-level canary: its servers run no harness."""
    keys = json.loads(a.keys.read_text()) if a.keys else {}
    if len(keys) < 2:
        raise SystemExit("--url needs --keys: a JSON file of two tenants' API keys or more")
    workers = dict(w.split("=", 1) for w in a.worker)
    operator = None
    if workers:
        if not a.assertion_key:
            raise SystemExit("--worker needs --assertion-key (and --deployment): the drain oracle asks as the operator")
        operator = (tenants.load_assertion_key(a.assertion_key), a.deployment)
    return Target("url", a.url.rstrip("/"), keys, workers, operator)


def served(target: Target) -> Served:
    key = target.keys[target.tenants[0]]
    (m,) = httpx.get(f"{target.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()["data"]
    page = 64 if not target.workers else 1  # GLM-5.3's, where no worker can be asked
    invariant = []
    for name, url in target.workers.items():
        info = httpx.get(f"{url}/server_info", headers=target.admin, timeout=30).json()
        page = max(page, info["glm53_serving"]["capacity"]["page_size"])
        if info["glm53_serving"].get("batch_invariant"):
            invariant.append(name)
    # Without it a call may differ from its solo run by numerics alone (batch_invariant.py).
    print(f"suite [{target.name}]: batch-invariant workers: {len(invariant)}/{len(target.workers)}", file=sys.stderr)
    return Served(m["max_input_tokens"], m["max_model_len"], m.get("max_output_tokens"), page)


# A page a finished request held is released by the scheduler loop a few iterations later in some
# PD paths (a prefill whose client left mid-transfer: 1 page of 25, released within seconds, in the
# thorough run of 2026-12-07); held longer than this after the last request left, it is a finding.
SETTLE_S = 10.0


def idle_states(target: Target, bound_s: float) -> dict[str, dict]:
    """Each worker's state once it holds no request and every page in use is a cached one; at
    the bound, or SETTLE_S after the last request left with pages still held, as it is then (the
    drain oracle says so)."""
    deadline, settle = time.monotonic() + bound_s, None
    while True:
        states = kv_states(target)
        now = time.monotonic()
        if all(
            s["idle"] and not (s["running_requests"] or s["queued_requests"] or s["deferred_releases"])
            for s in states.values()
        ):
            if all(s["pages"] - s["free_pages"] == s["evictable_pages"] for s in states.values()):
                if settle is not None:
                    print(
                        f"suite [{target.name}]: pages released {now - settle:.1f} s after the last request left",
                        file=sys.stderr,
                    )
                return states
            settle = settle or now
            if now - settle > SETTLE_S:
                return states
        if now > deadline:
            return states
        time.sleep(0.5)


def flush(target: Target, bound_s: float) -> list[Finding]:
    """Each worker's prefix cache flushed, by SGLang's deferred flush: it waits up to `bound_s`
    for the scheduler to be idle by SGLang's own measure (is_fully_idle: a chunked prefill, a
    last batch, the PD queues). The router's health check (/health, every 2 s) runs a one-token
    generation on an idle worker, and a plain flush landing in the loop iteration after it is
    refused: unchecked, that read as pages leaked (CI of 2026-12-07: 4 pages still cached on
    prefill after decode-killed). A worker that refuses the deferred flush held something past
    the bound: a drain finding."""
    found = []
    for name, url in target.workers.items():
        r = httpx.post(f"{url}/flush_cache", params={"timeout": bound_s}, headers=target.admin, timeout=bound_s + 30)
        if r.status_code != 200:
            found.append(
                Finding("drain", None, f"{name} refused a cache flush for {bound_s:.0f} s: {r.text.strip()[:200]}")
            )
    return found


def flushed_drain(target: Target, before: dict[str, dict], bound_s: float) -> list[Finding]:
    """The drain oracle's findings: `before` (idle_states after the workload; {} to skip), then
    the flush and the pools once it is done."""
    return [*flush(target, bound_s), *oracles.drain(before, idle_states(target, bound_s))]


# --- one call, one interleaving ----------------------------------------------------------------


@dataclass
class Tally:
    requests: int = 0
    interleavings: int = 0
    faults_injected: int = 0
    faults_confirmed: int = 0
    findings: list[Finding] = field(default_factory=list)
    solo: dict[str, dict] = field(default_factory=dict)  # topology -> solo_key -> output_ids


def interleave(target: Target, calls: list[Call], profile: Profile, shape: Served, tally: Tally, tag: str) -> list:
    """Send `calls` at once, then each distinct call alone; judge them. Returns the findings."""
    n = tally.interleavings
    tally.interleavings += 1
    # "." ends the call's number (suite-pd-3-1. is no prefix of suite-pd-3-10.)
    rids = [f"suite-{tag}-{n}-{i}." + (INCIDENT_RID if c.incident else "") for i, c in enumerate(calls)]
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        outcomes = list(pool.map(lambda ci: send(target, ci[0], ci[1], profile.bound_s), zip(calls, rids)))
    tally.requests += len(calls)
    seen = Counter(
        "left" if o.left else "200 aborted" if o.finish == "abort" else f"{o.status} {o.code or ''}".strip()
        for o in outcomes
    )
    turns = sum(bool(c.then) for c in calls)
    also = f" ({turns} continue a session)" if turns else ""
    print(f"suite [{tag}] interleaving {n}: {len(calls)} calls{also}: {dict(sorted(seen.items()))}", file=sys.stderr)
    # A session continuation is judged as the one call it amounts to (Call.continued).
    calls = [o.effective or c for c, o in zip(calls, outcomes)]
    alone = tally.solo.setdefault(target.name, {})
    for c in calls:
        if oracles.predicted(c, shape)[0] == 200:
            solo(target, c, f"suite-{tag}-{n}-solo.", profile.bound_s, alone)
    before = idle_states(target, profile.bound_s)
    found = [
        *oracles.status(calls, outcomes, shape, profile.bound_s),
        *oracles.differential(calls, outcomes, alone, shape),
        *oracles.canary(calls, outcomes, target.tenants),
        *oracles.drain(before, {}),
        *kv_canary(target, rids),
    ]
    return found


def kv_canary(target: Target, rids: list[str]) -> list[Finding]:
    """The harness's KV-level canary (a request's row reached a slot another namespace wrote; a
    handed-out slot was not zero), for this interleaving's requests and their solo runs."""
    out = []
    for e in target.new_events(target.canary_log):
        rid = str(e.get("rid", ""))
        call = next((i for i, r in enumerate(rids) if rid.startswith(r.removesuffix(INCIDENT_RID))), None)
        what = "reached KV another tenant wrote" if e["event"] == "kv_read_foreign" else "was handed unzeroed slots"
        out.append(Finding("canary", call, f"request {rid} {what} ({e['where']}): {e}"))
    return out


# --- the run -----------------------------------------------------------------------------------


def explore(target: Target, profile: Profile, shape: Served, tally: Tally, out: Path, reintroduce: bool) -> None:
    sessions = target.name == "single"  # SGLang's sessions are not served in PD
    strategy = workloads(shape, target.tenants, profile.min_calls, profile.max_calls, profile.max_new_cap, sessions)

    @settings(
        max_examples=profile.interleavings,
        database=DirectoryBasedExampleDatabase(str(out / "hypothesis-db")),
        phases=(Phase.explicit, Phase.reuse, Phase.generate),  # no shrinking against live servers
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        verbosity=Verbosity.quiet,  # the failing interleaving is saved as JSON, not printed
    )
    @given(strategy)
    def one(calls):
        if reintroduce:  # the incident: one call reads another tenant's live KV, with the guards off
            k = next((i for i in range(len(calls) - 1, -1, -1) if oracles.predicted(calls[i], shape)[0] == 200), None)
            if k is not None:
                calls = [*calls[:k], _incident(calls[k]), *calls[k + 1 :]]
        found = interleave(target, calls, profile, shape, tally, target.name)
        tally.findings.extend(found)
        if found:
            trace = out / f"failure-{target.name}-{tally.interleavings}.json"
            trace.write_text(to_json(calls, target.tenants))
            raise AssertionError(f"{len(found)} findings; replay: --replay {trace}")

    try:
        one()
    except (AssertionError, ExceptionGroup) as e:  # a group: Hypothesis' re-run did not fail alike
        print(f"suite [{target.name}]: {e}", file=sys.stderr)


def _incident(call: Call) -> Call:
    return Call(call.tenant, call.prompt, call.max_new, False, incident=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm53_serving.suite", description=__doc__)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="ci")
    ap.add_argument("--topology", choices=["single", "pd", "both"], default="both")
    ap.add_argument(
        "--reintroduce-incident", action="store_true", help="guards off plus a stale-row read: must be caught"
    )
    ap.add_argument("--replay", type=Path, help="a failure's JSON trace: send that interleaving again")
    ap.add_argument("--out", type=Path, default=Path("suite-out"))
    ap.add_argument("--interleavings", type=int, help="per topology, instead of the profile's")
    ap.add_argument("--url", help="a running deployment's client URL instead of launching one")
    ap.add_argument("--keys", type=Path, help="with --url: a JSON file {tenant: API key}, two tenants or more")
    ap.add_argument("--worker", action="append", default=[], help="with --url: NAME=URL of a worker (drain oracle)")
    ap.add_argument("--assertion-key", type=Path, help="with --worker: the deployment's assertion key file")
    ap.add_argument("--deployment", help="with --worker: the deployment's name (the assertions' audience)")
    ap.add_argument(
        "--no-faults", dest="faults", action="store_false", help="skip the faults injected into the PD topology"
    )
    ap.add_argument(
        "--fault",
        action="append",
        choices=[f.name for f in faults.FAULTS],
        help="inject only this fault (repeatable; default: every one)",
    )
    a = ap.parse_args(argv)
    profile = PROFILES[a.profile]
    if a.interleavings:
        profile = dataclasses.replace(profile, interleavings=a.interleavings)
    a.out.mkdir(parents=True, exist_ok=True)
    tally = Tally()
    if a.url and a.reintroduce_incident:
        raise SystemExit("--reintroduce-incident needs a topology the suite launches (its servers load the harness)")
    topologies = ["url"] if a.url else ["single", "pd"] if a.topology == "both" else [a.topology]
    n_tenants, broken = 0, []
    for topology in topologies:
        target = attach(a) if a.url else launch(topology, a.out, a.reintroduce_incident)
        n_tenants = max(n_tenants, len(target.tenants))
        try:
            shape = served(target)
            if a.replay:
                calls, _ = from_json(a.replay.read_text())
                if topology != "single":  # session continuations are the single topology's
                    calls = [c for c in calls if not c.then]
                tally.findings += interleave(target, calls, profile, shape, tally, "replay")
            else:
                explore(target, profile, shape, tally, a.out, a.reintroduce_incident)
            if not tally.findings:
                tally.findings += flushed_drain(target, {}, profile.bound_s)
            confirm_faults(target, tally)
            if topology == "pd" and a.faults and not (a.replay or a.reintroduce_incident):
                chosen = [f for f in faults.FAULTS if not a.fault or f.name in a.fault]
                inject_faults(target, shape, profile, tally, chosen)
        except Exception:  # noqa: BLE001 - the suite itself broke: say so, still end with the summary
            broken.append(f"suite [{topology}] stopped: {traceback.format_exc()}")
        finally:
            if target.proc is not None:
                stop(target.proc)
    tally.findings += oracles.cross_topology(tally.solo)
    if not a.replay:
        try:
            steps, found = allocator.run(profile.machine_scale, timeout_s=3600)
            print(f"suite [allocator]: {steps} state-machine steps", file=sys.stderr)
            tally.findings += found
        except Exception:  # noqa: BLE001 - as above
            broken.append(f"suite [allocator] stopped: {traceback.format_exc()}")
    for f in tally.findings:
        print(f"suite: [{f.oracle}] call {f.call}: {f.detail}", file=sys.stderr)
    for b in broken:
        print(b, file=sys.stderr)
    leaks = sum(f.oracle in oracles.LEAK_ORACLES for f in tally.findings)
    fired = len({f.oracle for f in tally.findings})
    print(
        f"suite: requests={tally.requests} tenants={n_tenants} interleavings={tally.interleavings} "
        f"faults={tally.faults_injected}/{tally.faults_confirmed} confirmed leaks={leaks} oracles_fired={fired}"
    )
    unconfirmed = tally.faults_confirmed < tally.faults_injected
    return 1 if tally.findings or unconfirmed or broken else 0


def inject_faults(target: Target, shape: Served, profile: Profile, tally: Tally, chosen: list) -> None:
    """The chosen faults (faults.FAULTS), one after the other, each judged on its own, then the
    drain oracle once the deployment is whole again."""
    alone = tally.solo.setdefault(target.name, {})
    for n, fault in enumerate(chosen):
        r = faults.run(target, fault, n, shape, profile.bound_s, alone)
        tally.interleavings += 1
        tally.requests += len(r.outcomes)
        tally.faults_injected += 1
        tally.faults_confirmed += r.confirmed
        found = [*r.findings, *flushed_drain(target, idle_states(target, profile.bound_s), profile.bound_s)]
        tally.findings += [dataclasses.replace(f, detail=f"[{fault.name}] {f.detail}") for f in found]
        faults.report(r)


def confirm_faults(target: Target, tally: Tally) -> None:
    """The incident's stale-row read counts as injected when a call carried its rid, and as
    confirmed when the harness logged that it wrote another tenant's live slot into the row."""
    for e in target.new_events(target.fault_log):
        if e.get("fault") in ("foreign_index", "no_foreign_slot"):
            tally.faults_injected += 1
            tally.faults_confirmed += e["fault"] == "foreign_index" and e["owner"] not in (0, e["own"])


if __name__ == "__main__":
    sys.exit(main())
