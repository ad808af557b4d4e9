"""The suite's side of a deployment: what it knows of one (Target), a call as a client makes it
(send), the guards' view of the KV pools (kv_states), and a call's solo run (solo). Shared by the
interleavings (__main__.py) and the faults (faults.py)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from glm53_serving import tenants
from glm53_serving.suite.oracles import Outcome
from glm53_serving.suite.workload import Call


@dataclass
class Target:
    """A deployment the suite talks to: its client URL, each tenant's key, its workers."""

    name: str
    url: str
    keys: dict[str, str]
    workers: dict[str, str]
    operator: tuple[bytes, str | None] | None  # (assertion key, deployment) for the workers
    canary_log: Path | None = None
    fault_log: Path | None = None
    proc: object = None
    run_dir: Path | None = None  # the launcher's (ready.json, restarts.jsonl): faults need it
    seen: dict[Path, int] = field(default_factory=dict)

    @property
    def tenants(self) -> list[str]:
        return sorted(self.keys)

    @property
    def admin(self) -> dict[str, str]:
        """A fresh operator assertion for each request: they live minutes, a thorough run an hour."""
        if self.operator is None:
            return {}
        key, deployment = self.operator
        return {"Authorization": f"Bearer {tenants.mint(key, 'admin', deployment=deployment)}"}

    def new_events(self, path: Path | None) -> list[dict]:
        if path is None or not path.exists():
            return []
        text = path.read_text()
        start_at, self.seen[path] = self.seen.get(path, 0), len(text)
        return [json.loads(line) for line in text[start_at:].splitlines() if line.strip()]


def kv_states(target: Target) -> dict[str, dict]:
    out = {}
    for name, url in target.workers.items():
        info = httpx.get(f"{url}/server_info", headers=target.admin, timeout=30).json()
        (out[name],) = [s["glm53_kv"] for s in info["internal_states"]]
    return out


def solo(target: Target, call: Call, rid: str, timeout: float, cache: dict) -> list[int] | None:
    """`call`'s output served alone, not streamed (its solo run), from `cache` (solo_key ->
    output ids) or sent as `rid` and kept; None when it was not a 200."""
    if call.solo_key not in cache:
        alone = send(target, Call(call.tenant, call.prompt, call.max_new, False), rid, timeout)
        if alone.status != 200:
            return None
        cache[call.solo_key] = alone.output_ids
    return cache[call.solo_key]


def send(target: Target, call: Call, rid: str, timeout: float, read_delay: float = 0.0) -> Outcome:
    """One call as a client makes it; `read_delay`: a slow client, that long before each line it
    reads. A stream cut short at the transport is a 200 with code "stream_broken" (the client
    can tell: the chunked body never ended); one that ends cleanly without SGLang's [DONE] and
    without an error event, "stream_unterminated" (a client cannot tell it from success)."""
    if call.then:
        return _send_session(target, call, rid, timeout)
    return _send(target, call, rid, timeout, read_delay)


def _send_session(target: Target, call: Call, rid: str, timeout: float) -> Outcome:
    """A session continuation: open a session, turn 1, turn 2 continuing it, close it. The
    outcome is turn 2's, judged as `call.continued(turn 1's output)`; the canary reads both."""
    headers = {"Authorization": f"Bearer {target.keys[call.tenant]}"}
    t0, first = time.monotonic(), call.first_turn()
    r = httpx.post(
        f"{target.url}/open_session", json={"capacity_of_str_len": 1 << 16}, headers=headers, timeout=timeout
    )
    if r.status_code != 200:
        return Outcome(r.status_code, _code(r.text), None, r.text, _since(t0), False, effective=first)
    sid = r.json()
    try:
        one = _send(target, first, f"{rid}t1", timeout, session={"id": sid})
        if one.status != 200 or one.code is not None:
            return dataclasses.replace(one, effective=first)
        two = _send(target, call, rid, timeout, session={"id": sid, "rid": f"{rid}t1"})
        return dataclasses.replace(
            two, body=f"{one.body}\n{two.body}", effective=call.continued(one.output_ids), seconds=_since(t0)
        )
    finally:
        httpx.post(f"{target.url}/close_session", json={"session_id": sid}, headers=headers, timeout=timeout)


def _send(
    target: Target, call: Call, rid: str, timeout: float, read_delay: float = 0.0, session: dict | None = None
) -> Outcome:
    body = {
        "rid": rid,
        "input_ids": list(call.then or call.prompt),
        "stream": call.stream,
        "sampling_params": {"max_new_tokens": call.max_new, "temperature": 0, "ignore_eos": True},
    }
    if session is not None:
        body["session_params"] = session
    headers = {"Authorization": f"Bearer {target.keys[call.tenant]}"}
    t0, status, lines = time.monotonic(), None, []
    try:
        if not call.stream:
            r = httpx.post(f"{target.url}/generate", json=body, headers=headers, timeout=timeout)
            ok = r.status_code == 200
            finish = _finish(r.json()) if ok else None
            return Outcome(
                r.status_code, _code(r.text), r.json()["output_ids"] if ok else None, r.text, _since(t0), False, finish
            )
        # Leaving before the first token: a read timeout far shorter than a forward pass.
        read = 0.02 if call.disconnect == "before_first" else timeout
        with httpx.stream(
            "POST", f"{target.url}/generate", json=body, headers=headers, timeout=httpx.Timeout(timeout, read=read)
        ) as r:
            status = r.status_code
            if r.status_code != 200:
                text = r.read().decode(errors="replace")
                return Outcome(r.status_code, _code(text), None, text, _since(t0), False)
            last, done, aborted = None, False, not call.abort
            for line in r.iter_lines():
                lines.append(line)
                if read_delay:
                    time.sleep(read_delay)
                data = line.removeprefix("data:").strip() if line.startswith("data:") else None
                done = done or data == "[DONE]"
                if not data or data == "[DONE]":
                    continue
                last = json.loads(data)
                if call.disconnect == "mid":
                    return Outcome(200, None, None, "\n".join(lines), _since(t0), True)
                if not aborted:  # the tenant aborts its own request, by rid, through the client URL
                    aborted = True
                    a = httpx.post(f"{target.url}/abort_request", json={"rid": rid}, headers=headers, timeout=timeout)
                    lines.append(f"abort_request: {a.status_code} {a.text}")
            text = "\n".join(lines)
            code = (last or {}).get("error", {}).get("code") if isinstance(last, dict) else None
            if code is None and not done:
                code = "stream_unterminated"
            finish = _finish(last) if isinstance(last, dict) else None
            return Outcome(200, code, (last or {}).get("output_ids"), text, _since(t0), False, finish)
    except httpx.TimeoutException:
        if call.disconnect == "before_first":
            return Outcome(None, None, None, "", _since(t0), True)
        return Outcome(status, "client_timeout", None, "\n".join(lines), _since(t0), False)
    except httpx.TransportError as e:  # the connection broke: before an answer, or mid-stream
        code = "stream_broken" if status == 200 else "transport_error"
        return Outcome(status, code, None, "\n".join(lines) or str(e), _since(t0), False)


def _finish(answer: dict) -> str | None:
    reason = (answer.get("meta_info") or {}).get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else None


def _since(t0: float) -> float:
    return time.monotonic() - t0


def _code(text: str) -> str | None:
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return None
    return err.get("code") if isinstance(err, dict) else None
