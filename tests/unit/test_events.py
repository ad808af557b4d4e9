"""The workers' event log (events.py) and the request id a worker serves a request under."""

import json
import os

from sglang.srt.managers.io_struct import GenerateReqInput
from starlette.requests import Request

from glm53_serving import events, intake


def read(directory):
    return list(events.read(directory))


def test_nothing_is_written_without_the_launchers_path(tmp_path, monkeypatch):
    monkeypatch.delenv("GLM53_EVENTS_LOG", raising=False)
    events.record("admitted", rid="r1")
    assert list(tmp_path.iterdir()) == []


def test_each_process_writes_its_own_file_with_the_workers_name(tmp_path, monkeypatch):
    monkeypatch.setenv("GLM53_EVENTS_LOG", str(tmp_path / "events" / "decode-0"))
    events.record("admitted", rid="t.1", request_id="t.1", tenant="acme")
    pid = os.fork()
    if pid == 0:  # a scheduler process: its own writer, its own file
        events.record("kv_handoff_mismatch", rid="t.1", carried=3, expected=4)
        events.close()
        os._exit(0)
    os.waitpid(pid, 0)
    events.close()
    files = sorted(p.name for p in (tmp_path / "events").iterdir())
    assert files == sorted([f"decode-0.{os.getpid()}.jsonl", f"decode-0.{pid}.jsonl"])
    seen = {e["event"]: e for e in read(tmp_path / "events")}
    assert seen["admitted"]["worker"] == "decode-0" and seen["admitted"]["tenant"] == "acme"
    assert seen["kv_handoff_mismatch"]["pid"] == pid and seen["kv_handoff_mismatch"]["expected"] == 4
    assert all(e["ts"].endswith("Z") for e in seen.values())
    json.dumps(seen)  # plain JSON


def request(headers: dict) -> Request:
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/generate", "headers": raw})


def test_a_request_without_its_own_rid_is_served_under_its_request_id():
    obj = GenerateReqInput(text="hi")
    intake.take_request_id_hook(None, obj, request({"x-request-id": "req-7.3f9a0c1d2e4b"}))
    assert obj.rid == "req-7.3f9a0c1d2e4b"
    obj.normalize_batch_and_arguments()  # SGLang keeps it
    assert obj.rid == "req-7.3f9a0c1d2e4b"
    batch = GenerateReqInput(text=["a", "b"])
    intake.take_request_id_hook(None, batch, request({"x-request-id": "req-8.00"}))
    batch.normalize_batch_and_arguments()
    assert batch.rid == ["req-8.00_0", "req-8.00_1"]  # audit._trace_of undoes the suffix


def test_a_body_rid_an_odd_header_or_no_request_leave_the_rid_alone():
    own = GenerateReqInput(text="hi", rid="mine")
    intake.take_request_id_hook(None, own, request({"x-request-id": "req-7"}))
    assert own.rid == "mine"
    for headers in ({"x-request-id": "two words"}, {"x-request-id": "x" * 200}, {}):
        obj = GenerateReqInput(text="hi")
        intake.take_request_id_hook(None, obj, request(headers))
        assert obj.rid is None
    obj = GenerateReqInput(text="hi")
    intake.take_request_id_hook(None, obj, None)  # the server's own warm-up and health requests
    assert obj.rid is None
