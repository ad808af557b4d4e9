"""The workers' event log: one JSON line per admitted request and per isolation event.

The gateway's audit log (audit.py) says what each client was answered; this says which worker
took each request and what its guards saw, under the same ids, so that `python -m
glm53_serving.audit` can tell which workers served a request and which tenants an isolation
event touched even where no answer reached the gateway. Never prompt or output content.

    {"ts": "...Z", "event": "admitted", "worker": "decode-0", "role": "decode", "pid": 4242,
     "rid": "req-7.3f9a0c1d2e4b", "request_id": "req-7.3f9a0c1d2e4b", "tenant": "acme",
     "endpoint": "/v1/chat/completions"}

Events: `admitted` (intake passed it to the scheduler), `rejected` (a guard refused it: its
contract `code`), `kv_isolation_violation` and `kv_handoff_mismatch` (the scheduler aborted it;
`where`). `rid` is SGLang's request id (the gateway's trace id unless the body named one),
`request_id` the `x-request-id` the worker received.

Where: `GLM53_EVENTS_LOG` is a path prefix the launcher sets per server (RUN_DIR/events/NAME);
every process of the server (HTTP, schedulers) writes `PREFIX.PID.jsonl`, its own file, rotated
by size, through a queue and a writer thread (never on the event loop or a forward pass). Unset
(a hand-launched server), events go to the server's log only. Imports nothing of the package but
env (ground floor).
"""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import os
import queue
from datetime import UTC, datetime
from pathlib import Path

from glm53_serving import env

MAX_BYTES = 64 * 1024 * 1024
BACKUPS = 3
ISOLATION_EVENTS = ("kv_isolation_violation", "kv_handoff_mismatch")

_logger: logging.Logger | None = None
_listener: logging.handlers.QueueListener | None = None
_pid: int | None = None
_worker = ""  # the server's name: the last part of GLM53_EVENTS_LOG


def _writer() -> logging.Logger | None:
    """This process's writer, opened on first use (and again in a forked child)."""
    global _logger, _listener, _pid, _worker
    prefix = env.EVENTS_LOG.get()
    if not prefix:
        return None
    if _logger is None or _pid != os.getpid():
        _pid, _worker = os.getpid(), Path(prefix).name
        path = Path(f"{prefix}.{_pid}.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS, delay=True)
        handler.setFormatter(logging.Formatter("%(message)s"))
        q: queue.SimpleQueue = queue.SimpleQueue()
        _listener = logging.handlers.QueueListener(q, handler)
        _listener.start()
        atexit.register(close)  # what is queued is written at exit
        logger = logging.Logger(f"glm53_serving.events.{_pid}")  # not in the logging tree
        logger.addHandler(logging.handlers.QueueHandler(q))
        _logger = logger
    return _logger


def record(event: str, *, rid, request_id: str | None = None, **fields) -> None:
    """Write one event of this worker (a no-op where GLM53_EVENTS_LOG is unset)."""
    writer = _writer()
    if writer is None:
        return
    line = {
        "ts": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "event": event,
        "worker": _worker,
        "pid": _pid,
        "rid": rid,
        "request_id": request_id,
        **fields,
    }
    writer.warning(json.dumps(line, default=str))


def close() -> None:
    """Write what is queued and stop this process's writer (the next event opens a new one)."""
    global _logger, _listener
    if _listener is not None and _pid == os.getpid():
        _listener.stop()
    _logger = _listener = None


def read(directory: str | Path):
    """Every event under `directory` (RUN_DIR/events), rotated files included."""
    for path in sorted(Path(directory).glob("*.jsonl*")):
        for text in path.read_text(errors="replace").splitlines():
            try:
                yield json.loads(text)
            except ValueError:
                continue
