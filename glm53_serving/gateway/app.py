"""The gateway's ASGI app (Starlette on uvicorn with httptools, aiohttp's pooled client upstream).

aiohttp rather than httpx upstream: the streamed hop is the gateway's cost per token, and
profiled under load httpx's per-chunk path (httpcore over anyio) took about 40% of the
gateway's CPU; aiohttp parses in C (docs/performance.md)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import signal
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Summary, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from glm53_serving import request_ids, tenants, validation
from glm53_serving.admission import Limits, check
from glm53_serving.audit import AuditLog
from glm53_serving.errors import ClientError, error_body
from glm53_serving.gateway import upstream_errors, usage
from glm53_serving.gateway.fair_share import FairShare
from glm53_serving.gateway.tokens import PromptCounter, Uncountable
from glm53_serving.tenants import TenantLimits
from glm53_serving.validation import RequestChecks

logger = logging.getLogger("glm53_serving.gateway")

GENERATION = validation.GENERATION
# A tenant's own objects: forwarded with its assertion; the worker checks ownership (tenant_guard).
# (sglang-router does not route sessions: in PD these answer the router's 404.)
TENANT_OBJECTS = ("/open_session", "/close_session", "/abort_request")
REQUEST_ID_HEADER = request_ids.HEADER  # the client's if sane, else ours; on every answer (request_ids.py)
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
    "x-request-id",
}
# SGLang 0.5.23 sets rid, the PD handoff fields, the DP rank and the priority from these headers
# (entrypoints/request_headers.py, where SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES is on): the
# DEPLOYMENT_FIELDS by another door. Never a client's.
_DEPLOYMENT_HEADER_PREFIX = "x-override-"
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
# /ready: how recent a successful generation must be (else the gateway probes with one token).
READY_FRESH_S = 10.0
# How often the gateway looks at the tenants file (one stat): a retired key is refused within this.
TENANTS_POLL_S = 1.0
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
    max_body_bytes: int  # the deployment's ([gateway] in the topology file, its one default)
    upstream_timeout_s: float
    connect_timeout_s: float = 5.0
    # None: tenants off (one trust domain). LiveTenants: the file, reloaded when it changes.
    tenants: tenants.TenantsFile | tenants.LiveTenants | None = None
    assertion_key: bytes | None = None  # signs the tenant assertions workers verify
    max_n: int = validation.MAX_N  # validation.MAX_N_PD behind a PD router
    # The operator's listener (metrics): a port of its own, never the client port. None: no metrics.
    operator_port: int | None = None
    # One JSON line per request (gateway/audit.py); None: no audit log.
    audit_log: str | None = None
    # Every tenant's fair share unless its own `limits` in the tenants file say otherwise.
    tenant_limits: TenantLimits = TenantLimits()

    def __post_init__(self):
        # Not `assert`: a gateway without its tenants would serve everyone (python -O drops asserts).
        for ok, message in (
            (
                self.upstream.startswith(("http://", "https://")),
                f"upstream must be an http(s) URL, not {self.upstream!r}",
            ),
            ((self.tenants is None) == (self.assertion_key is None), "tenants need the assertion key, and back"),
            (self.max_body_bytes > 0, f"max_body_bytes must be positive, not {self.max_body_bytes}"),
            (self.upstream_timeout_s > 0 and self.connect_timeout_s > 0, "timeouts must be positive"),
        ):
            if not ok:
                raise ValueError(f"gateway: {message}")


@dataclass(slots=True, frozen=True)
class Judged:
    """What judging a request (Gateway.judge_generation) tells the rest of its path."""

    prompt_tokens: int | None = None  # for the tenant's fair share; None where not counted
    hide_usage: bool = False  # an OpenAI stream whose client did not ask for usage (usage.py)


def error_response(status: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status)


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
        self.tokens = Counter(
            "glm53_gateway_tokens",
            "Tokens per tenant, from the workers' own usage figures: prompt, cached (of the prompt), completion",
            ["tenant", "kind"],
            registry=self.registry,
        )
        self.tenants_reloads = Counter(
            "glm53_gateway_tenants_reloads",
            "Reloads of the tenants file: ok (in force) or error (the previous file stays in force)",
            ["result"],
            registry=self.registry,
        )
        self._watch: asyncio.Task | None = None
        self.fair = FairShare(cfg.tenant_limits, self._tenant_limits)
        self.audit = AuditLog(cfg.audit_log) if cfg.audit_log else None
        self._served_at = float("-inf")  # monotonic time of the last 2xx generation answer (readiness)
        self._probe_lock = asyncio.Lock()
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
        if isinstance(self.cfg.tenants, tenants.LiveTenants):
            self._watch = asyncio.create_task(self._watch_tenants())
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload_tenants, True)

    async def _watch_tenants(self) -> None:
        while True:
            await asyncio.sleep(TENANTS_POLL_S)
            self.reload_tenants()

    def reload_tenants(self, force: bool = False) -> None:
        """A changed tenants file takes effect for requests that start after it (running streams
        were authenticated when they began); a bad one never replaces the good one."""
        result = self.cfg.tenants.reload(force)
        if result is not None:
            self.tenants_reloads.labels(result=result).inc()

    async def stop(self) -> None:
        if self.audit is not None:
            self.audit.close()
        if self._watch is not None:
            self._watch.cancel()
        if self._session is not None:
            await self._session.close()
        self._encoders.shutdown(wait=False, cancel_futures=True)

    def authenticate(self, request: Request) -> str:
        """The request's tenant; ClientError(invalid_api_key) before anything is read or forwarded."""
        return self.identify(request)[0]

    def identify(self, request: Request) -> tuple[str, str | None]:
        """(tenant, key id) of the request; ClientError(invalid_api_key) when there is none."""
        if self.cfg.tenants is None:
            return "", None
        who = self.cfg.tenants.identify(request.headers.get("authorization"))
        if who is None:
            raise ClientError("invalid_api_key", "Missing or unknown API key. Send 'Authorization: Bearer <key>'.")
        return who

    def _tenant_limits(self, tenant: str) -> dict | None:
        live = self.cfg.tenants
        current = live.current if isinstance(live, tenants.LiveTenants) else live
        return current.limits.get(tenant) if current is not None else None

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
        """Authenticate, read the body within the limit, let `judge` refuse it, then forward.
        Every answer carries the request id and ends in one audit record."""
        started, wall = time.perf_counter(), time.time()
        endpoint = request.scope["path"]
        rid = request_ids.sane(request.headers.get(REQUEST_ID_HEADER)) or request_ids.new()
        trace = request_ids.trace_id(rid)  # what the workers serve it under (SGLang's rid)
        tenant, kid, slot = UNAUTHENTICATED, None, None

        def done(response: Response) -> Response:
            """Stamp the request id; release the tenant's slot and audit once the answer is over."""

            def finish():
                if slot is not None:
                    slot.release()
                used = usage.usage_of(response.tail) if isinstance(response, UpstreamStream) else {}
                for kind, n in used.items():
                    self.tokens.labels(tenant=tenant, kind=kind).inc(n)
                if self.audit is not None:
                    self.audit.record(
                        wall, tenant, kid, rid, trace, endpoint, response, time.perf_counter() - started, used
                    )

            if isinstance(response, UpstreamStream):
                response.raw_headers.append((REQUEST_ID_HEADER.encode(), rid.encode()))
                response.on_done = finish  # held until the answer's last byte (or the client leaves)
            else:
                response.headers[REQUEST_ID_HEADER] = rid
                finish()
            return response

        try:
            tenant, kid = self.identify(request)
            raw = await self.read_body(request)
            judged = await judge(request, endpoint, raw, tenant) if judge is not None else Judged()
            if judge is not None:  # generation: the tenant's fair share (fair_share.py)
                self.fair.charge(tenant, judged.prompt_tokens or 0)
                slot = await self.fair.enter(tenant)
        except ClientError as e:
            response = self._error(tenant, endpoint, e.status, e.body())
            if e.code == "rate_limit_exceeded":
                response.headers["retry-after"] = str(e.details["retry_after_s"])
            return done(response)
        except ClientDisconnect:
            return done(Response(status_code=499))
        try:
            response = await self.forward(request, tenant, endpoint, raw, started, trace, judged.hide_usage)
        except BaseException:
            if slot is not None:
                slot.release()
            raise
        return done(response)

    async def judge_generation(self, request: Request, endpoint: str, raw: bytes, tenant: str) -> Judged:
        """Refuse the request (ClientError) or say what forwarding it needs to know (Judged)."""
        # The workers' own validation, here first: behind the router a worker's 400 loses its
        # `param` (PD bodies are rewritten) and the router judges some fields by other bounds.
        body = validation.parse_body(raw, request.headers.get("content-type"))
        self.validator.check(endpoint, body)
        return Judged(await self.count_prompt(endpoint, body, tenant), usage.hides_usage(endpoint, body))

    async def count_prompt(self, endpoint: str, body: dict, tenant: str) -> int | None:
        """Refuse the request (ClientError) or return its prompt's token count; None where it was
        not counted (not ours to count, or short enough to skip encoding and its tenant has no
        prompt-token budget)."""
        for name in DEPLOYMENT_FIELDS:
            if name in body:
                raise ClientError(
                    "invalid_request_error", f"{name} is set by the deployment, not by clients.", param=name
                )
        try:
            prompt, max_new = self.counter.prompt_of(endpoint, body)
        except Uncountable:
            return None  # not ours to judge: the worker validates it with its own checks
        if isinstance(prompt, str):
            bound = self.counter.at_most(prompt)
            if bound is not None and not self.fair.counts_tokens(tenant):
                try:
                    check(self.cfg.limits, bound, max_new, prompt_param=prompt_param(endpoint, body))
                    return None  # fits even at one token a byte: no need to encode
                except ClientError:
                    pass  # the bound does not decide; the count does
            prompt = await self.encode(prompt)
        check(self.cfg.limits, prompt, max_new, prompt_param=prompt_param(endpoint, body))
        return prompt

    async def encode(self, text: str) -> int:
        if len(text) <= ENCODE_ON_LOOP_MAX_CHARS:
            return self.counter.encode(text)
        return await asyncio.get_running_loop().run_in_executor(self._encoders, self.counter.encode, text)

    def upstream_headers(self, request: Request, tenant: str) -> dict[str, str]:
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _DROP_REQUEST_HEADERS and not k.lower().startswith(_DEPLOYMENT_HEADER_PREFIX)
        }
        if self.assertions is not None:
            headers["authorization"] = self.assertions.header(tenant)
        affinity = request.headers.get(AFFINITY_HEADER)
        if affinity:
            headers[ROUTING_KEY_HEADER] = routing_key(tenant, affinity)
        return headers

    async def forward(
        self,
        request: Request,
        tenant: str,
        endpoint: str,
        raw: bytes,
        started: float,
        trace: str,
        hide_usage: bool = False,
    ) -> Response:
        sent = time.perf_counter()
        self.upstream_timing.admission.observe(sent - started)
        try:
            upstream = await self._session.request(
                request.method,
                self.cfg.upstream + endpoint,
                headers={**self.upstream_headers(request, tenant), REQUEST_ID_HEADER: trace},
                data=raw,
                params=request.query_params.multi_items(),
            )
        except TimeoutError:
            return self._error(
                tenant, endpoint, 504, error_body("upstream_timeout", "The model server did not answer in time.")
            )
        except aiohttp.ClientError as e:
            return self._error(
                tenant,
                endpoint,
                502,
                error_body("upstream_unavailable", f"The model server is unreachable: {type(e).__name__}."),
            )
        if upstream.status >= 400:
            try:
                raw = await upstream.read()
            except (TimeoutError, aiohttp.ClientError):
                raw = b""  # the status stands; the body says the server's was lost
            finally:
                upstream.release()
            return self._error(tenant, endpoint, *upstream_errors.answer(upstream.status, raw))
        self.requests.labels(tenant=tenant, endpoint=endpoint, status=str(upstream.status), reason="").inc()
        if endpoint in GENERATION:
            self._served_at = time.monotonic()
        return UpstreamStream(upstream, sent, self.upstream_timing, hide_usage)

    def _error(self, tenant: str, endpoint: str, status: int, body: dict) -> JSONResponse:
        """An error answer, counted by its contract code (a bounded label: error_body takes no other)."""
        self.requests.labels(tenant=tenant, endpoint=endpoint, status=str(status), reason=body["error"]["code"]).inc()
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
                        **(
                            {"max_output_tokens": self.cfg.limits.max_output_tokens}
                            if self.cfg.limits.max_output_tokens is not None
                            else {}
                        ),
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

    async def ready(self, request: Request) -> Response:
        """200 when a real generation went through the whole path (router, every role) within
        READY_FRESH_S: a client's, or else a one-token probe of our own (one at a time). A load
        balancer then never sends traffic to a gateway whose router has no workers yet."""
        if time.monotonic() - self._served_at > READY_FRESH_S:
            async with self._probe_lock:
                if time.monotonic() - self._served_at > READY_FRESH_S:
                    await self._probe()
        fresh = time.monotonic() - self._served_at <= READY_FRESH_S
        return JSONResponse({"ready": fresh}, status_code=200 if fresh else 503)

    async def _probe(self) -> None:
        headers = {"content-type": "application/json"}
        if self.assertions is not None:  # the operator's assertion: the probe is no tenant's
            headers["authorization"] = self.assertions.header(tenants.ADMIN)
        body = b'{"input_ids": [5], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}'
        try:
            async with self._session.post(
                self.cfg.upstream + "/generate", data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=30)
            ) as r:
                ok = r.status == 200 and "output_ids" in await r.text()
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        if ok:
            self._served_at = time.monotonic()

    async def metrics(self, request: Request) -> Response:
        """The operator's listener only: the series name every tenant."""
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

    async def usage(self, request: Request) -> Response:
        """A tenant's own request counts (by endpoint, status and code), with its own key; never
        another tenant's."""
        try:
            tenant = self.authenticate(request)
        except ClientError as e:
            return self._error(UNAUTHENTICATED, "/v1/usage", e.status, e.body())
        rows = [
            {
                "endpoint": s.labels["endpoint"],
                "status": int(s.labels["status"]),
                "code": s.labels["reason"] or None,
                "requests": int(s.value),
            }
            for metric in self.requests.collect()
            for s in metric.samples
            if s.name.endswith("_total") and s.labels["tenant"] == tenant
        ]
        tokens = {
            s.labels["kind"]: int(s.value)
            for metric in self.tokens.collect()
            for s in metric.samples
            if s.name.endswith("_total") and s.labels["tenant"] == tenant
        }
        return JSONResponse({"object": "usage", "tenant": tenant or None, "requests": rows, "tokens": tokens})


def build_app(cfg: GatewayConfig) -> GatewayApp:
    gw = Gateway(cfg)
    routes = [Route(p, gw.generation, methods=["POST"]) for p in GENERATION]
    routes += [Route(p, gw.tenant_object, methods=["POST"]) for p in TENANT_OBJECTS]
    routes += [
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/v1/usage", gw.usage, methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/ready", gw.ready, methods=["GET"]),
    ]
    operator = Starlette(
        routes=[Route("/metrics", gw.metrics, methods=["GET"]), Route("/health", gw.health, methods=["GET"])]
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await gw.start()
        yield
        await gw.stop()

    return GatewayApp(gw, Starlette(routes=routes, lifespan=lifespan), operator)


class GatewayApp:
    """The ASGI app. Generation and tenant-object POSTs, the requests whose every chunk passes
    through, go straight to their handler; everything else (the other routes, 404, 405, the
    lifespan) through Starlette, whose routes list them all (the POST handlers are read from
    them). Not through Starlette's router and middleware for the streams: their two send wrappers
    and route matching were on every chunk and request, and their answer to an unexpected error
    is a text/plain 500; here it is the contract's JSON body."""

    def __init__(self, gateway: Gateway, starlette: Starlette, operator: Starlette):
        self.gateway, self.starlette, self.operator = gateway, starlette, operator
        self._posts = {r.path: r.endpoint for r in starlette.routes if "POST" in (r.methods or ())}
        self._operator_port = gateway.cfg.operator_port

    async def __call__(self, scope, receive, send) -> None:
        # One server, two listening sockets (gateway/__main__.py): what a connection may ask for
        # is decided by the socket it came in on, never by anything the client sends.
        if (
            self._operator_port is not None
            and scope["type"] != "lifespan"
            and (scope.get("server") or (None, None))[1] == self._operator_port
        ):
            return await self.operator(scope, receive, send)
        handler = self._posts.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            return await self.starlette(scope, receive, send)
        try:
            response = await handler(Request(scope, receive))
        except Exception:
            logger.exception("gateway error on %s", scope["path"])
            response = self.gateway._error(
                UNAUTHENTICATED, scope["path"], 500, error_body("internal_error", "The gateway failed on this request.")
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

    def __init__(self, upstream: aiohttp.ClientResponse, sent: float, timing: UpstreamTiming, hide_usage: bool):
        self.upstream, self.sent, self.timing = upstream, sent, timing
        # The usage event the workers add to every OpenAI stream, read here, not the client's (usage.py)
        self.usage_filter = usage.UsageEventFilter() if hide_usage else None
        self.on_done = None  # called once the answer is over, however it ended (the tenant's slot)
        self.tail = b""  # the answer's last bytes: where SGLang puts its usage figures (usage_of)
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
                tail = chunk if len(chunk) >= usage.TAIL_BYTES else self.tail + chunk
                self.tail = tail[-usage.TAIL_BYTES :]
                if self.usage_filter is not None:
                    chunk = self.usage_filter.feed(chunk)
                    if not chunk:
                        continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.timing.response.observe(time.perf_counter() - self.sent)
            rest = self.usage_filter.flush() if self.usage_filter is not None else b""
            await send({"type": "http.response.body", "body": rest, "more_body": False})
            done = True
        except aiohttp.ClientError:
            if not client_gone.is_set():
                raise  # the upstream failed mid-stream: the client's stream ends unterminated
        finally:
            watch.cancel()
            upstream.release() if done else upstream.close()
            if self.on_done is not None:
                self.on_done()
