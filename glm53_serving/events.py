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
by size, through a queue and a writer thread that writes what was queued every 0.1 s (never on
the event loop or a forward pass). Unset
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
import threading
from datetime import UTC, datetime
from pathlib import Path

from glm53_serving import env

MAX_BYTES = 64 * 1024 * 1024
BACKUPS = 3
ISOLATION_EVENTS = ("kv_isolation_violation", "kv_handoff_mismatch")
# The writer wakes this often and writes what was queued in one write. Woken per event (a
# QueueListener), it cost the HTTP process ~60 us of CPU per request here (the wake-up, the GIL
# handed to it and back, a write and a flush per line): ~10% of its py-spy samples under load.
FLUSH_S = 0.1

_writer_thread: _Writer | None = None
_pid: int | None = None
_worker = ""  # the server's name: the last part of GLM53_EVENTS_LOG


class _Writer(threading.Thread):
    """Writes queued lines every FLUSH_S, each batch as one record of a size-rotated file."""

    def __init__(self, path: Path):
        super().__init__(name="glm53-events", daemon=True)
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.handler = logging.handlers.RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS, delay=True)
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(FLUSH_S):
            self.drain()
        self.drain()

    def drain(self) -> None:
        batch = []
        while True:
            try:
                batch.append(self.lines.get_nowait())
            except queue.Empty:
                break
        if batch:  # one write and one flush (rotation, by size, between batches)
            self.handler.handle(logging.makeLogRecord({"msg": "\n".join(batch)}))

    def stop(self) -> None:
        self.stopping.set()
        self.join()
        self.handler.close()


def _writer() -> _Writer | None:
    """This process's writer, started on first use (and again in a forked child)."""
    global _writer_thread, _pid, _worker
    prefix = env.EVENTS_LOG.get()
    if not prefix:
        return None
    if _writer_thread is None or _pid != os.getpid():
        _pid, _worker = os.getpid(), Path(prefix).name
        path = Path(f"{prefix}.{_pid}.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        _writer_thread = _Writer(path)
        _writer_thread.start()
        atexit.register(close)  # what is queued is written at exit
    return _writer_thread


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
    writer.lines.put(json.dumps(line, default=str))


def close() -> None:
    """Write what is queued and stop this process's writer (the next event opens a new one)."""
    global _writer_thread
    if _writer_thread is not None and _pid == os.getpid():
        _writer_thread.stop()
    _writer_thread = None


def read(directory: str | Path):
    """Every event under `directory` (RUN_DIR/events), rotated files included."""
    for path in sorted(Path(directory).glob("*.jsonl*")):
        for text in path.read_text(errors="replace").splitlines():
            try:
                yield json.loads(text)
            except ValueError:
                continue
