"""Every worker's HTTP front door: its ASGI middleware stack, declared once, outermost first.

Invariant: on every SGLang server with the guards on, a request passes these layers in this order
before any of SGLang's own code sees it, and the server refuses to start unless exactly this stack
is installed (startup.py asks `problems()`):

1. contract errors  every 4xx on a generation endpoint, and every 413, leaves in the contract's
                    JSON shape, whoever produced it (outermost, so it also covers the layers below)
2. tenant           who is asking, before anything reads the body: 401 / 403 for a missing,
                    forged or foreign credential; operator routes are the operator's
3. body limit       413 before reading past the configured size
4. hard reject      the request's slot: a rejection any guard below records (intake, the session
                    hooks, a KV abort) replaces whatever SGLang began, before any byte of a 200
5. validation       a generation request reaches SGLang's handler only valid
then SGLang's app (and the middlewares SGLang adds itself, inside ours).

Attack closed: an unauthenticated caller reaching a worker (which may be reached without the
gateway) got field-level 400s, the parser's work and its error messages before its credential
was checked; and the order of these layers was the accident of two hooks at two moments.

Wiring: `install_hook` (BEFORE http_server.launch_server: the app must take its middlewares
before uvicorn starts, and the start-up handshake, which runs before the HTTP server is set up,
checks them); `warm_hook` (BEFORE _setup_and_run_http_server, where the tokenizer manager
exists) builds and warms the validator's checks before the server reports ready.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.middleware.body_limit import RequestBodyLimitMiddleware

from glm53_serving import http_guard, rejection, request_guard, server_flags, tenant_guard


@dataclass(frozen=True, slots=True)
class Layer:
    name: str
    cls: type
    why: str
    kwargs: Callable[[], dict[str, Any]] = dict  # read when the stack is installed


STACK: tuple[Layer, ...] = (
    Layer("contract errors", request_guard.ContractErrors, "every 4xx and 413 in the contract shape"),
    Layer("tenant", tenant_guard.TenantGuardMiddleware, "authenticate before anything reads the body"),
    Layer(
        "body limit",
        RequestBodyLimitMiddleware,
        "413 before reading past the limit",
        lambda: {"max_body_size": request_guard.max_body_bytes()},
    ),
    Layer("hard reject", http_guard.HardRejectMiddleware, "a recorded rejection replaces any 200"),
    Layer("validation", request_guard.RequestValidator, "only valid generation requests reach SGLang"),
)


def _ours(app) -> list[type]:
    classes = {layer.cls for layer in STACK}
    return [m.cls for m in app.user_middleware if m.cls in classes]


def install(app, server_args) -> None:
    """Configure the tenant guard and add the stack to `app` (once)."""
    tenant_guard.configure(server_args)
    if _ours(app):
        return
    for layer in reversed(STACK):  # add_middleware puts each new one outermost
        app.add_middleware(layer.cls, **layer.kwargs())
    rejection.know_endpoints([*tenant_guard.ROUTES, *(getattr(r, "path", None) for r in app.routes)])


def problems(app=None) -> list[str]:
    """Why this server's front door is not the declared stack (empty: it is)."""
    if app is None:
        from sglang.srt.entrypoints.http_server import app
    found, want = _ours(app), [layer.cls for layer in STACK]
    out = tenant_guard.problems()
    if found != want:
        out.append(
            "the HTTP front door is not the declared stack: found "
            f"{[c.__name__ for c in found]}, expected {[c.__name__ for c in want]} (outermost first)"
        )
    return out


def install_hook(*args, **kwargs):
    """BEFORE http_server.launch_server(server_args): refuse uncovered flags before anything starts
    (HiCache crashes on CPU before any scheduler could refuse, and on a GPU weights would load
    first), then install the stack."""
    from sglang.srt.entrypoints.http_server import app

    server_args = kwargs.get("server_args", args[0] if args else None)
    server_flags.refuse(server_args, "http/tokenizer")
    install(app, server_args)
    return None


def warm_hook(server_args=None, tokenizer_manager=None, *args, **kwargs):
    """BEFORE http_server._setup_and_run_http_server: the validator's checks, built and warmed."""
    if tokenizer_manager is not None:
        request_guard.prepare(tokenizer_manager)
    return None
