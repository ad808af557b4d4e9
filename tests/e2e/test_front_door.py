"""The worker's front door on real SGLang servers: authentication before the body is read, start-up
refusals for configurations the guards would not cover, tenants off as an explicit choice that
keeps the operator's routes, and SGLang's own internal call let through (and only it)."""

from __future__ import annotations

import os
import subprocess
import time
from contextlib import contextmanager

import httpx
import pytest

from glm53_serving import env
from glm53_serving.topology import Topology, free_port
from tests.e2e.deployment import CONFIG, model_path

pytestmark = pytest.mark.e2e


def server_command(extra_args=(), extra_env=None, drop=()):
    """A single server as the launcher would start it, on its own, with `extra_env` and without `drop`."""
    topo = Topology.load(CONFIG, "single")
    port = free_port()
    argv = topo.server_argv(model_path(), port, "single") + list(extra_args)
    e = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    e.update(topo.process_env(), **(extra_env or {}))
    for k in drop:
        e.pop(k, None)
    return argv, e, f"http://127.0.0.1:{port}"


def refused(tmp_path, **kw) -> str:
    argv, e, _ = server_command(**kw)
    out = subprocess.run(argv, env=e, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0, "the server started"
    log = out.stdout + out.stderr
    assert "glm53_serving: refusing to start" in log, log[-3000:]
    return log


@contextmanager
def serving(tmp_path, **kw):
    argv, e, url = server_command(**kw)
    log = tmp_path / "server.log"
    with log.open("wb") as f:
        proc = subprocess.Popen(argv, env=e, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "not ready"
            time.sleep(1)
        yield url, log
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)


def test_a_worker_without_its_key_refuses_to_start_unless_tenants_are_off(tmp_path):
    log = refused(tmp_path, drop=[env.ASSERTION_KEY_FILE.name])
    assert "no assertion key" in log and f"{env.TENANTS.name}=off" in log


def test_extra_tokenizer_workers_which_load_no_plugin_are_refused(tmp_path):
    """SGLang's extra HTTP workers import the app by path and never call load_plugins(): they
    would serve without any guard while the first process's handshake passed."""
    log = refused(tmp_path, extra_args=["--tokenizer-worker-num", "2"], extra_env={env.TENANTS.name: "off"})
    assert "--tokenizer-worker-num 2 is refused" in log and "never load plugins" in log


def test_hierarchical_cache_whose_pages_come_back_untagged_is_refused(tmp_path):
    log = refused(tmp_path, extra_args=["--enable-hierarchical-cache"], extra_env={env.TENANTS.name: "off"})
    assert "--enable-hierarchical-cache True is refused" in log


def test_tenants_off_keeps_the_operator_routes_and_one_namespace(tmp_path):
    with serving(tmp_path, extra_env={env.TENANTS.name: "off"}, drop=[env.ASSERTION_KEY_FILE.name]) as (url, log):
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2  # one trust domain: no credential
        for path in ("/flush_cache", "/pause_generation", "/update_weights_from_disk"):
            r = httpx.post(f"{url}{path}", json={}, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        r = httpx.post(f"{url}/abort_request", json={"abort_all": True}, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", r.text
        # A client's cache_salt picks no KV namespace: the same prompt under two salts shares its cache.
        long = {"input_ids": list(range(10, 300)), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        httpx.post(f"{url}/generate", json={**long, "cache_salt": "one"}, timeout=120).raise_for_status()
        r = httpx.post(f"{url}/generate", json={**long, "cache_salt": "two"}, timeout=120)
        assert r.json()["meta_info"]["cached_tokens"] >= 256, r.json()["meta_info"]


def test_authentication_comes_before_the_body_on_every_worker(single, pd):
    invalid_json = b'{"text": "x", "sampling_params": {"temperature": -5}'
    for url in (single.worker("server"), pd.worker("prefill-0"), pd.worker("decode-0")):
        r = httpx.post(
            f"{url}/generate", content=invalid_json, headers={"content-type": "application/json"}, timeout=60
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (url, r.text[:300])


def test_sglang_freezes_every_process_heap_after_warm_up(single, pd):
    """SGLang posts /freeze_gc to itself after warm-up; the tenant guard refused it (401, and no
    scheduler or detokenizer heap was ever frozen). Its in-process credential opens that route only."""
    for run, name in ((single, "server"), (pd, "prefill-0"), (pd, "decode-0")):
        log = (run.run_dir / f"{name}.log").read_text(errors="replace")
        assert "froze the start-up heap of every process of this server" in log, name
        assert "freeze_gc failed" not in log, name
