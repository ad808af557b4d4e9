"""The gateway's own cost per streamed chunk, without a model server's noise.

    python -m glm53_serving.bench.gateway_hop [--concurrency 8] [--rounds 4] [--hops-own-core]

A stand-in upstream (aiohttp) streams SGLang-shaped /generate events at a fixed decode step; the
real gateway (`python -m glm53_serving.gateway`, tenants on) is put in front of it, and beside it
a bare pass-through on the same stack (uvicorn with httptools and uvloop, aiohttp's client; no
key, validation, count or metrics): the floor any Python hop on this stack pays on this machine.
The same load, alternating rounds, goes to the stand-in straight, through the bare hop and
through the gateway. Prints each hop's added TTFT and e2e p50, the gateway's own share beyond
the floor and its time before forwarding, and its process CPU per request and per chunk. A quick loop for
work on the hop; the figures for the issue's targets come from `bench.serving gateway`, which
drives the real topology with SGLang's own load generator. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

from glm53_serving import env, tenants
from glm53_serving.admission import Limits
from glm53_serving.bench.serving import cpu_seconds, pin, upstream_timing
from glm53_serving.models import tiny
from glm53_serving.topology import GatewayConf, free_port

# One event as SGLang's /generate streams it (text so far, ids, meta_info): ~400 bytes.
EVENT = (
    b"data: "
    + json.dumps(
        {
            "text": "x" * 60,
            "output_ids": list(range(30)),
            "meta_info": {
                "id": "0" * 32,
                "finish_reason": None,
                "prompt_tokens": 128,
                "completion_tokens": 5,
                "cached_tokens": 0,
                "e2e_latency": 0.123,
            },
        }
    ).encode()
    + b"\n\n"
)


def stand_in(port: int, events: int, step_s: float) -> None:
    from aiohttp import web

    async def generate(request):
        await request.read()
        r = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await r.prepare(request)
        for _ in range(events):
            await asyncio.sleep(step_s)
            await r.write(EVENT)
        await r.write(b"data: [DONE]\n\n")
        return r

    async def health(_request):
        return web.Response()

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def bare_hop(port: int, upstream: str) -> None:
    """Read the body, send it upstream, pass the answer back chunk by chunk: nothing else."""
    import uvicorn

    session: aiohttp.ClientSession | None = None

    async def app(scope, receive, send):
        nonlocal session
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                session = aiohttp.ClientSession(skip_auto_headers=("Content-Type", "Accept-Encoding", "User-Agent"))
                await send({"type": "lifespan.startup.complete"})
            await session.close()
            return await send({"type": "lifespan.shutdown.complete"})
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        async with session.request(
            scope["method"], upstream + scope["path"], data=body or None, headers={"content-type": "application/json"}
        ) as r:
            await send(
                {
                    "type": "http.response.start",
                    "status": r.status,
                    "headers": [(b"content-type", r.headers.get("content-type", "").encode())],
                }
            )
            async for chunk in r.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    uvicorn.run(
        app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="uvloop", http="httptools"
    )


async def load(url: str, key: str | None, a) -> dict:
    body = json.dumps(
        {
            "input_ids": list(range(128)),
            "stream": True,
            "sampling_params": {"max_new_tokens": a.events, "temperature": 0},
        }
    ).encode()
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    ttft, e2e, chunks = [], [], 0
    sem = asyncio.Semaphore(a.concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one():
            nonlocal chunks
            async with sem:
                t0 = time.perf_counter()
                first = None
                async with s.post(url + "/generate", data=body, headers=headers) as r:
                    assert r.status == 200, (r.status, await r.text())
                    async for _ in r.content.iter_any():
                        first = first or time.perf_counter() - t0
                        chunks += 1
                ttft.append(first)
                e2e.append(time.perf_counter() - t0)

        await asyncio.gather(*(one() for _ in range(a.requests)))
    return {"ttft": 1000 * statistics.median(ttft), "e2e": 1000 * statistics.median(e2e), "chunks": chunks}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=400, help="per round")
    p.add_argument("--events", type=int, default=32, help="streamed events per request")
    p.add_argument("--step-ms", type=float, default=6.0, help="the stand-in's decode step")
    p.add_argument("--rounds", type=int, default=4, help="counted rounds per side, after one warm-up each")
    p.add_argument(
        "--hops-own-core",
        action="store_true",
        help="the bare hop and the gateway on the last core, the stand-in and the load on the others "
        "(as on a GPU host, where the gateway's core does not run the serving path)",
    )
    p.add_argument("--stand-in", type=int, help=argparse.SUPPRESS)  # internal: serve the stand-in on this port
    p.add_argument("--bare-hop", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)  # internal, likewise
    a = p.parse_args(argv)
    if a.stand_in:
        return stand_in(a.stand_in, a.events, a.step_ms / 1000)
    if a.bare_hop:
        return bare_hop(int(a.bare_hop[0]), a.bare_hop[1])

    if a.hops_own_core:  # inherited by the stand-in and the hops; the hops are moved below
        *load_cores, hop_core = sorted(os.sched_getaffinity(0))
        assert load_cores, "--hops-own-core needs 2 or more cores"
        os.sched_setaffinity(0, load_cores)
    tmp = Path(tempfile.mkdtemp(prefix="glm53-hop-"))
    print(
        f"gateway hop: {a.requests} requests x {a.events} events, concurrency {a.concurrency}, "
        f"{a.rounds} alternating rounds per side; gateway log in {tmp}"
    )
    key_file, tenants_file = tenants.new_assertion_key(tmp / "assertion.key"), tmp / "tenants.toml"
    key = tenants.add_tenant(tenants_file, "bench")
    up_port, gw_port, bare_port, operator_port = free_port(), free_port(), free_port(), free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                __spec__.name,
                "--stand-in",
                str(up_port),
                "--events",
                str(a.events),
                "--step-ms",
                str(a.step_ms),
            ]
        )
    ]
    procs.append(
        subprocess.Popen(
            [sys.executable, "-m", __spec__.name, "--bare-hop", str(bare_port), f"http://127.0.0.1:{up_port}"]
        )
    )
    procs.append(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "glm53_serving.gateway",
                "--upstream",
                f"http://127.0.0.1:{up_port}",
                "--model-path",
                str(tiny.ensure()),
                "--served-model-name",
                "glm53-tiny",
                "--context-length",
                "4096",
                "--port",
                str(gw_port),
                "--operator-port",
                str(operator_port),
                "--max-body-bytes",
                str(GatewayConf().max_body_bytes),
                "--upstream-timeout-s",
                str(GatewayConf().upstream_timeout_s),
                "--tenants-file",
                str(tenants_file),
            ],
            env={
                **os.environ,
                env.DEPLOYMENT_LIMITS.name: Limits(4000, 4096, 4096).to_env(),
                tenants.KEY_FILE_ENV: str(key_file),
            },
            stderr=(tmp / "gateway.log").open("w"),
        )
    )
    try:
        for port, proc in zip((up_port, bare_port, gw_port), procs):
            asyncio.run(_wait_up(f"http://127.0.0.1:{port}/health", proc))
        hop_process = {"via bare hop": psutil.Process(procs[1].pid), "via gateway": psutil.Process(procs[2].pid)}
        if a.hops_own_core:
            for proc in procs[1:]:
                pin(proc.pid, {hop_core})
            print(f"bare hop and gateway on core {hop_core}; stand-in and load on cores {load_cores}")
        sides = {
            "straight": (f"http://127.0.0.1:{up_port}", None),
            "via bare hop": (f"http://127.0.0.1:{bare_port}", None),
            "via gateway": (f"http://127.0.0.1:{gw_port}", key),
        }
        runs = {side: [] for side in sides}
        for i in range(a.rounds + 1):
            order = list(sides.items())
            for side, (url, k) in (
                order[i % len(order) :] + order[: i % len(order)]
            ):  # who goes first rotates: the machine drifts
                measured = [hop_process[side]] if side in hop_process else []
                cpu0 = cpu_seconds(measured)
                r = asyncio.run(load(url, k, a))
                r["cpu_s"] = cpu_seconds(measured) - cpu0
                if i:
                    runs[side].append(r)
        before_forwarding = upstream_timing(f"http://127.0.0.1:{operator_port}")["admission"]  # all rounds, warm-up too
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    med = {side: {k: statistics.median(r[k] for r in rs) for k in ("ttft", "e2e")} for side, rs in runs.items()}
    for side, m in med.items():
        print(
            f"{side:>12}: ttft p50 {m['ttft']:7.2f} ms, e2e p50 {m['e2e']:7.2f} ms  (rounds: "
            + ", ".join(f"{r['e2e']:.1f}" for r in runs[side])
            + ")"
        )
    for hop in hop_process:
        print(
            f"{'added':>12}: {hop}: ttft p50 {med[hop]['ttft'] - med['straight']['ttft']:+.2f} ms, "
            f"e2e p50 {med[hop]['e2e'] - med['straight']['e2e']:+.2f} ms"
        )
    print(
        f"{'':>12}  the gateway's own, beyond the bare hop: ttft p50 "
        f"{med['via gateway']['ttft'] - med['via bare hop']['ttft']:+.2f} ms, e2e p50 "
        f"{med['via gateway']['e2e'] - med['via bare hop']['e2e']:+.2f} ms; before forwarding (key, body, "
        f"validation, count) {1000 * before_forwarding[0] / before_forwarding[1]:.3f} ms mean"
    )
    for hop in hop_process:
        per_req = [1000 * r["cpu_s"] / a.requests for r in runs[hop]]
        per_chunk = [1e6 * r["cpu_s"] / r["chunks"] for r in runs[hop]]
        print(
            f"{'CPU':>12}: {hop}: {statistics.median(per_req):.2f} ms per request, "
            f"{statistics.median(per_chunk):.0f} us per chunk (rounds: {', '.join(f'{x:.2f}' for x in per_req)} ms)"
        )


async def _wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while proc.poll() is None:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not come up")
            await asyncio.sleep(0.3)
    raise SystemExit(f"{proc.args[2]} exited {proc.returncode} before {url} answered")


if __name__ == "__main__":
    main()
