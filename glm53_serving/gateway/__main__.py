"""python -m glm53_serving.gateway --upstream URL --model-path DIR ... (the launcher starts it)."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import socket
from pathlib import Path

import uvicorn

from glm53_serving import tenants, validation
from glm53_serving.admission import Limits
from glm53_serving.gateway.app import GatewayConfig, build_app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m glm53_serving.gateway", description=__doc__)
    p.add_argument("--upstream", required=True, help="the router (PD) or the single server")
    p.add_argument(
        "--model-path", required=True, help="checkpoint directory: its tokenizer and chat template count prompts"
    )
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--context-length", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="the client port")
    p.add_argument(
        "--operator-port",
        type=int,
        default=None,
        help="the operator's listener: /metrics (they name every tenant), never served on the client port",
    )
    p.add_argument("--operator-host", default=None, help="its address (default: --host)")
    p.add_argument("--audit-log", default=None, help="one JSON line per request (glm53_serving/audit.py)")
    p.add_argument("--max-body-bytes", type=int, required=True)
    p.add_argument("--upstream-timeout-s", type=float, required=True)
    p.add_argument(
        "--drain-s", type=float, default=0.0, help="on SIGTERM: admit nothing new, let answers finish this long"
    )
    p.add_argument(
        "--tenants-file",
        type=Path,
        default=None,
        help=f"API key hashes -> tenants; needs ${tenants.KEY_FILE_ENV}. Without it: no authentication",
    )
    p.add_argument(
        "--tenant-limits",
        default="{}",
        help="JSON: every tenant's fair share (tenants.TenantLimits); a tenant's own limits in the file override it",
    )
    p.add_argument("--max-n", type=int, default=validation.MAX_N, help="largest `n` (samples per request) to accept")
    a = p.parse_args(argv)
    limits = Limits.from_env()
    if limits is None:
        p.error("GLM53_DEPLOYMENT_LIMITS is not set: the gateway enforces the deployment's limit and needs it")
    try:
        tenant_limits = tenants.TenantLimits().over(json.loads(a.tenant_limits))
        key = tenants.load_assertion_key()
        tenants_file = tenants.LiveTenants(a.tenants_file) if a.tenants_file else None
    except (tenants.TenantsError, json.JSONDecodeError) as e:
        p.error(str(e))
    if (a.tenants_file is None) != (key is None):
        p.error(f"--tenants-file and ${tenants.KEY_FILE_ENV} go together (tenants on), or neither (off)")
    if a.operator_port is not None and a.operator_port == a.port:
        p.error("--operator-port must differ from --port: the client port never serves the operator's routes")
    cfg = GatewayConfig(
        upstream=a.upstream,
        model_path=a.model_path,
        served_model_name=a.served_model_name,
        context_length=a.context_length,
        limits=limits,
        max_body_bytes=a.max_body_bytes,
        upstream_timeout_s=a.upstream_timeout_s,
        max_n=a.max_n,
        tenants=tenants_file,
        assertion_key=key,
        operator_port=a.operator_port,
        tenant_limits=tenant_limits,
        audit_log=a.audit_log,
    )
    # One server on two sockets: the app tells the operator's connections by the socket they came in on.
    sockets = [socket.create_server((a.host, a.port))]
    if a.operator_port is not None:
        sockets.append(socket.create_server((a.operator_host or a.host, a.operator_port)))
    server = uvicorn.Server(
        uvicorn.Config(
            built(cfg),
            log_level="warning",
            access_log=False,
            loop="uvloop",
            http="httptools",
            # SIGTERM: the listeners close at once (nothing new is admitted); running answers get
            # this long, then are cut.
            timeout_graceful_shutdown=a.drain_s,
        )
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("glm53_serving.gateway").info(
        "gateway for %s on http://%s:%d (clients)%s; upstream %s; tenants %s; limits %s",
        a.served_model_name,
        a.host,
        a.port,
        f", http://{a.operator_host or a.host}:{a.operator_port} (operator: /metrics)" if a.operator_port else "",
        a.upstream,
        f"on ({len(tenants_file.current.keys())} from {a.tenants_file}, reloaded on change or SIGHUP)"
        if tenants_file
        else "OFF",
        limits,
    )
    server.run(sockets=sockets)


def built(cfg: GatewayConfig):
    """The app, with everything start-up made (~600k objects: torch, transformers, SGLang's request
    models, the tokenizer) moved out of the garbage collector's reach, as SGLang's own processes
    do (`freeze_gc`). Otherwise a full collection walks them all, 440 ms on this machine, and every
    stream through the gateway stalls for it (docs/performance.md)."""
    app = build_app(cfg)
    gc.collect()
    gc.freeze()
    return app


if __name__ == "__main__":
    main()
