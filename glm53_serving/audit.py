"""The audit log: one JSON line per request at the gateway, and the operator's questions about it.

Each record (never prompt or output content):
    {"ts": "2026-12-06T02:31:07.412Z", "tenant": "acme", "key_id": "3f9a0c1d2e4b",
     "request_id": "req-7", "trace_id": "req-7.5be0c2a9d1f3", "endpoint": "/v1/chat/completions",
     "status": 200, "code": null, "latency_ms": 812.4, "prompt_tokens": 1200, "cached_tokens": 1024,
     "completion_tokens": 96}
`request_id` is the answer's `x-request-id` (the client's if sane, else the gateway's);
`trace_id` is what the workers served it under (SGLang's rid, in their logs and event logs:
request_ids.py). `code` is the error contract's code of a refused or failed request
(docs/errors.md); `latency_ms` runs to the answer's last byte; the token counts are the worker's
own (absent where the answer carries none: an OpenAI stream without
`stream_options.include_usage`). Written off the event loop (a queue and one writer thread) to a
file rotated by size (`MAX_BYTES`, `BACKUPS` older files: audit.jsonl.1, ...).

The workers keep their own event log (events.py: RUN_DIR/events/): each request they admitted,
each rejection, each isolation event, under the same trace id. The questions join both:

    python -m glm53_serving.audit affected --run-dir RUN_DIR --since 2026-12-06T00:00 [--until ...]

prints every tenant that met an isolation error (kv_isolation_violation, kv_handoff_mismatch) in
the window, with its request ids: who to tell, in one command. It counts what the gateway
answered and what the workers aborted, so a request that never reached the gateway (a worker
called directly) or whose answer was lost is still counted.

    python -m glm53_serving.audit show --run-dir RUN_DIR REQUEST_ID

prints the gateway's record of one request (by its request id or trace id) with the workers that
served it and every event they logged for it.
"""

from __future__ import annotations

import argparse
import json
import logging
import logging.handlers
import queue
import sys
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

from glm53_serving import events

MAX_BYTES = 64 * 1024 * 1024
BACKUPS = 5
ISOLATION_CODES = events.ISOLATION_EVENTS  # contract codes, and the workers' event names


class AuditLog:
    def __init__(self, path: str | Path):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS)
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._listener = logging.handlers.QueueListener(self._queue, handler)
        self._listener.start()
        self._logger = logging.Logger("glm53_serving.audit")  # not in the logging tree: audit only
        self._logger.addHandler(logging.handlers.QueueHandler(self._queue))

    def record(
        self,
        wall: float,
        tenant: str,
        key_id,
        request_id: str,
        trace_id: str,
        endpoint: str,
        response,
        took_s: float,
        used=None,
    ):
        body = getattr(response, "body", b"") if response.status_code >= 400 else b""
        self._logger.warning(
            json.dumps(
                {
                    "ts": datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                    "tenant": tenant,
                    "key_id": key_id,
                    "request_id": request_id,
                    "trace_id": trace_id,
                    "endpoint": endpoint,
                    "status": response.status_code,
                    "code": _code(body),
                    "latency_ms": round(took_s * 1000, 3),  # a refusal can take under 50 µs
                    **{f"{kind}_tokens": n for kind, n in (used or {}).items()},
                }
            )
        )

    def close(self) -> None:
        self._listener.stop()  # writes what is queued


def _code(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def records(log: Path):
    """Every record of the log and its rotated files, oldest file first."""
    for path in [*(Path(f"{log}.{i}") for i in range(BACKUPS, 0, -1)), Path(log)]:
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    yield json.loads(line)
                except ValueError:
                    continue


def affected(log: Path, since: str, until: str | None = None, events_dir: Path | None = None) -> dict[str, list[str]]:
    """tenant -> request ids that met an isolation error between `since` and `until` (ISO times,
    UTC): the gateway's answers with an isolation code, and the workers' isolation events, whose
    tenant is the one the gateway or a worker recorded for that rid."""
    lo, hi = _instant(since), _instant(until) if until else None

    def inside(r) -> bool:
        t = _instant(r["ts"])
        return t >= lo and (hi is None or t <= hi)

    out: dict[str, set[str]] = defaultdict(set)
    gateway = list(records(log)) if log.exists() else []
    for r in gateway:
        if r.get("code") in ISOLATION_CODES and inside(r):
            out[r["tenant"]].add(r["request_id"])
    if events_dir is not None and events_dir.exists():
        worker = list(events.read(events_dir))
        by_trace = {r.get("trace_id"): r for r in gateway}
        admitted = _admitted(worker)
        for e in worker:
            if e.get("event") in ISOLATION_CODES and inside(e):
                seen_as = admitted.get(e["rid"], {})
                record = by_trace.get(_trace_of(seen_as.get("request_id") or e["rid"]))
                if record is not None:
                    out[record["tenant"]].add(record["request_id"])
                else:  # not through the gateway, or its answer never came back
                    out[seen_as.get("tenant") or "unknown"].add(e["rid"])
    return {tenant: sorted(ids) for tenant, ids in out.items()}


def show(log: Path, events_dir: Path | None, request_id: str) -> dict | None:
    """The gateway's record of a request (by request id or trace id), with the workers that served
    it and their events for it; None when neither log knows it."""
    found = [
        r for r in (records(log) if log.exists() else ()) if request_id in (r.get("request_id"), r.get("trace_id"))
    ]
    record = dict(found[-1]) if found else {"request_id": request_id, "trace_id": request_id}
    trace = record.get("trace_id")
    worker = list(events.read(events_dir)) if events_dir is not None and events_dir.exists() else []
    # Its rids: the trace id (suffixed per sub-request), or the body's own rid where it named one
    rids = {rid for rid, e in _admitted(worker).items() if _trace_of(e.get("request_id") or rid) == trace}
    mine = [e for e in worker if e.get("rid") in rids or _trace_of(str(e.get("request_id"))) == trace]
    if not found and not mine:
        return None
    record["workers"] = sorted({e["worker"] for e in mine if e.get("event") == "admitted"})
    record["events"] = mine
    return record


def _admitted(worker_events) -> dict[str, dict]:
    """rid -> the worker's `admitted` event for it (its tenant, the x-request-id it came with)."""
    return {e["rid"]: e for e in worker_events if e.get("event") == "admitted" and e.get("rid") is not None}


def _trace_of(rid: str) -> str:
    """The trace id of a worker's rid: SGLang serves sub-request i of a batch or of `n` as rid_i."""
    head, _, tail = rid.rpartition("_")
    return head if head and tail.isdigit() else rid


def _instant(text: str) -> datetime:
    t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm53_serving.audit", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("affected", help="tenants that met an isolation error in a time window")
    s = sub.add_parser("show", help="one request: the gateway's record, the workers that served it, their events")
    for q in (a, s):
        q.add_argument("--run-dir", type=Path, help="the launcher's run directory (audit.jsonl and events/)")
        q.add_argument("--log", type=Path, help="the gateway's audit log (default RUN_DIR/audit.jsonl)")
        q.add_argument("--events", type=Path, help="the workers' event logs (default RUN_DIR/events)")
    a.add_argument("--since", required=True, help="ISO time, UTC unless it says otherwise")
    a.add_argument("--until", default=None)
    s.add_argument("request_id", help="the answer's x-request-id, or the trace id the workers logged")
    args = p.parse_args(argv)
    log = args.log or (args.run_dir / "audit.jsonl" if args.run_dir else None)
    events_dir = args.events or (args.run_dir / "events" if args.run_dir else None)
    if log is None:
        p.error("give --run-dir or --log")
    try:
        if args.cmd == "show":
            found = show(log, events_dir, args.request_id)
            if found is None:
                print(f"no record of {args.request_id}", file=sys.stderr)
                return 1
            print(json.dumps(found, indent=2))
            return 0
        affected_ = affected(log, args.since, args.until, events_dir)
    except ValueError as e:
        p.error(str(e))
    for tenant, rids in sorted(affected_.items()):
        print(f"{tenant}\t{len(rids)}\t{' '.join(rids)}")
    print(f"{len(affected_)} tenants affected", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
