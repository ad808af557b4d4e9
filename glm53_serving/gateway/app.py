"""The gateway's ASGI app (Starlette on uvicorn with httptools, aiohttp's pooled client upstream).

aiohttp rather than httpx upstream: the streamed hop is the gateway's cost per token, and
profiled under load httpx's per-chunk path (httpcore over anyio) took about 40% of the
gateway's CPU; aiohttp parses in C (docs/performance.md)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Summary, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from glm53_serving import tenants, validation
from glm53_serving.admission import Limits, check
from glm53_serving.errors import CONTRACT, ClientError, code_from_message
from glm53_serving.gateway.tokens import PromptCounter, Uncountable
from glm53_serving.validation import RequestChecks

logger = logging.getLogger("glm53_serving.gateway")

GENERATION = ("/generate", "/v1/completions", "/v1/chat/completions")
# A tenant's own objects: forwarded with its assertion; the worker checks ownership (tenant_guard).
# (sglang-router does not route sessions: in PD these answer the router's 404.)
TENANT_OBJECTS = ("/open_session", "/close_session", "/abort_request")
AFFINITY_HEADER = "x-session-affinity"  # what agent clients send (the incident's provider asked for it)
ROUTING_KEY_HEADER = "x-smg-routing-key"  # what sglang-router's manual policy routes on
# Hop-by-hop and length headers are the transport's business; the client's credential and any
# routing key it names are replaced by ours.
_DROP_REQUEST_HEADERS = {
    "host",
    "content-length",
    "connection",
    "transfer-encoding",
    "accept-encoding",
    "authorization",
    AFFINITY_HEADER,
    ROUTING_KEY_HEADER,
}
UNAUTHENTICATED = "-"  # the tenant label of requests refused before a tenant was known
# Body fields only the deployment sets: the PD handoff (a fake or foreign bootstrap host makes
# decode read pages nothing wrote) and the data-parallel placement.
DEPLOYMENT_FIELDS = (
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "routed_dp_rank",
    "disagg_prefill_dp_rank",
)
_PASS_RESPONSE_HEADERS = {"content-type", "cache-control"}
# Prompts longer than this are encoded off the event loop: every stream through the gateway waits
# while the loop encodes (~2 µs a token here), and the tokenizer releases the GIL.
ENCODE_ON_LOOP_MAX_CHARS = 4096


@dataclass(slots=True)
class GatewayConfig:
    upstream: str  # the router (PD) or the single server
    model_path: str
    served_model_name: str
    context_length: int
    limits: Limits
    max_body_bytes: int = 8 * 1024 * 1024
    upstream_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    tenants: tenants.TenantsFile | None = None  # None: tenants off (one trust domain)
    assertion_key: bytes | None = None  # signs the tenant assertions workers verify
    max_n: int = validation.MAX_N  # validation.MAX_N_PD behind a PD router

    def __post_init__(self):
        assert self.upstream.startswith("http"), self.upstream
        assert (self.tenants is None) == (self.assertion_key is None), "tenants need the assertion key, and back"
        assert self.max_body_bytes > 0 and self.upstream_timeout_s > 0 and self.connect_timeout_s > 0


def error_response(status: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status)


def worker_error_inside(message) -> dict | None:
    """A worker's contract error body embedded in the router's rewritten PD error message (which
    turns, e.g., decode's 500 kv_isolation_violation into a 500 `decode_error`), or None."""
    if not isinstance(message, str):
        return None
    decoder = json.JSONDecoder()
    start = message.find("{")
    while start != -1:
        try:
            inner, _ = decoder.raw_decode(message, start)
        except json.JSONDecodeError:
            inner = None
        err = inner.get("error") if isinstance(inner, dict) else None
        if isinstance(err, dict) and err.get("code") in CONTRACT and isinstance(err.get("message"), str):
            return {"error": err}
        start = message.find("{", start + 1)
    return None


def routing_key(tenant: str, affinity: str) -> str:
    """The router's key for a client's session: scoped by tenant, so two tenants' ids never meet."""
    return hashlib.sha256(f"{tenant}\0{affinity}".encode()).hexdigest()[:32]


def prompt_param(endpoint: str, body: dict) -> str:
    return validation.prompt_param(endpoint, endpoint == validation.GENERATE and body.get("input_ids") is not None)


class Gateway:
    def __init__(self, cfg: GatewayConfig):
        self.cfg = cfg
        self.counter = PromptCounter(cfg.model_path)
        self.validator = RequestChecks.for_model(cfg.model_path, self.counter.tokenizer, cfg.max_n)
        self._session: aiohttp.ClientSession | None = None  # made on the server's loop (start())
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "glm53_gateway_requests",
            "Requests answered by the gateway",
            ["tenant", "endpoint", "status", "reason"],
            registry=self.registry,
        )
        # The gateway's own time before forwarding, and the upstream's share of each answer's
        # latency as the gateway sees it: the client's latency less the upstream's is what the
        # gateway adds (bench.serving prints it per round).
        self.upstream_timing = UpstreamTiming(
            Summary(
                "glm53_gateway_admission_seconds",
                "From the request's handler to sending it upstream: key, body, validation, prompt count",
                registry=self.registry,
            ),
            Summary(
                "glm53_gateway_upstream_first_chunk_seconds",
                "From sending a request upstream to its answer's first body chunk (2xx answers)",
                registry=self.registry,
            ),
            Summary(
                "glm53_gateway_upstream_response_seconds",
                "From sending a request upstream to its answer's last byte (2xx answers read to the end)",
                registry=self.registry,
            ),
        )
        self.assertions = tenants.AssertionCache(cfg.assertion_key) if cfg.assertion_key else None
        # Two threads: long prompts wait their turn rather than take every core from the workers.
        self._encoders = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="glm53-encode")

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.cfg.connect_timeout_s, sock_read=self.cfg.upstream_timeout_s
            ),
            # Idle upstream connections are dropped before the far end's keep-alive (uvicorn's
            # 5 s in SGLang) can close one under a request we are sending on it.
            connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=2.0),
            # The body and its content type are the client's, passed as they came.
            skip_auto_headers=("Content-Type", "Accept-Encoding", "User-Agent"),
        )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._encoders.shutdown(wait=False, cancel_futures=True)

    def authenticate(self, request: Request) -> str:
        """The request's tenant; ClientError(invalid_api_key) before anything is read or forwarded."""
        if self.cfg.tenants is None:
            return ""
        tenant = self.cfg.tenants.tenant_of(request.headers.get("authorization"))
        if tenant is None:
            raise ClientError("invalid_api_key", "Missing or unknown API key. Send 'Authorization: Bearer <key>'.")
        return tenant

    # --- body ---------------------------------------------------------------------------------

    async def read_body(self, request: Request) -> bytes:
        """The body, or ClientError(request_too_large) as soon as it passes the limit."""
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ClientError(
                "request_too_large",
                f"Request body is {declared} bytes; the limit is {limit}.",
                details={"max_body_bytes": limit},
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ClientError(
                    "request_too_large",
                    f"Request body exceeds the limit of {limit} bytes.",
                    details={"max_body_bytes": limit},
                )
            chunks.append(chunk)
        return b"".join(chunks)

    # --- handlers -----------------------------------------------------------------------------

    async def generation(self, request: Request) -> Response:
        return await self.admit_and_forward(request, self.judge_generation)

    async def tenant_object(self, request: Request) -> Response:
        return await self.admit_and_forward(request, None)

    async def admit_and_forward(self, request: Request, judge) -> Response:
        """Authenticate, read the body within the limit, let `judge` refuse it, then forward."""
        started = time.perf_counter()
        endpoint = request.scope["path"]
        tenant = UNAUTHENTICATED
        try:
            tenant = self.authenticate(request)
            raw = await self.read_body(request)
            if judge is not None:
                await judge(request, endpoint, raw)
        except ClientError as e:
            return self._answer(tenant, endpoint, e.status, e.body(), reason=e.code)
        except ClientDisconnect:
            return Response(status_code=499)
        return await self.forward(request, tenant, endpoint, raw, started)

    async def judge_generation(self, request: Request, endpoint: str, raw: bytes) -> None:
        # The workers' own validation, here first: behind the router a worker's 400 loses its
        # `param` (PD bodies are rewritten) and the router judges some fields by other bounds.
        body = validation.parse_body(raw, request.headers.get("content-type"))
        self.validator.check(endpoint, body)
        for name in DEPLOYMENT_FIELDS:
            if name in body:
                raise ClientError(
                    "invalid_request_error", f"{name} is set by the deployment, not by clients.", param=name
                )
        try:
            prompt, max_new = self.counter.prompt_of(endpoint, body)
        except Uncountable:
            return  # not ours to judge: the worker validates it with its own checks
        if isinstance(prompt, str):
            bound = self.counter.at_most(prompt)
            if bound is not None:
                try:
                    check(self.cfg.limits, bound, max_new, prompt_param=prompt_param(endpoint, body))
                    return  # fits even at one token a byte: no need to encode
                except ClientError:
                    pass  # the bound does not decide; the count does
            prompt = await self.encode(prompt)
        check(self.cfg.limits, prompt, max_new, prompt_param=prompt_param(endpoint, body))

    async def encode(self, text: str) -> int:
        if len(text) <= ENCODE_ON_LOOP_MAX_CHARS:
            return self.counter.encode(text)
        return await asyncio.get_running_loop().run_in_executor(self._encoders, self.counter.encode, text)

    def upstream_headers(self, request: Request, tenant: str) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST_HEADERS}
        if self.assertions is not None:
            headers["authorization"] = self.assertions.header(tenant)
        affinity = request.headers.get(AFFINITY_HEADER)
        if affinity:
            headers[ROUTING_KEY_HEADER] = routing_key(tenant, affinity)
        return headers

    async def forward(self, request: Request, tenant: str, endpoint: str, raw: bytes, started: float) -> Response:
        sent = time.perf_counter()
        self.upstream_timing.admission.observe(sent - started)
        try:
            upstream = await self._session.request(
                request.method,
                self.cfg.upstream + endpoint,
                headers=self.upstream_headers(request, tenant),
                data=raw,
                params=request.query_params.multi_items(),
            )
        except TimeoutError:
            return self._answer(
                tenant,
                endpoint,
                504,
                _server_error("The model server did not answer in time.", "upstream_timeout"),
                reason="upstream_timeout",
            )
        except aiohttp.ClientError as e:
            return self._answer(
                tenant,
                endpoint,
                502,
                _server_error(f"The model server is unreachable: {type(e).__name__}.", "upstream_unavailable"),
                reason="upstream_unavailable",
            )
        if upstream.status >= 400:
            return await self._honest_error(tenant, endpoint, upstream)
        self.requests.labels(tenant=tenant, endpoint=endpoint, status=str(upstream.status), reason="").inc()
        return UpstreamStream(upstream, sent, self.upstream_timing)

    async def _honest_error(self, tenant: str, endpoint: str, upstream: aiohttp.ClientResponse) -> Response:
        """Pass a valid OpenAI-shaped error through; anything else (the router's cut or rewritten
        PD bodies) becomes a valid JSON body with the upstream's status."""
        status = upstream.status
        try:
            raw = await upstream.read()
        except (TimeoutError, aiohttp.ClientError):
            raw = b""  # the status stands; the body below says the server's was lost
        finally:
            upstream.release()
        try:
            body = json.loads(raw)
            if isinstance(body, dict) and isinstance(body.get("error"), dict) and "message" in body["error"]:
                err = body["error"]
                restored = self._contract_error_in(tenant, endpoint, status, err["message"])
                if restored is not None:
                    return restored
                code = err.get("code") if isinstance(err.get("code"), str) else "upstream_error"
                # The contract's keys, whatever the router rewrote (PD: type "Bad Request", no param).
                body = {
                    "error": {
                        **err,
                        "message": str(err["message"]),
                        "param": err.get("param"),
                        "code": code,
                        "type": "invalid_request_error" if status < 500 else "server_error",
                    }
                }
                return self._answer(tenant, endpoint, status, body, reason=code)
        except (UnicodeDecodeError, json.JSONDecodeError):
            pass
        # Not JSON: the router's PD stream error, an SSE line wrapping the worker's body in a
        # Python repr, sometimes cut mid-JSON.
        text = raw.decode(errors="replace")
        restored = self._contract_error_in(tenant, endpoint, status, text)
        if restored is not None:
            return restored
        return self._answer(
            tenant,
            endpoint,
            status,
            {
                "error": {
                    "message": f"The model server answered {status}: {text[:500]}",
                    "type": "invalid_request_error" if status < 500 else "server_error",
                    "param": None,
                    "code": "upstream_error",
                }
            },
            reason="upstream_error",
        )

    def _contract_error_in(self, tenant: str, endpoint: str, status: int, text) -> JSONResponse | None:
        """The worker's own contract error inside a router-rewritten error text: its whole body,
        or, for a 5xx whose body the router cut or reduced to a message, a KV guard's message."""
        restored = worker_error_inside(text)
        if restored is not None:
            code = restored["error"]["code"]
            return self._answer(tenant, endpoint, CONTRACT[code][0], restored, reason=code)
        kv = code_from_message(text) if status >= 500 else None
        if kv is None:
            return None
        code, message = kv
        return self._answer(
            tenant,
            endpoint,
            CONTRACT[code][0],
            {"error": {"message": message, "type": CONTRACT[code][1], "param": None, "code": code}},
            reason=code,
        )

    def _answer(self, tenant: str, endpoint: str, status: int, body: dict, reason: str) -> JSONResponse:
        self.requests.labels(tenant=tenant, endpoint=endpoint, status=str(status), reason=reason).inc()
        return error_response(status, body)

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.cfg.served_model_name,
                        "object": "model",
                        "owned_by": "glm53_serving",
                        # exactly what is served: the largest prompt + output, the largest prompt
                        "max_model_len": self.cfg.limits.max_model_len,
                        "max_input_tokens": self.cfg.limits.max_prompt_tokens,
                    }
                ],
            }
        )

    async def health(self, request: Request) -> Response:
        try:
            async with self._session.get(self.cfg.upstream + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return Response(status_code=200 if r.status == 200 else 503)
        except (TimeoutError, aiohttp.ClientError):
            return Response(status_code=503)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")


def build_app(cfg: GatewayConfig) -> GatewayApp:
    gw = Gateway(cfg)
    routes = [Route(p, gw.generation, methods=["POST"]) for p in GENERATION]
    routes += [Route(p, gw.tenant_object, methods=["POST"]) for p in TENANT_OBJECTS]
    routes += [
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/metrics", gw.metrics, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await gw.start()
        yield
        await gw.stop()

    return GatewayApp(gw, Starlette(routes=routes, lifespan=lifespan))


class GatewayApp:
    """The ASGI app. Generation and tenant-object POSTs, the requests whose every chunk passes
    through, go straight to their handler; everything else (the other routes, 404, 405, the
    lifespan) through Starlette, whose routes list them all (the POST handlers are read from
    them). Not through Starlette's router and middleware for the streams: their two send wrappers
    and route matching were on every chunk and request, and their answer to an unexpected error
    is a text/plain 500; here it is the contract's JSON body."""

    def __init__(self, gateway: Gateway, starlette: Starlette):
        self.gateway, self.starlette = gateway, starlette
        self._posts = {r.path: r.endpoint for r in starlette.routes if "POST" in (r.methods or ())}

    async def __call__(self, scope, receive, send) -> None:
        handler = self._posts.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            return await self.starlette(scope, receive, send)
        try:
            response = await handler(Request(scope, receive))
        except Exception:
            logger.exception("gateway error on %s", scope["path"])
            response = self.gateway._answer(
                UNAUTHENTICATED,
                scope["path"],
                500,
                _server_error("The gateway failed on this request.", "internal_error"),
                reason="internal_error",
            )
        await response(scope, receive, send)  # a failure past the first byte closes the connection


@dataclass(slots=True)
class UpstreamTiming:
    admission: Summary
    first_chunk: Summary
    response: Summary


class UpstreamStream(Response):
    """The upstream's answer passed to the client chunk by chunk, as each arrives.

    Not Starlette's StreamingResponse: under uvicorn (ASGI spec 2.3) that runs every stream in an
    anyio task group beside a disconnect listener; this hop takes ~11% less CPU per request
    (docs/performance.md). Here one plain task waits for the disconnect; when the client goes, the
    upstream connection is closed, not pooled, which the router and the worker see as an abort."""

    def __init__(self, upstream: aiohttp.ClientResponse, sent: float, timing: UpstreamTiming):
        self.upstream, self.sent, self.timing = upstream, sent, timing
        self.status_code = upstream.status
        self.raw_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in upstream.headers.items()
            if k.lower() in _PASS_RESPONSE_HEADERS
        ]

    async def __call__(self, scope, receive, send) -> None:
        upstream, client_gone = self.upstream, asyncio.Event()

        async def close_on_disconnect():
            while (await receive())["type"] != "http.disconnect":
                pass  # the body was read before forwarding: nothing else can come
            client_gone.set()
            upstream.close()  # ends the read below

        watch = asyncio.create_task(close_on_disconnect())
        done = False
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            first = True
            async for chunk in upstream.content.iter_any():
                if first:
                    self.timing.first_chunk.observe(time.perf_counter() - self.sent)
                    first = False
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.timing.response.observe(time.perf_counter() - self.sent)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            done = True
        except aiohttp.ClientError:
            if not client_gone.is_set():
                raise  # the upstream failed mid-stream: the client's stream ends unterminated
        finally:
            watch.cancel()
            upstream.release() if done else upstream.close()


def _server_error(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
