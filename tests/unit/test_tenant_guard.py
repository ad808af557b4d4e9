"""The worker's tenant guard and front door, without a server: who may call what, in which mode,
which namespace a request gets, who may abort and close what, and the order of the front door."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from glm53_serving import env, front_door, rejection, request_guard, tenant_guard, tenants
from glm53_serving.errors import ClientError
from glm53_serving.tenant_guard import Access

KEY = b"k" * 64


@pytest.fixture
def guard(monkeypatch, tmp_path):
    """A configured tenant guard; `guard(mode, key=True)` sets it up like a launched worker."""

    def configure(mode: str = "on", key: bool = True, **server_args):
        if key:
            path = tmp_path / f"key-{mode}"
            path.write_text(KEY.decode())
            monkeypatch.setenv(env.ASSERTION_KEY_FILE.name, str(path))
        else:
            monkeypatch.delenv(env.ASSERTION_KEY_FILE.name, raising=False)
        monkeypatch.setenv(env.TENANTS.name, mode)
        tenant_guard.configure(SimpleNamespace(**{"enable_response_store": False, **server_args}))
        if tenant_guard.problems():
            raise ValueError("; ".join(tenant_guard.problems()))

    monkeypatch.setattr(tenant_guard, "_problems", [])
    monkeypatch.setattr(tenant_guard, "_key", None)
    monkeypatch.setattr(tenant_guard, "_tenants_on", True)
    return configure


def bearer(tenant: str, key: bytes = KEY) -> str:
    return f"Bearer {tenants.mint(key, tenant)}"


def outcome(access: Access, path: str, header: str | None) -> str:
    try:
        p = tenant_guard.authorize(access, path, header)
    except ClientError as e:
        return e.code
    return "pass" if p is None else p.tenant


# --- start-up: a worker without its key refuses unless tenants are off explicitly ---------------


def test_a_worker_without_its_key_refuses_to_start_unless_tenants_are_off(guard):
    with pytest.raises(ValueError, match=f"{env.TENANTS.name}=off"):
        guard("on", key=False)
    guard("off", key=False)  # explicit: starts, one trust domain
    assert not tenant_guard.enforced()


def test_an_unknown_tenant_mode_is_refused(guard):
    with pytest.raises(ValueError, match="on .* or off"):
        guard("maybe")


def test_the_ownerless_response_store_is_refused_with_tenants(guard):
    with pytest.raises(ValueError, match="enable-response-store"):
        guard("on", enable_response_store=True)
    guard("off", enable_response_store=True)  # one trust domain: nobody else's responses to read


# --- who may call what ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["on", "off"])
def test_operator_routes_are_the_operators_in_every_mode(guard, mode):
    guard(mode)
    assert outcome(Access.ADMIN, "/flush_cache", None) == "invalid_api_key"
    assert outcome(Access.ADMIN, "/flush_cache", bearer("acme")) == "permission_denied"
    assert outcome(Access.ADMIN, "/flush_cache", bearer(tenants.ADMIN, b"x" * 64)) == "invalid_api_key"  # forged
    assert outcome(Access.ADMIN, "/flush_cache", bearer(tenants.ADMIN)) == tenants.ADMIN


def test_with_tenants_on_a_tenant_route_needs_a_verified_assertion(guard):
    guard("on")
    assert outcome(Access.TENANT, "/generate", None) == "invalid_api_key"
    assert outcome(Access.TENANT, "/generate", bearer("acme", b"x" * 64)) == "invalid_api_key"
    assert outcome(Access.TENANT, "/generate", bearer("acme")) == "acme"
    assert outcome(Access.OPEN, "/health", None) == "pass"


def test_with_tenants_off_tenant_routes_are_open_and_operator_routes_are_not(guard):
    guard("off", key=False)
    assert outcome(Access.TENANT, "/generate", None) == "pass"
    assert outcome(Access.ADMIN, "/flush_cache", None) == "invalid_api_key"  # no key: nobody is the operator


def test_the_internal_credential_opens_its_own_route_only(guard):
    guard("on")
    internal = tenant_guard.internal_header()
    assert outcome(Access.ADMIN, "/freeze_gc", internal) == tenant_guard.INTERNAL
    for access, path in (
        (Access.ADMIN, "/flush_cache"),
        (Access.TENANT, "/generate"),
        (Access.ADMIN, "/pause_generation"),
    ):
        assert outcome(access, path, internal) == "invalid_api_key", path
    assert outcome(Access.ADMIN, "/freeze_gc", "Bearer glm53-internal-guessed") == "invalid_api_key"


# --- namespaces, sessions and requests ----------------------------------------------------------


def _request(**fields):
    base = {"cache_salt": "chosen-by-client", "extra_key": "x", "session_id": None, "session_params": None, "rid": None}
    return SimpleNamespace(**{**base, **fields})


def test_a_tenant_gets_its_own_namespace_whatever_the_client_sent(guard):
    guard("on")
    token = tenant_guard._principal.set(tenants.Principal("acme"))
    try:
        obj = _request(rid="r1")
        tenant_guard.namespace_request(obj)
    finally:
        tenant_guard._principal.reset(token)
    assert obj.cache_salt == tenants.cache_salt(KEY, "acme") and obj.extra_key is None
    assert tenant_guard.REQUESTS.owner("r1") == "acme"


def test_with_tenants_off_the_client_cannot_pick_a_kv_owner(guard):
    guard("off")
    obj = _request()
    tenant_guard.namespace_request(obj)
    assert obj.cache_salt is None and obj.extra_key is None


def test_another_tenants_session_is_not_found(guard):
    guard("on")
    tenant_guard.SESSIONS.record("s-acme", "acme")
    token = tenant_guard._principal.set(tenants.Principal("beta"))
    try:
        with pytest.raises(ClientError) as e:
            tenant_guard.namespace_request(_request(session_id="s-acme"))
    finally:
        tenant_guard._principal.reset(token)
    assert e.value.code == "not_found" and e.value.param == "session_id"


def _abort(principal, *, in_request: bool, rid="r1", abort_all=False):
    calls = []
    token = tenant_guard._principal.set(principal)
    slot = rejection.open_slot("/abort_request")[1] if in_request else None
    try:
        tenant_guard.abort_request_hook(
            lambda self, rid, abort_all: calls.append((rid, abort_all)), None, rid, abort_all
        )
    finally:
        if slot is not None:
            rejection.close_slot(slot)
        tenant_guard._principal.reset(token)
    return calls


def test_aborts(guard):
    guard("on")
    tenant_guard.REQUESTS.record("r1", "acme")
    assert _abort(tenants.Principal("acme"), in_request=True) == [("r1", False)]
    assert _abort(tenants.Principal("beta"), in_request=True) == []  # not its own: nothing, silently
    with pytest.raises(ClientError, match="operator"):
        _abort(tenants.Principal("acme"), in_request=True, abort_all=True)
    assert _abort(tenants.Principal(tenants.ADMIN), in_request=True, abort_all=True) == [("r1", True)]
    assert _abort(None, in_request=False, abort_all=True) == [("r1", True)]  # SGLang's own (shutdown)


def test_with_tenants_off_abort_all_stays_the_operators(guard):
    guard("off")
    with pytest.raises(ClientError, match="operator"):
        _abort(None, in_request=True, abort_all=True)
    assert _abort(None, in_request=True) == [("r1", False)]


# --- the front door ----------------------------------------------------------------------------


class _Refuses:
    """Validation that refuses every body, to see whether a request got as far as validation."""

    def check(self, path, body):
        raise ClientError("invalid_request_error", "refused by validation", param="messages")


@pytest.fixture
def door(guard, monkeypatch):
    guard("on")
    monkeypatch.setenv(env.MAX_BODY_BYTES.name, "1000")
    monkeypatch.setattr(request_guard, "_prepared", _Refuses())
    app = Starlette(routes=[Route("/generate", lambda r: JSONResponse({"ok": True}), methods=["POST"])])
    front_door.install(app, SimpleNamespace(enable_response_store=False))
    return app


def test_the_front_door_is_the_declared_stack_outermost_first(door):
    assert [m.cls for m in door.user_middleware] == [layer.cls for layer in front_door.STACK]
    assert front_door.problems(door) == []
    door.user_middleware.reverse()
    assert front_door.problems(door)  # another order is refused at start-up


def test_authentication_comes_before_anything_reads_the_body(door):
    client = TestClient(door)
    body = json.dumps({"messages": "not even valid"})
    r = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # not the validator's 400
    r = client.post("/generate", content="x" * 5000)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # not the body limit's 413
    ok = {"Authorization": bearer("acme")}
    r = client.post("/generate", content=body, headers={**ok, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "refused by validation"
    r = client.post("/generate", content="x" * 5000, headers=ok)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_rejection_metrics_have_bounded_labels(door, monkeypatch):
    seen = []
    monkeypatch.setattr(rejection, "REJECTIONS", SimpleNamespace(inc=lambda amount=1, **labels: seen.append(labels)))
    client = TestClient(door)
    for i in range(3):
        client.post(f"/made-up-{i}", content=b"{}")
    ok = {"Authorization": bearer("acme"), "content-type": "application/json"}
    client.post("/generate", content=b"{}", headers=ok)
    assert seen == [{"reason": "invalid_api_key", "endpoint": "other"}] * 3 + [
        {"reason": "invalid_request_error", "endpoint": "/generate"}
    ]
