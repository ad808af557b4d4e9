"""The audit log: one JSON line per request at the gateway, and the operator's questions about it.

Each record (never prompt or output content):
    {"ts": "2026-12-06T02:31:07.412Z", "tenant": "acme", "key_id": "3f9a0c1d2e4b",
     "request_id": "g53-...", "endpoint": "/v1/chat/completions", "status": 200, "code": null,
     "latency_ms": 812.4, "prompt_tokens": 1200, "cached_tokens": 1024, "completion_tokens": 96}
`code` is the error contract's code of a refused or failed request (docs/errors.md); `latency_ms`
runs to the answer's last byte; the token counts are the worker's own (absent where the answer
carries none: an OpenAI stream without `stream_options.include_usage`). Written off the event loop (a queue and one writer thread) to a
file rotated by size (`MAX_BYTES`, `BACKUPS` older files: audit.jsonl.1, ...).

    python -m glm53_serving.audit affected --log RUN_DIR/audit.jsonl --since 2026-12-06T00:00 [--until ...]

prints every tenant that got an isolation error (kv_isolation_violation, kv_handoff_mismatch)
in the window, with its request ids: who to tell, in one command.
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

MAX_BYTES = 64 * 1024 * 1024
BACKUPS = 5
ISOLATION_CODES = ("kv_isolation_violation", "kv_handoff_mismatch")


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
        self, wall: float, tenant: str, key_id, request_id: str, endpoint: str, response, took_s: float, used=None
    ):
        body = getattr(response, "body", b"") if response.status_code >= 400 else b""
        self._logger.warning(
            json.dumps(
                {
                    "ts": datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                    "tenant": tenant,
                    "key_id": key_id,
                    "request_id": request_id,
                    "endpoint": endpoint,
                    "status": response.status_code,
                    "code": _code(body),
                    "latency_ms": round(took_s * 1000, 1),
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


def affected(log: Path, since: str, until: str | None = None) -> dict[str, list[str]]:
    """tenant -> request ids that got an isolation error between `since` and `until` (ISO times, UTC)."""
    lo, hi = _instant(since), _instant(until) if until else None
    out: dict[str, list[str]] = defaultdict(list)
    for r in records(log):
        t = _instant(r["ts"])
        if r.get("code") in ISOLATION_CODES and t >= lo and (hi is None or t <= hi):
            out[r["tenant"]].append(r["request_id"])
    return dict(out)


def _instant(text: str) -> datetime:
    t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm53_serving.audit", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("affected", help="tenants that got an isolation error in a time window")
    a.add_argument("--log", type=Path, required=True, help="the gateway's audit log (RUN_DIR/audit.jsonl)")
    a.add_argument("--since", required=True, help="ISO time, UTC unless it says otherwise")
    a.add_argument("--until", default=None)
    args = p.parse_args(argv)
    try:
        found = affected(args.log, args.since, args.until)
    except ValueError as e:
        p.error(str(e))
    for tenant, rids in sorted(found.items()):
        print(f"{tenant}\t{len(rids)}\t{' '.join(rids)}")
    print(f"{len(found)} tenants affected", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
