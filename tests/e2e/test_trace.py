"""One request id from the client to every worker (request_ids.py): the answer, the gateway's
audit record, SGLang's own request id and the workers' event logs (events.py) all name the same
request, through the real router in PD, with the real `openai` client."""

import json
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.launcher import eventually, worker_events

pytestmark = pytest.mark.e2e

WORKERS = {"single": ["server"], "pd": ["decode-0", "prefill-0"]}


def audit_record(run, request_id: str) -> dict | None:
    log = Path(run.info["audit_log"])
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return next((r for r in rows if r["request_id"] == request_id), None)


def audit_cli(run, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "glm53_serving.audit", *args, "--run-dir", str(run.run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("name", ["single", "pd"])
def test_one_request_id_names_a_request_from_the_client_to_every_worker(single, pd, name):
    run = {"single": single, "pd": pd}[name]
    key = run.client_headers("demo")["Authorization"].split()[1]
    client = openai.OpenAI(base_url=f"{run.url}/v1", api_key=key, max_retries=0)
    request_id = f"trace-{name}-{uuid.uuid4().hex[:8]}"
    raw = client.chat.completions.with_raw_response.create(
        model=run.info["model"],
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        temperature=0,
        extra_headers={"x-request-id": request_id},
    )
    assert raw.headers["x-request-id"] == request_id
    completion = raw.parse()
    record = eventually(lambda: audit_record(run, request_id))
    assert record is not None and record["tenant"] == "demo" and record["status"] == 200
    trace = record["trace_id"]
    assert trace.startswith(f"{request_id}.") and trace != request_id  # unique even if the client's is not
    assert completion.id == trace  # SGLang served it under the trace id: its own logs say so too
    admitted = eventually(lambda: worker_events(run, event="admitted", rid=trace))
    assert sorted(e["worker"] for e in admitted) == WORKERS[name]
    assert {(e["tenant"], e["request_id"], e["endpoint"]) for e in admitted} == {
        ("demo", trace, "/v1/chat/completions")
    }
    assert {e["role"] for e in admitted} == ({"single"} if name == "single" else {"prefill", "decode"})
    shown = audit_cli(run, "show", request_id)
    assert shown.returncode == 0, shown.stderr
    shown = json.loads(shown.stdout)
    assert shown["trace_id"] == trace and shown["workers"] == WORKERS[name]
    assert "hello" not in json.dumps(shown)  # never content


def test_a_sampled_request_and_a_workers_rejections_carry_the_id(single):
    key = single.client_headers("demo")["Authorization"].split()[1]
    client = openai.OpenAI(base_url=f"{single.url}/v1", api_key=key, max_retries=0)
    request_id = f"trace-n-{uuid.uuid4().hex[:8]}"
    stream = client.completions.create(
        model=single.info["model"],
        prompt="count",
        n=2,
        max_tokens=3,
        stream=True,
        extra_headers={"x-request-id": request_id},
    )
    assert {c.index for chunk in stream for c in chunk.choices} == {0, 1}
    trace = eventually(lambda: audit_record(single, request_id))["trace_id"]
    shown = json.loads(audit_cli(single, "show", trace).stdout)
    rids = {e["rid"] for e in shown["events"] if e["event"] == "admitted"}
    # SGLang serves sample i of `n` as TRACE_i (intake sees the first; the others are its copies)
    assert rids and all(r.startswith(f"{trace}_") for r in rids), rids
    # A worker called directly refuses an out-of-vocabulary id: its rejection is an event with the id
    r = httpx.post(
        f"{single.worker('server')}/generate",
        json={"input_ids": [10**7], "sampling_params": {"max_new_tokens": 1}},
        headers={**single.worker_headers("demo"), "x-request-id": f"{request_id}-direct"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_error", r.text
    rejected = eventually(lambda: worker_events(single, event="rejected", request_id=f"{request_id}-direct"))
    assert [e["code"] for e in rejected] == ["invalid_request_error"]
    # A tenant's call of an operator route, refused before anything reads its body
    r = httpx.post(
        f"{single.worker('server')}/flush_cache",
        headers={**single.worker_headers("demo"), "x-request-id": f"{request_id}-admin"},
        timeout=60,
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", r.text
    refused = eventually(lambda: worker_events(single, event="rejected", request_id=f"{request_id}-admin"))
    assert [(e["code"], e["endpoint"]) for e in refused] == [("permission_denied", "/flush_cache")]
    log = Path(next(p["log"] for p in single.info["processes"] if p["name"] == "server")).read_text()
    assert f"[{request_id}-direct]" in log and f"[{request_id}-admin]" in log  # the worker's own log lines


@pytest.mark.parametrize("name", ["single", "pd"])
def test_a_stream_is_counted_whether_or_not_its_client_asked_for_usage(single, pd, name):
    """The workers end every OpenAI stream with their usage figures; the gateway counts them into
    the tenant's usage and the audit record, and only a client that asked sees them."""
    run = {"single": single, "pd": pd}[name]
    key = run.client_headers("demo")["Authorization"].split()[1]
    client = openai.OpenAI(base_url=f"{run.url}/v1", api_key=key, max_retries=0)
    for asked in (False, True):
        request_id = f"usage-{name}-{asked}-{uuid.uuid4().hex[:6]}"
        chunks = list(
            client.chat.completions.create(
                model=run.info["model"],
                messages=[{"role": "user", "content": "count to ten"}],
                max_tokens=5,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
                **({"stream_options": {"include_usage": True}} if asked else {}),
                extra_headers={"x-request-id": request_id},
            )
        )
        with_usage = [c for c in chunks if c.usage is not None]
        if asked:
            assert len(with_usage) == 1 and with_usage[0].choices == [], chunks[-2:]
            assert with_usage[0].usage.completion_tokens == 5
        else:
            assert with_usage == [] and all(c.choices for c in chunks), chunks[-2:]
        assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
        record = eventually(lambda rid=request_id: audit_record(run, rid))
        assert record["completion_tokens"] == 5 and record["prompt_tokens"] > 0, record
