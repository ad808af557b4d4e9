"""Start topologies the way users do (`python -m glm53_serving.launch`) and wait for ready.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

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
        """What a client of this deployment sends: its tenant's API key (tenants issue)."""
        return {}

    def worker_headers(self, tenant: str = "demo") -> dict:
        """What lets a test reach a worker directly as the gateway would: a signed tenant assertion."""
        return {}

    def stop(self, sig=signal.SIGINT, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


def start(run_dir: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    out = (run_dir / "launcher.out").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "glm53_serving.launch", "--run-dir", str(run_dir), *args],
        env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
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
    return Launched(proc, run_dir, json.loads(ready.read_text()))


def alive(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out
