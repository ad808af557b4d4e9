"""Start topologies the way users do (`python -m glm53_serving.launch`) and wait for ready.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from glm53_serving import tenants

READY_TIMEOUT_S = float(os.environ.get("GLM53_TEST_READY_TIMEOUT", "400"))


@dataclass
class Launched:
    proc: subprocess.Popen
    run_dir: Path
    info: dict

    @property
    def url(self) -> str:
        return self.info["client_url"]

    def worker(self, name: str) -> str:
        return next(p["url"] for p in self.info["processes"] if p["name"] == name)

    def client_headers(self, tenant: str = "demo") -> dict:
        """What a client of this deployment sends: its tenant's API key (demo tenants: demo, demo-b)."""
        keys_file = self.info["tenants"]["demo_keys_file"]
        if keys_file is None:
            return {}
        return {"Authorization": f"Bearer {json.loads(Path(keys_file).read_text())[tenant]}"}

    def worker_headers(self, tenant: str = "demo") -> dict:
        """What lets a test reach a worker directly as the gateway would: a signed assertion for
        `tenant` ("admin": the operator's)."""
        key_file = self.info["tenants"]["assertion_key_file"]
        if key_file is None:
            return {}
        key, deployment = tenants.load_assertion_key(key_file), self.info["tenants"]["deployment"]
        return {"Authorization": f"Bearer {tenants.mint(key, tenant, deployment=deployment)}"}

    def stop(self, sig=signal.SIGINT, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


def start(run_dir: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    out = (run_dir / "launcher.out").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "glm53_serving.launch", "--run-dir", str(run_dir), *args],
        env={**os.environ, **(env or {})},
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )


def launcher_output(run_dir: Path) -> str:
    return (run_dir / "launcher.out").read_text(errors="replace")


def launch(run_dir: Path, *args: str, env: dict | None = None) -> Launched:
    proc = start(run_dir, *args, env=env)
    ready = run_dir / "ready.json"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"launcher exited {proc.returncode}:\n{launcher_output(run_dir)[-5000:]}")
        if time.monotonic() > deadline:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
            raise RuntimeError(f"not ready after {READY_TIMEOUT_S} s:\n{launcher_output(run_dir)[-5000:]}")
        time.sleep(0.5)
    run = Launched(proc, run_dir, json.loads(ready.read_text()))
    _LAUNCHED.append(run)
    return run


_LAUNCHED: list[Launched] = []


def auth(url: str, tenant: str = "demo") -> dict:
    """Credentials for a request to `url` of any deployment this test session launched: the
    tenant's API key at a client URL, the gateway's signed assertion for that tenant at a worker
    or router (the router forwards Authorization). Tenant "admin": the operator's assertion."""
    for run in _LAUNCHED:
        if url.startswith(run.url) and tenant != "admin":
            return run.client_headers(tenant)
        if any(url.startswith(p["url"]) for p in run.info["processes"]):
            return run.worker_headers(tenant)
    raise AssertionError(f"{url} belongs to no deployment launched by these tests")


def eventually(find, timeout: float = 30):
    """What `find` returns once it is truthy, or its last answer after `timeout` s (logs written
    by writer threads arrive a little after the answer)."""
    deadline = time.monotonic() + timeout
    while not (found := find()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def worker_events(run: Launched, **match) -> list[dict]:
    """The workers' event log lines (glm53_serving/events.py) with these field values."""
    from glm53_serving import events

    return [e for e in events.read(run.info["events_dir"]) if all(e.get(k) == v for k, v in match.items())]


def alive(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


class SlowStream(threading.Thread):
    """A `max_new`-token /generate stream read slowly (20 ms a line: >= 8 s at the client for 400
    tokens), so it is still open while a test changes something under it (a key retired, the
    launcher stopped). After join(): status, request id, text, completion_tokens."""

    def __init__(self, url: str, headers: dict, max_new: int | None = None):
        super().__init__(daemon=True)
        from tests.e2e.deployment import LONG

        self.url, self.headers, self.max_new = url, headers, max_new or LONG
        self.first, self.status, self.rid, self.text = threading.Event(), None, None, None

    def run(self) -> None:
        body = {
            "input_ids": [5, 6, 7, 8],
            "stream": True,
            "sampling_params": {"max_new_tokens": self.max_new, "temperature": 0, "ignore_eos": True},
        }
        try:
            with httpx.stream("POST", f"{self.url}/generate", json=body, headers=self.headers, timeout=300) as r:
                self.status, self.rid, lines = r.status_code, r.headers.get("x-request-id"), []
                for line in r.iter_lines():
                    self.first.set()
                    lines.append(line)
                    time.sleep(0.02)
                self.text = "\n".join(lines)
        finally:
            self.first.set()

    def started(self, timeout: float = 60) -> SlowStream:
        self.start()
        assert self.first.wait(timeout)
        return self

    @property
    def done(self) -> bool:
        return self.text is not None

    def assert_whole(self) -> None:
        """200, every token, no error event, [DONE]."""
        self.join(300)
        assert self.status == 200 and self.text and "[DONE]" in self.text and '"error"' not in self.text, self.text
        last = json.loads([x for x in self.text.splitlines() if x.startswith("data: {")][-1][6:])
        assert last["meta_info"]["completion_tokens"] == self.max_new


def run_whole(argv: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output, text) for a command that starts deployments (the bench, the
    suite): in a process group of its own, and on timeout the whole group gets SIGTERM (each
    launcher in it then stops its servers) before TimeoutExpired, then SIGKILL. subprocess.run
    kills only the command, and its launchers' servers ran on into the next tests."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=120)  # the launchers' orderly stop
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
