"""Faults injected into a running PD deployment the suite launched, each confirmed to have fired
before its outcome counts: a fault that silently did nothing fails the run.

Per fault, two calls of every tenant (one streamed) are in flight when it fires; for a process
that dies, one more call of every tenant arrives while it is down. Judged:
- every answer is a whole 200 equal to the call served alone, or an error the client can tell
  from success (a status with a machine-readable code, an error event, a stream cut short at
  the transport): never a 200 with wrong or missing content;
- a pause and a slow client fail nobody: every call is a whole, correct 200;
- nothing waits past the bound; no answer carries another tenant's marker or name;
- afterwards every tenant is served again, correctly, and the drain oracle holds.

Confirmed by: the launcher's restarts.jsonl (a new pid for the killed one), the process state
(stopped, then running again), the harness's log (it zeroed the pages it was asked to drop), the
slow client's own clock (it read for at least its delays).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from glm53_serving.suite import oracles
from glm53_serving.suite.client import Target, kv_states, send, solo
from glm53_serving.suite.oracles import Finding, Outcome
from glm53_serving.suite.workload import Call, Served, marker

# rid markers the test harness drops a transfer for (tests/support/kv_fault: after the transfer
# reports success, decode's copy of the last prompt page is zeroed, as if it never arrived)
DROP_MARKERS = {"drop_latent": "suite-drop-latent", "drop_index_k": "suite-drop-index-k"}
# rid markers whose succeeded transfer the harness reports in flight for HOLD_S, on decode's side
# or on prefill's (an abort lands meanwhile)
HOLD_MARKERS = {"abort_held": "suite-hold-decode", "prefill_abort_held": "suite-hold-prefill"}
HOLD_SIDE = {"abort_held": "decode", "prefill_abort_held": "prefill"}
HOLD_S = 3.0
HARNESS_ENV = {
    "GLM53_TEST_KV_DROP_LATENT": DROP_MARKERS["drop_latent"],
    "GLM53_TEST_KV_DROP_INDEX_K": DROP_MARKERS["drop_index_k"],
    "GLM53_TEST_KV_HOLD_TRANSFER": HOLD_MARKERS["abort_held"],
    "GLM53_TEST_KV_HOLD_PREFILL": HOLD_MARKERS["prefill_abort_held"],
    "GLM53_TEST_KV_HOLD_S": str(HOLD_S),
}
HARNESS_EVENT = {"drop_latent": "dropped_latent_page", "drop_index_k": "dropped_index_k_page"}
PAUSE_S = 4.0  # how long a paused process stays stopped
READ_DELAY_S = 0.25  # the slow client's pause before each line it reads
MAX_NEW = 24


@dataclass(frozen=True, slots=True)
class Fault:
    name: str
    action: str  # kill | stop | drop_latent | drop_index_k | slow_client | abort_held | prefill_abort_held
    process: str | None = None  # the name in ready.json of the process it hits

    @property
    def harmless(self) -> bool:
        """A fault that must fail no request: every call a whole, correct 200."""
        return self.action in ("stop", "slow_client")


FAULTS = (
    Fault("transfer-drops-latent", "drop_latent"),
    Fault("transfer-drops-index-k", "drop_index_k"),
    Fault("slow-client", "slow_client"),
    # sglang PR 33508: an abort pending when the transfer reports success must not come back a 200
    Fault("abort-during-transfer", "abort_held"),
    # sglang issue 32605: an abort that reaches prefill while decode goes on returns no other's results
    Fault("prefill-abort-during-transfer", "prefill_abort_held"),
    Fault("decode-paused", "stop", "decode-0"),
    Fault("prefill-paused", "stop", "prefill-0"),
    Fault("router-killed", "kill", "router"),
    Fault("decode-killed", "kill", "decode-0"),
    Fault("prefill-killed", "kill", "prefill-0"),
)


@dataclass(slots=True)
class Result:
    fault: Fault
    confirmed: bool
    evidence: str
    findings: list[Finding]
    outcomes: list[tuple[Call, Outcome]]


def calls_for(tenants: list[str], n: int, arrival: str) -> list[Call]:
    """Two calls per tenant (streamed and not), prompts of 40-90 tokens led by the tenant's
    marker, distinct per fault and arrival (`n` seeds them)."""
    out = []
    for i, t in enumerate(tenants):
        for stream in (True, False):
            length = 40 + (13 * n + 7 * i + 29 * stream + 31 * (arrival == "late")) % 51
            body = [*marker(tenants, t), *((5 + (17 * k + 3 * n + i) % 400) for k in range(length))][:length]
            out.append(Call(t, tuple(body), MAX_NEW, stream))
    return out


def process_pid(run_dir: Path, name: str) -> int:
    info = json.loads((run_dir / "ready.json").read_text())
    return next(p["pid"] for p in info["processes"] if p["name"] == name)


def restart_of(run_dir: Path, name: str, old_pid: int, bound_s: float) -> dict | None:
    """The launcher's restarts.jsonl line for `name` replacing `old_pid`, once it is ready."""
    log, deadline = run_dir / "restarts.jsonl", time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if log.exists():
            for line in log.read_text().splitlines():
                e = json.loads(line)
                if e["name"] == name and e["old_pid"] == old_pid:
                    return e
        time.sleep(0.5)
    return None


def _states(procs: list[psutil.Process], ok, within_s: float = 2.0) -> dict | None:
    """None once every process's state is ok (signals arrive asynchronously); else the states."""
    deadline = time.monotonic() + within_s
    while True:
        states = {p.pid: p.status() for p in procs if p.is_running()}
        bad = {pid: s for pid, s in states.items() if not ok(s)}
        if not bad or time.monotonic() > deadline:
            return bad or None
        time.sleep(0.05)


def _group(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def run(target: Target, fault: Fault, n: int, served: Served, bound_s: float, alone: dict) -> Result:
    """Inject one fault into `target` (a launched PD topology), with calls in flight. `alone`:
    the topology's solo runs (solo_key -> output ids), which the judgement adds to."""
    run_dir = target.run_dir
    calls = calls_for(target.tenants, n, "first")
    rids = [f"suite-fault-{n}-{i}." for i in range(len(calls))]
    victim = None
    rid_marker = {**DROP_MARKERS, **HOLD_MARKERS}.get(fault.action)
    if rid_marker is not None:  # the transfer of one call (not streamed, of the first tenant)
        victim = 1
        rids[victim] += rid_marker
    delays = [0.0] * len(calls)
    if fault.action == "slow_client":
        victim = 0  # the first tenant's streamed call reads one line every READ_DELAY_S
        delays[victim] = READ_DELAY_S
    pool = ThreadPoolExecutor(max_workers=2 * len(calls))
    futures = [pool.submit(send, target, c, r, bound_s, d) for c, r, d in zip(calls, rids, delays)]
    late: list[Call] = []
    evidence, confirmed = "", False
    try:
        if fault.process is not None:
            _until_in_flight(target, bound_s)
            pid = process_pid(run_dir, fault.process)
            if fault.action == "kill":
                os.killpg(pid, signal.SIGKILL)
                late = calls_for(target.tenants, n, "late")  # arrive while it is down
                futures += [
                    pool.submit(send, target, c, f"suite-fault-{n}-late-{i}.", bound_s, 0.0) for i, c in enumerate(late)
                ]
                e = restart_of(run_dir, fault.process, pid, bound_s)
                confirmed = e is not None and psutil.pid_exists(e["new_pid"]) and not psutil.pid_exists(pid)
                evidence = f"restarts.jsonl: {e}" if e else f"no restart of {fault.process} (pid {pid}) logged"
            else:
                procs = _group(pid)
                os.killpg(pid, signal.SIGSTOP)
                stopped = _states(procs, lambda s: s == psutil.STATUS_STOPPED)
                time.sleep(PAUSE_S)
                os.killpg(pid, signal.SIGCONT)
                resumed = _states(procs, lambda s: s != psutil.STATUS_STOPPED)
                confirmed = stopped is None and resumed is None
                evidence = (
                    f"{len(procs)} processes of {fault.process} stopped for {PAUSE_S:g} s"
                    if confirmed
                    else f"{fault.process}: not stopped {stopped}, not resumed {resumed}"
                )
        if fault.action in HOLD_MARKERS:
            aborted_at, evidence = _abort_while_held(target, fault, calls[victim], rids[victim], bound_s)
        outcomes = [f.result(timeout=2 * bound_s) for f in futures]
    finally:
        pool.shutdown(wait=True)
    if fault.action in HOLD_MARKERS:  # answered while the harness still held it, and it took effect there
        side = HOLD_SIDE[fault.action]
        released = [e for e in target.new_events(target.fault_log) if e.get("fault") == f"{side}_transfer_released"]
        confirmed = aborted_at is not None and any(e["t"] > aborted_at and e["status"] == "Failed" for e in released)
        evidence += f"; harness: {released}"
    every = [*calls, *late]
    if fault.action in DROP_MARKERS:
        events = [e for e in target.new_events(target.fault_log) if DROP_MARKERS[fault.action] in str(e.get("rid"))]
        confirmed = any(e.get("fault") == HARNESS_EVENT[fault.action] and e.get("slots", 0) > 0 for e in events)
        evidence = f"harness: {events}"
    if fault.action == "slow_client":
        lines = outcomes[victim].body.count("\n") + 1
        confirmed = outcomes[victim].seconds >= 0.8 * READ_DELAY_S * lines
        evidence = f"slow client read {lines} lines in {outcomes[victim].seconds:.1f} s"
    found = judge(target, fault, every, outcomes, victim, served, bound_s, alone)
    return Result(fault, confirmed, evidence, found, list(zip(every, outcomes)))


def _abort_while_held(target, fault: Fault, call: Call, rid: str, bound_s: float) -> tuple[float | None, str]:
    """Once the harness holds the call's succeeded transfer, the operator aborts the call at the
    worker holding it: decode (PR 33508), or prefill while decode goes on (issue 32605). Not the
    client: sglang-router does not route /abort_request, so in PD a client's answers 404 (its way
    to abort is to disconnect). Returns when the abort was answered (None: it was not, or nothing
    was held)."""
    side = HOLD_SIDE[fault.action]
    deadline, held = time.monotonic() + bound_s, []
    while not held and time.monotonic() < deadline:
        held = [e for e in target.new_events(target.fault_log) if e.get("fault") == f"{side}_transfer_held"]
        time.sleep(0.02)
    if not held:
        return None, f"the harness never held the transfer on {side}"
    url = target.workers[f"{side}-0"]
    r = httpx.post(f"{url}/abort_request", json={"rid": rid}, headers=target.admin, timeout=bound_s)
    answered = time.time()
    evidence = f"held on {side} at {held[0]['t']:.3f}, abort answered {r.status_code} at {answered:.3f}"
    return (answered if r.status_code == 200 else None), evidence


def _until_in_flight(target: Target, bound_s: float) -> None:
    """Until decode runs a request of this fault's calls (its prefill is done, it is generating)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if any(s["running_requests"] for name, s in kv_states(target).items() if name.startswith("decode")):
            return
        time.sleep(0.05)


def judge(target: Target, fault, calls, outcomes, victim, served, bound_s, solo_runs: dict) -> list[Finding]:
    found = [f for f in oracles.status(calls, outcomes, served, bound_s) if "answered after" in f.detail]
    found += oracles.canary(calls, outcomes, target.tenants)
    for i, (c, o) in enumerate(zip(calls, outcomes)):
        whole = o.status == 200 and o.code is None and o.finish != "abort"
        # after the fault every tenant is served again; one rid each: one still in flight is refused
        alone = solo(target, c, f"suite-fault-solo-{len(solo_runs)}.", bound_s, solo_runs)
        if alone is None:
            found.append(Finding("status", i, f"after {fault.name}, the call served alone was not a 200"))
        elif o.finish == "abort" and not oracles.own_prefix(o, alone):
            found.append(Finding("differential", i, f"{fault.name}: an aborted call's tokens are not its own"))
        elif whole and o.output_ids != alone:
            found.append(Finding("differential", i, f"{fault.name}: a 200 whose tokens are not the call's own alone"))
        elif o.status is not None and o.status != 200 and o.code is None:
            found.append(Finding("status", i, f"{fault.name}: {o.status} without a machine-readable code"))
        if fault.harmless and not whole:
            found.append(Finding("status", i, f"{fault.name} failed a call: {o.status} {o.code}"))
        if i == victim and fault.action in DROP_MARKERS and whole:
            found.append(Finding("status", i, f"{fault.name}: the call whose pages never arrived got a 200"))
        if i == victim and fault.action == "abort_held" and whole:
            found.append(Finding("status", i, f"{fault.name}: the call aborted before its decode began got a 200"))
        if i != victim and fault.action in HOLD_MARKERS and not whole:
            found.append(Finding("status", i, f"{fault.name}: another call failed: {o.status} {o.code} {o.finish}"))
    return found


def report(r: Result) -> None:
    seen = {}
    for _, o in r.outcomes:
        k = f"{o.status} {o.code or ''}".strip()
        seen[k] = seen.get(k, 0) + 1
    print(
        f"suite [fault {r.fault.name}]: confirmed={r.confirmed} ({r.evidence}); outcomes {dict(sorted(seen.items()))}",
        file=sys.stderr,
    )
