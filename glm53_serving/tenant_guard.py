"""Worker side of tenancy: every route is classified, every request carries a verified principal,
and a tenant sees only its own namespace, sessions and requests.

Invariants:
- A request reaches a handler only if its route is OPEN (health, metrics, model listing) or it
  carries a valid assertion: TENANT routes take a tenant's or the admin's, ADMIN routes (every
  control endpoint, and any route this table does not know) only the admin's. Missing or invalid
  -> 401 invalid_api_key; a tenant on an admin route -> 403 permission_denied. Checked before
  anything reads the body (front_door.py).
- Tenants are on unless the launcher switched them off explicitly (GLM53_TENANTS=off); a worker
  without its deployment's assertion key refuses to start otherwise. Off: TENANT routes need no
  credential and every request shares one KV namespace; ADMIN routes stay the operator's.
- A generation request's prefix-cache namespace is set here from its tenant (keyed with the
  deployment's key); whatever `cache_salt`/`extra_key` the client sent is discarded. The KV owner
  tag (kv_owner) derives from the same namespace, so owner == tenant.
- Sessions and requests belong to the tenant that created them: another tenant gets 404 on a
  session (existence is not revealed) and its abort of a request it does not own does nothing.

Attacks closed: a client claiming another tenant's namespace with `cache_salt` (upstream takes
it from the body), continuing another tenant's session by id (upstream sessions have no owner),
calling /flush_cache, /update_weights_*, /pause_generation... on a worker's public port.
"""

from __future__ import annotations

import contextvars
import logging
import re
import secrets
from collections import OrderedDict
from enum import Enum

from glm53_serving import env, rejection, tenants
from glm53_serving.errors import ClientError
from glm53_serving.tenants import Principal

logger = logging.getLogger("glm53_serving")


class Access(str, Enum):
    OPEN = "open"  # no credential: probes and model listing
    TENANT = "tenant"  # a tenant's (or the admin's) assertion; acts within the tenant's namespace
    ADMIN = "admin"  # the operator's assertion only


# Every route SGLang 0.5.23 serves. tests/unit/test_tenant_guard.py fails if the app has a route
# this table does not classify, so an endpoint added upstream is reviewed before it is served
# (and until then it is ADMIN at run time: unknown routes fail closed).
ROUTES: dict[str, Access] = {
    **dict.fromkeys(
        (
            "/health",
            "/health_generate",
            "/ready",
            "/ping",
            "/metrics",
            "/",
            "/v1/models",
            "/v1/models/{model:path}",
            "/get_model_info",
            "/model_info",
            "/api/tags",
            "/openapi.json",
            "/docs",
            "/docs/oauth2-redirect",
            "/redoc",
        ),
        Access.OPEN,
    ),
    **dict.fromkeys(
        (
            # generation: every one goes through TokenizerManager._validate_one_request (intake.py),
            # where the tenant's namespace is imposed
            "/generate",
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/api/chat",
            "/api/generate",
            # tenant-owned objects: ownership checked by the hooks below
            "/open_session",
            "/close_session",
            "/abort_request",
            # stateless text utilities
            "/tokenize",
            "/v1/tokenize",
            "/detokenize",
            "/v1/detokenize",
            "/parse_function_call",
            "/separate_reasoning",
            "/api/show",
        ),
        Access.TENANT,
    ),
    **dict.fromkeys(
        (
            "/server_info",
            "/get_server_info",
            "/v1/loads",
            # the Responses API stores responses by id with no owner (and upstream's store is also
            # refused at start-up with tenants): operators only until ownership exists
            "/v1/responses",
            "/v1/responses/{response_id}",
            "/v1/responses/{response_id}/cancel",
            # non-generation model calls: not reviewed for namespaces; operators only
            "/encode",
            "/classify",
            "/v1/embeddings",
            "/v1/classify",
            "/v1/score",
            "/v1/decisions",
            "/v1/rerank",
            "/v1/audio/transcriptions",
            "/v1/realtime",
            "/v1/systemone",
            "/invocations",
            "/vertex_generate",
            # control plane
            "/set_internal_state",
            "/flush_cache",
            "/add_external_corpus",
            "/remove_external_corpus",
            "/list_external_corpora",
            "/hicache/storage-backend/clear",
            "/hicache/storage-backend",
            "/get_hicache_l3_cache_layout",
            "/start_profile",
            "/stop_profile",
            "/set_trace_level",
            "/freeze_gc",
            "/start_expert_distribution_record",
            "/stop_expert_distribution_record",
            "/dump_expert_distribution_record",
            "/update_weights_from_disk",
            "/init_weights_send_group_for_remote_instance",
            "/send_weights_to_remote_instance",
            "/get_remote_instance_transfer_engine_info",
            "/remote_instance_transfer_engine_info",
            "/init_weights_update_group",
            "/destroy_weights_update_group",
            "/update_weights_from_tensor",
            "/begin_weight_update",
            "/end_weight_update",
            "/update_weights_from_distributed",
            "/update_weights_from_ipc",
            "/update_weight_version",
            "/get_weights_by_name",
            "/release_memory_occupation",
            "/resume_memory_occupation",
            "/weights_checker",
            "/slow_down",
            "/pd_role_switch",
            "/load_lora_adapter",
            "/load_lora_adapter_from_tensors",
            "/unload_lora_adapter",
            "/configure_logging",
            "/pause_generation",
            "/continue_generation",
            "/scale_elastic_ep",
            "/is_scaling_elastic_ep",
        ),
        Access.ADMIN,
    ),
}
_TEMPLATED = [
    (re.compile("^" + re.sub(r"\{[^}:]+(:path)?\}", lambda m: ".+" if m.group(1) else "[^/]+", p) + "$"), a)
    for p, a in ROUTES.items()
    if "{" in p
]


def access_of(path: str) -> Access:
    if path in ROUTES:
        return ROUTES[path]
    if path.startswith("/metrics"):  # SGLang mounts its Prometheus app at run time
        return Access.OPEN
    return next((a for rx, a in _TEMPLATED if rx.match(path)), Access.ADMIN)


INTERNAL = tenants.INTERNAL  # the server's own calls: /health_generate's namespace, the internal credential

_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("glm53_principal", default=None)
_key: bytes | None = None  # the deployment's assertion key; None only when tenants are off explicitly
_tenants_on = True  # False: GLM53_TENANTS=off, one trust domain (the operator's routes stay the operator's)

# The server's own calls to its own HTTP endpoints. SGLang posts /freeze_gc to itself after
# warm-up (http_server._freeze_gc_after_server_warmup) so that the scheduler and detokenizer
# freeze their start-up heaps too; with tenants that call was refused (401) and no worker heap was
# ever frozen. Our replacement (freeze_gc_after_warmup) sends a credential that exists only in
# this process's memory, random per process, accepted on these routes only.
INTERNAL_ROUTES = frozenset({"/freeze_gc"})
_INTERNAL_TOKEN = "glm53-internal-" + secrets.token_urlsafe(32)
_INTERNAL = Principal(INTERNAL)


def enforced() -> bool:
    """Tenants are enforced on this worker (every TENANT route needs a verified assertion)."""
    return _tenants_on


def current() -> Principal | None:
    return _principal.get()


def internal_header() -> str:
    return f"Bearer {_INTERNAL_TOKEN}"


def authorize(access: Access, path: str, authorization: str | None) -> Principal | None:
    """Who may call `path` with this `Authorization` header: the principal (None: no credential
    needed and none given), or a ClientError (401 / 403) to send instead of the handler's answer."""
    if access is Access.OPEN:
        return None
    if authorization == internal_header() and path in INTERNAL_ROUTES:
        return _INTERNAL
    principal = tenants.verify(_key, authorization) if _key is not None else None
    if access is Access.ADMIN:
        if principal is None:
            raise ClientError(
                "invalid_api_key",
                f"{path} is an operator endpoint: send an operator assertion "
                "(python -m glm53_serving.tenants admin-token KEYFILE).",
            )
        if not principal.is_admin:
            raise ClientError("permission_denied", f"{path} is an operator endpoint.")
        return principal
    if principal is None and _tenants_on:
        raise ClientError(
            "invalid_api_key",
            "This worker serves only requests forwarded by its deployment's gateway (missing or invalid tenant "
            "assertion).",
        )
    return principal


class TenantGuardMiddleware:
    """Authentication, before anything reads the body (front_door.py puts it right inside the
    contract-errors layer)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        try:
            principal = authorize(access_of(path), path, header)
        except ClientError as error:
            rejection.count(error, path, request_id=rejection.request_id_of(scope))
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await rejection.send_error(send, error)
        token = _principal.set(principal)
        try:
            await self.app(scope, receive, send)
        finally:
            _principal.reset(token)


_problems: list[str] = []


def problems() -> list[str]:
    """Why this worker's tenant guard cannot protect it (the start-up handshake refuses on any)."""
    return list(_problems)


def configure(server_args) -> None:
    """The front door calls it before installing the stack: the deployment's key and tenant mode.
    A worker without its key refuses to start (startup.py, through problems()) unless tenants were
    switched off explicitly; until then it answers every tenant route 401 (fail closed)."""
    global _key, _tenants_on
    _problems.clear()
    try:
        _configure(server_args)
    except (OSError, ValueError) as e:
        _problems.append(str(e))


def _configure(server_args) -> None:
    global _key, _tenants_on
    mode = env.TENANTS.get()
    if mode not in ("on", "off"):
        raise ValueError(f"{env.TENANTS.name}={mode!r}: on (the default) or off")
    _tenants_on = mode == "on"
    _key = tenants.load_assertion_key()
    if _key is None and _tenants_on:
        raise ValueError(
            f"no assertion key ({env.ASSERTION_KEY_FILE.name} is not set): a worker without its deployment's key "
            f"cannot tell tenants apart. Start it through the launcher, or set {env.TENANTS.name}=off for a "
            "single-trust-domain server (its operator routes then answer nobody)"
        )
    if not _tenants_on:
        logger.warning(
            "glm53_serving: tenants are OFF on this worker (%s=off): every client shares one KV namespace; "
            "operator routes %s",
            env.TENANTS.name,
            "take an operator assertion" if _key is not None else "answer nobody (no assertion key)",
        )
    elif getattr(server_args, "enable_response_store", False):
        raise ValueError(
            "--enable-response-store is refused with tenants: stored responses have no owner upstream "
            "(any tenant could read another's by id)"
        )


def freeze_gc_after_warmup(server_args, *args, **kwargs):
    """REPLACE http_server._freeze_gc_after_server_warmup: the same call to this server's own
    /freeze_gc, with the in-process internal credential instead of an API key. With
    --skip-server-warmup it runs before uvicorn listens (upstream's call then fails with
    'connection refused'), so it waits for the listener first."""
    import time

    import requests
    from sglang.srt.entrypoints.http_server import ssl_verify_of

    deadline = time.monotonic() + FREEZE_WAIT_S
    while True:
        try:
            r = requests.post(
                server_args.url() + "/freeze_gc",
                headers={"Authorization": internal_header()},
                timeout=10,
                verify=ssl_verify_of(server_args),
            )
            r.raise_for_status()
            break
        except requests.exceptions.ConnectionError as e:
            if time.monotonic() > deadline:
                logger.warning("glm53_serving: post-warm-up freeze_gc failed: %s", e)
                return None
            time.sleep(0.2)
        except requests.exceptions.RequestException as e:
            logger.warning("glm53_serving: post-warm-up freeze_gc failed: %s", e)
            return None
    logger.info("glm53_serving: froze the start-up heap of every process of this server (internal /freeze_gc)")
    return None


FREEZE_WAIT_S = 120.0


# --- what a tenant may touch --------------------------------------------------------------


class _Owners:
    """id -> tenant for ids tenants create (sessions, request ids); bounded, oldest forgotten
    first (a forgotten id is owned by nobody: fail closed)."""

    def __init__(self, limit: int):
        self.limit, self._d = limit, OrderedDict()

    def record(self, id_: str, tenant: str) -> None:
        self._d[id_] = tenant
        self._d.move_to_end(id_)
        while len(self._d) > self.limit:
            self._d.popitem(last=False)

    def owner(self, id_) -> str | None:
        return self._d.get(id_)

    def forget(self, id_) -> None:
        self._d.pop(id_, None)


SESSIONS = _Owners(100_000)
REQUESTS = _Owners(200_000)


def _session_not_found(session_id) -> ClientError:
    return ClientError("not_found", f"No session {session_id!r}.", param="session_id")


def session_of(obj) -> str | None:
    """The session a generation request continues: `session_id`, or `session_params["id"]`."""
    session = getattr(obj, "session_id", None)
    if session is None and isinstance(getattr(obj, "session_params", None), dict):
        session = obj.session_params.get("id")
    return session


def namespace_request(obj) -> None:
    """In intake, for every generation request: impose the tenant's namespace, check its session.
    With tenants off, one namespace for everyone: the client's cache_salt never picks a KV owner."""
    obj.extra_key = None
    if not _tenants_on:
        obj.cache_salt = None
        return
    p = current()
    tenant = p.tenant if p is not None else INTERNAL
    obj.cache_salt = tenants.cache_salt(_key, tenant)
    session = session_of(obj)
    if session is not None and not (p is not None and (p.is_admin or SESSIONS.owner(session) == tenant)):
        raise _session_not_found(session)
    if getattr(obj, "rid", None) is not None and isinstance(obj.rid, str):
        REQUESTS.record(obj.rid, tenant)


async def open_session_hook(original, self, obj, request=None):
    """AROUND TokenizerManager.open_session: the opener's tenant owns the session."""
    session_id = await original(self, obj, request)
    p = current()
    if session_id is not None and _tenants_on and p is not None:
        SESSIONS.record(session_id, p.tenant)
    return session_id


def close_session_hook(self, obj, request=None):
    """BEFORE TokenizerManager.close_session."""
    p = current()
    if not _tenants_on or p is None or p.is_admin:
        return None
    if SESSIONS.owner(obj.session_id) != p.tenant:
        error = _session_not_found(obj.session_id)
        rejection.reject(error)
        raise error
    SESSIONS.forget(obj.session_id)
    return None


def abort_request_hook(original, self, rid: str = "", abort_all: bool = False):
    """AROUND TokenizerManager.abort_request: a tenant aborts only its own requests; abort_all is
    the operator's, whatever the tenant mode. Called outside any HTTP request, it is SGLang's own
    (shutdown, its watchdogs); inside one, the caller is whoever the tenant guard let in."""
    p = current()
    if (p is not None and p.is_admin) or (p is None and rejection.current_slot() is None):
        return original(self, rid=rid, abort_all=abort_all)
    if abort_all:
        error = ClientError(
            "permission_denied", "abort_all is an operator action; abort your requests by rid.", param="abort_all"
        )
        rejection.reject(error)
        raise error
    if _tenants_on and (p is None or REQUESTS.owner(rid) != p.tenant):
        logger.info("glm53_serving: %s tried to abort request %s it does not own; ignored", p and p.tenant, rid)
        return None  # as for an unknown rid: existence is not revealed
    return original(self, rid=rid, abort_all=abort_all)
