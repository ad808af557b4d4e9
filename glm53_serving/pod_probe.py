"""The Kubernetes pods' exec probes: `python -m glm53_serving.pod_probe {server,router,up} URL...`.

Exit 0 when ready, 1 with the reason on stderr (kubectl describe shows it). The same checks as the
launcher's probes (launch.server_probe, router_probe), from inside a pod: a server is ready when
/server_info, asked with the operator's assertion minted from the mounted key, reports the
glm53_serving guards and the deployment's tenants mode; a router when /workers lists every
server. `up`: any HTTP answer (SGLang opens its port once the weights are loaded); with --wait,
retry until every URL answers (an initContainer). Small on purpose: it runs every few seconds.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx

from glm53_serving import env, tenants

RETRY_S = 10.0


def server(url: str, client: httpx.Client) -> str | None:
    """None when ready; otherwise why not."""
    auth = tenants.mint(tenants.load_assertion_key(), tenants.ADMIN, deployment=env.DEPLOYMENT.get())
    r = client.get(f"{url}/server_info", headers={"Authorization": f"Bearer {auth}"})
    if r.status_code != 200:
        return f"/server_info {r.status_code}"
    status = r.json().get("glm53_serving")
    if status is None:  # the launcher refuses such a server; here it never becomes ready
        return "/server_info has no glm53_serving status: the plugin did not load in this server"
    want = "off" if env.TENANTS.get() == "off" else "enforced"
    if status.get("active") and status.get("tenants") != want:
        return f"tenants {status.get('tenants')!r} on the server, {want!r} in the deployment"
    if not status.get("active"):  # switched off explicitly (GLM53_SERVING_DISABLE): announced, as by the launcher
        print(f"WARNING: glm53_serving guards DISABLED ({status.get('disabled_by')})", file=sys.stderr)
    return None


def router(url: str, client: httpx.Client, workers: int) -> str | None:
    r = client.get(f"{url}/workers")  # its /health answers before the workers are registered
    total = r.json().get("total", 0) if r.status_code == 200 else -1
    return None if total >= workers else f"/workers {r.status_code}, {total}/{workers} workers"


def up(url: str, client: httpx.Client) -> str | None:
    client.get(url)
    return None


def check(kind: str, url: str, client: httpx.Client, workers: int) -> str | None:
    try:
        if kind == "server":
            return server(url, client)
        return router(url, client, workers) if kind == "router" else up(url, client)
    except (httpx.HTTPError, ValueError) as e:  # ValueError: no key, or an answer that is not JSON
        return f"{type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm53_serving.pod_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=("server", "router", "up"))
    p.add_argument("urls", nargs="+")
    p.add_argument("--workers", type=int, default=0, help="router: how many servers /workers must list")
    p.add_argument("--wait", action="store_true", help="retry until every URL passes")
    a = p.parse_args(argv)
    with httpx.Client(timeout=8) as client:
        while True:
            failed = [f"{u}: {why}" for u in a.urls if (why := check(a.kind, u, client, a.workers))]
            if not failed:
                return 0
            print("; ".join(failed), file=sys.stderr, flush=True)
            if not a.wait:
                return 1
            time.sleep(RETRY_S)


if __name__ == "__main__":
    sys.exit(main())
