"""Kubernetes manifests for a multi-node topology: `python -m glm53_serving.launch --render k8s --config FILE`.

One idea: rendering. Every container command is the launcher's own (`launch.plan`), so a pod runs
exactly what `--node NAME` would run on that node, with three changes a pod needs: the image's
`python`, no `--base-gpu-id` (the device plugin hands the pod its GPUs, numbered from 0), and the
key, tenants file and run dir at their mount paths. The launcher passes `plan` and `Tenancy` in:
launch.py imports this module, and the layer contracts forbid import circles.

What a platform engineer would check, and where it is held:
- one public door: the gateway's Service is the only LoadBalancer/NodePort, on the client port
  only; no hostPort anywhere; the gateway's operator port (/metrics) is a ClusterIP Service;
- workers and the router use the node's network (Mooncake RDMA and the bootstrap server
  advertise the node's address) and bind the node's *private* address, as with `--node`;
  NetworkPolicy does not cover such pods (docs/deploy-k8s.md), the host's firewall does;
- no key material is rendered: the Secrets are created by the operator from files
  (`kubectl create secret generic ... --from-file`), and the router mounts no key;
- readiness is real readiness: a server is ready when /server_info, asked with the operator's
  assertion, reports the glm53_serving guards active (as the launcher's server_probe).

The pods' exec probes are glm53_serving/pod_probe.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from glm53_serving import __version__
from glm53_serving.topology import Topology

SECRET_DIR = "/etc/glm53"  # the Secrets' mount: read-only, never the image's or the node's files
KEY_FILE = f"{SECRET_DIR}/assertion.key"
TENANTS_FILE = f"{SECRET_DIR}/tenants.toml"
KEY_SECRET, TENANTS_SECRET = "assertion-key", "tenants"
RUN_DIR = "/var/run/glm53"  # events and audit logs: an emptyDir (ship them off the pod to keep them)
NAME = "glm53-serving"  # app.kubernetes.io/name
PROCESS_LABEL = "glm53-serving/process"  # one pod per process: the selector of its workload
# GLM-5.3 loads hundreds of GiB of weights, then captures CUDA graphs: the first start of a server
# can take far longer than any readiness budget, and a liveness kill in the middle starts it over.
STARTUP_WINDOW_S = 3600
PROBE_PERIOD_S = 10
# The RDMA device plugin's resource (k8s-rdma-shared-dev-plugin's default name): it gives the pod
# /dev/infiniband; without such a plugin the pod would have to run privileged, which we never render.
RDMA_RESOURCE = "rdma/hca_shared_devices_a"


class RenderError(ValueError):
    """A topology that cannot be rendered for Kubernetes (the message says why and the way out)."""


def check(topo: Topology) -> None:
    if not topo.nodes:
        raise RenderError(
            f"{topo.source} names no [[nodes]]: Kubernetes manifests pin each process to a node and give it "
            "fixed ports; write a multi-node file (tests/unit/test_nodes.py THREE_NODES is an example)"
        )
    if topo.device == "cpu":
        raise RenderError(f'{topo.source} has device = "cpu": the manifests request GPUs (device = "cuda")')
    if topo.model.path is None:
        raise RenderError(f"{topo.source}: model.preset is generated on the machine; k8s mounts model.path")


def k8s_name(text: str) -> str:
    """A DNS label (namespaces and object names): lower case, '-' for anything else."""
    out = "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")[:63].strip("-")
    return out or NAME


def labels(topo: Topology, role: str | None = None, process: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/instance": k8s_name(topo.deployment())}
    if role:
        out["app.kubernetes.io/component"] = role
    if process:
        out[PROCESS_LABEL] = process
    return out


def meta(topo: Topology, name: str, namespace: str, **label_args) -> dict:
    return {"name": name, "namespace": namespace, "labels": labels(topo, **label_args)}


def selector(topo: Topology, process: str) -> dict[str, str]:
    return {PROCESS_LABEL: process, "app.kubernetes.io/instance": labels(topo)["app.kubernetes.io/instance"]}


def pod_command(argv: list[str]) -> list[str]:
    """The launcher's argv as a pod runs it: the image's python, and no --base-gpu-id (inside the
    pod the device plugin's GPUs are numbered from 0, whatever their index on the node)."""
    out = ["python", *argv[1:]]
    if "--base-gpu-id" in out:
        i = out.index("--base-gpu-id")
        del out[i : i + 2]
    return out


def _probe(argv: list[str], period_s: int, failures: int, timeout_s: int) -> dict:
    return {
        "exec": {"command": argv},
        "periodSeconds": period_s,
        "failureThreshold": failures,
        "timeoutSeconds": timeout_s,
    }


def probes(ready: list[str], live: list[str], startup_s: float) -> dict:
    """Readiness every 10 s; liveness (a restart) only after 5 minutes without an answer, so a busy
    server is not killed; a startup window covering the weights' load, during which neither runs."""
    return {
        "startupProbe": _probe(ready, PROBE_PERIOD_S, math.ceil(startup_s / PROBE_PERIOD_S), 10),
        "readinessProbe": _probe(ready, PROBE_PERIOD_S, 3, 10),
        "livenessProbe": _probe(live, 30, 10, 20),
    }


def probe_argv(kind: str, *args: str) -> list[str]:
    return ["python", "-m", "glm53_serving.pod_probe", kind, *args]


def _volumes(topo: Topology, opts: argparse.Namespace, secrets: list[tuple[str, str]], model: bool, shm: bool):
    """(volumes, mounts). Secrets are one projected read-only volume at SECRET_DIR, mode 0400; the
    directory (not a subPath) is mounted so a `kubectl apply` of a new tenants file reaches the
    running gateway (it reloads the file when its stat changes)."""
    vols = [{"name": "run", "emptyDir": {}}]
    mounts = [{"name": "run", "mountPath": RUN_DIR}]
    if secrets:
        sources = [{"secret": {"name": s, "items": [{"key": key, "path": key}]}} for s, key in secrets]
        vols.append({"name": "glm53-secrets", "projected": {"defaultMode": 0o400, "sources": sources}})
        mounts.append({"name": "glm53-secrets", "mountPath": SECRET_DIR, "readOnly": True})
    if model:
        # At model.path itself, so --model-path is the launcher's unchanged. Read-only: nothing in a
        # pod may alter the weights every other pod serves.
        src = (
            {"persistentVolumeClaim": {"claimName": opts.model_pvc, "readOnly": True}}
            if opts.model_pvc
            else {"hostPath": {"path": topo.model.path, "type": "Directory"}}
        )
        vols.append({"name": "model", **src})
        mounts.append({"name": "model", "mountPath": topo.model.path, "readOnly": True})
    if shm:
        # NCCL and SGLang's tensor-parallel workers share memory through /dev/shm; a container's
        # default is 64 MiB. Memory-backed, counted against the pod's memory.
        vols.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return vols, mounts


def workload(topo: Topology, opts: argparse.Namespace, child, role: str, container: dict, pod: dict) -> dict:
    """One process, one pod: a StatefulSet of one replica. Unlike a Deployment's rolling update, it
    never runs two pods of a process at once (two would fight for the same node's ports and GPUs),
    nor replaces a pod on an unreachable node until that pod is known to be gone."""
    name = child.name
    spec = {
        # Every pod on its topology node: the node's private address is in the commands (--host,
        # peers' URLs, bootstrap endpoints), and its GPUs and NICs were counted by the topology.
        "nodeSelector": {"kubernetes.io/hostname": child.node},
        # Nothing here talks to the Kubernetes API: a compromised process gets no token.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        **pod,
        "containers": [
            {
                "name": role,
                "image": opts.image,
                "command": pod_command(child.argv),
                "env": [{"name": k, "value": v} for k, v in child.env.items()] + container.pop("extra_env", []),
                **container,
            }
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(topo, name, opts.namespace, role=role, process=name),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector(topo, name)},
            "template": {"metadata": {"labels": labels(topo, role, name)}, "spec": spec},
        },
    }


def _security(*caps: str) -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], **({"add": list(caps)} if caps else {})},
    }


# hostNetwork pods: the process binds the node's private address itself, as under `--node`. They
# declare no containerPorts: on a hostNetwork pod the API server turns each into a hostPort.
HOST_NETWORK = {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}


def server(topo: Topology, opts: argparse.Namespace, child, role: str, gpus: int) -> dict:
    vols, mounts = _volumes(topo, opts, [(KEY_SECRET, "assertion.key")], model=True, shm=True)
    limits = {"nvidia.com/gpu": gpus}
    if topo.node(child.node).ib_devices and opts.rdma_resource:
        limits[opts.rdma_resource] = 1
    # IPC_LOCK: Mooncake registers (pins) the KV cache's memory with the RDMA NICs; the capability
    # lifts the memlock limit a container otherwise has. Every other capability is dropped.
    container = {
        "resources": {"requests": dict(limits), "limits": limits},
        "volumeMounts": mounts,
        "securityContext": _security(*(["IPC_LOCK"] if role in ("prefill", "decode") else [])),
        # Liveness asks the same question as readiness, less often and with more patience: the
        # guards cannot switch off at run time, so a failure there means the server stopped answering.
        **probes(probe_argv("server", child.url), probe_argv("server", child.url), STARTUP_WINDOW_S),
    }
    pod = {
        **HOST_NETWORK,
        "volumes": vols,
        # GPU node pools are commonly tainted for GPU workloads only; the nodeSelector still decides.
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
    return workload(topo, opts, child, role, container, pod)


def router(topo: Topology, opts: argparse.Namespace, child, servers: list) -> dict:
    # No key: the router forwards the gateway's assertions and never checks one (as in launch.py).
    vols, mounts = _volumes(topo, opts, [], model=False, shm=False)
    # Ready when /workers lists every server; alive while it answers at all (a restart would not
    # bring a worker back). It starts once every server answers HTTP (SGLang opens its port after
    # the weights are loaded), so its own worker-startup timeout is not spent on loading.
    wait = {
        "name": "wait-for-servers",
        "image": opts.image,
        "command": probe_argv("up", *(s.url for s in servers), "--wait"),
        "securityContext": _security(),
    }
    container = {
        "volumeMounts": mounts,
        "securityContext": _security(),
        **probes(
            probe_argv("router", child.url, "--workers", str(len(servers))),
            probe_argv("router", child.url, "--workers", "0"),
            topo.ready_timeout_s,
        ),
    }
    pod = {**HOST_NETWORK, "volumes": vols, "initContainers": [wait]}
    return workload(topo, opts, child, "router", container, pod)


def gateway(topo: Topology, opts: argparse.Namespace, child, client_port: int, operator_port: int) -> dict:
    """The one pod on the pod network: clients reach it through its Service only, NetworkPolicy
    applies to it, and it binds 0.0.0.0 in its own network namespace."""
    # Tenants off: the gateway holds no key (Tenancy.gateway_env), so it mounts none.
    on = topo.tenants.mode != "off"
    secrets = [(KEY_SECRET, "assertion.key"), (TENANTS_SECRET, "tenants.toml")] if on else []
    vols, mounts = _volumes(topo, opts, secrets, model=True, shm=False)
    argv = list(child.argv)
    argv[argv.index("--host") + 1] = "0.0.0.0"
    # The operator's listener on the pod's own address (the node's is not the pod's), via the
    # downward API; reached through the ClusterIP Service only.
    if "--operator-host" in argv:
        argv[argv.index("--operator-host") + 1] = "$(POD_IP)"
    else:
        argv[argv.index("--port") + 2 : argv.index("--port") + 2] = ["--operator-host", "$(POD_IP)"]
    child = dataclasses.replace(child, argv=argv)
    health = {"httpGet": {"path": "/health", "port": "client"}}
    container = {
        "ports": [
            {"name": "client", "containerPort": client_port},
            {"name": "operator", "containerPort": operator_port},
        ],
        "extra_env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "volumeMounts": mounts,
        "securityContext": _security(),
        # /health asks the router behind it: ready when the whole path answers. Alive while its
        # client port accepts connections: a restart would not bring the router back.
        "startupProbe": {"tcpSocket": {"port": "client"}, "periodSeconds": 5, "failureThreshold": 60},
        "readinessProbe": {**health, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 15, "failureThreshold": 3},
        "livenessProbe": {"tcpSocket": {"port": "client"}, "periodSeconds": 30, "failureThreshold": 6},
    }
    # It drains on SIGTERM (admits nothing new, lets answers finish for drain_s).
    pod = {"volumes": vols, "terminationGracePeriodSeconds": math.ceil(topo.gateway.drain_s) + 15}
    return workload(topo, opts, child, "gateway", container, pod)


def services(topo: Topology, opts: argparse.Namespace, client_port: int, operator_port: int) -> list[dict]:
    """The public door and the operator's: nothing else gets a Service. Workers and the router are
    reached on their nodes' private addresses, as the commands say; a Service in front of a
    hostNetwork pod would add no protection, only one more way in to audit."""
    sel = selector(topo, "gateway")
    public = {
        "type": opts.service_type,
        "selector": sel,
        "ports": [{"name": "client", "port": client_port, "targetPort": "client", "protocol": "TCP"}],
    }
    if opts.service_type == "LoadBalancer":
        # Local: the client's address reaches the gateway (audit log), and only nodes running it answer.
        public["externalTrafficPolicy"] = "Local"
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta(topo, "gateway", opts.namespace, role="gateway"),
            "spec": public,
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta(topo, "gateway-operator", opts.namespace, role="gateway"),
            "spec": {
                "type": "ClusterIP",  # /metrics names tenants: inside the cluster only
                "selector": sel,
                "ports": [{"name": "operator", "port": operator_port, "targetPort": "operator", "protocol": "TCP"}],
            },
        },
    ]


def network_policies(topo: Topology, opts: argparse.Namespace, client_port: int, operator_port: int) -> list[dict]:
    """Ingress: the gateway's client port from anywhere, its operator port from this namespace only
    (add your Prometheus' namespace), nothing else to any pod-network pod. hostNetwork pods (the
    servers, the router) are NOT selected by NetworkPolicy in common CNIs: the node's firewall and
    their private bind addresses are what keep them off the outside (docs/deploy-k8s.md)."""
    deny = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(topo, "default-deny-ingress", opts.namespace),
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
    }
    door = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(topo, "gateway-ingress", opts.namespace, role="gateway"),
        "spec": {
            "podSelector": {"matchLabels": selector(topo, "gateway")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"port": client_port, "protocol": "TCP"}]},
                {"from": [{"podSelector": {}}], "ports": [{"port": operator_port, "protocol": "TCP"}]},
            ],
        },
    }
    return [deny, door]


def secret_templates(topo: Topology, opts: argparse.Namespace) -> list[dict]:
    """The Secrets the pods mount, without data: the operator creates them from files (see
    `commands`). Rendering a key, even a fresh one, would put it in files and in version control."""
    wanted = [(KEY_SECRET, "assertion.key")]
    if topo.tenants.mode != "off":
        wanted.append((TENANTS_SECRET, "tenants.toml"))
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {
                **meta(topo, name, opts.namespace),
                "annotations": {"glm53-serving/create-with": create_secret(opts, name, key, f"./{key}")},
            },
        }
        for name, key in wanted
    ]


def create_secret(opts: argparse.Namespace, name: str, key: str, path: str) -> str:
    return f"kubectl -n {opts.namespace} create secret generic {name} --from-file={key}={path}"


def manifests(topo: Topology, opts: argparse.Namespace, plan: Callable, tenancy: Callable) -> list[dict]:
    """Every object to apply, Namespace first. `plan`, `tenancy`: launch.plan and launch.Tenancy."""
    check(topo)
    # demo mode has no launcher to write demo tenants here: the gateway reads the operator's file.
    on = topo.tenants.mode != "off"
    keys = tenancy(Path(KEY_FILE), Path(TENANTS_FILE) if on else None, deployment=topo.deployment())
    p = plan(topo, topo.model.path, Path(RUN_DIR), keys)
    places = {pl.name: pl for pl in topo.placements()}
    g = places["gateway"]
    # Pod Security: hostNetwork and IPC_LOCK are outside the "baseline" level, so the namespace is
    # "privileged" (nothing rendered runs privileged: every other capability is dropped).
    psa = {"pod-security.kubernetes.io/enforce": "privileged"}
    namespace = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": opts.namespace, "labels": {**labels(topo), **psa}},
    }
    out = [namespace]
    out += [server(topo, opts, c, places[c.name].role, places[c.name].gpus) for c in p.servers]
    if p.router is not None:
        out.append(router(topo, opts, p.router, p.servers))
    out.append(gateway(topo, opts, p.gateway, g.port, g.operator_port))
    out += services(topo, opts, g.port, g.operator_port)
    out += network_policies(topo, opts, g.port, g.operator_port)
    return out


# --- writing ----------------------------------------------------------------------------------

README = """# Kubernetes manifests for {deployment} (rendered from {source})

Rendered by `python -m glm53_serving.launch --render k8s`; re-render rather than edit, so these
commands and the launcher's `--node` commands never drift. docs/deploy-k8s.md explains them.

{commands}

The only public door is the Service `gateway` ({service_type}, port {port}).
CAVEAT: the servers and the router run with hostNetwork (Mooncake RDMA and the bootstrap
endpoints use the node's address). NetworkPolicy does not cover hostNetwork pods: their ports
({internal}) listen on the nodes' private addresses, and the nodes' firewall / security groups
must keep those addresses unreachable from outside the cluster.
"""


def commands(topo: Topology, opts: argparse.Namespace, out: Path) -> str:
    """What the operator runs: namespace, Secrets from their own files (named by the topology
    where it names them), then the rest."""
    base = Path(topo.source).parent
    key = base / topo.tenants.assertion_key_file if topo.tenants.assertion_key_file else Path("assertion.key")
    lines = [
        f"kubectl apply -f {out / 'namespace.yaml'}",
        "# the key every process shares (python -m glm53_serving.tenants new-key FILE)",
        create_secret(opts, KEY_SECRET, "assertion.key", str(key)),
    ]
    if topo.tenants.mode != "off":
        tenants_file = base / topo.tenants.file if topo.tenants.file else Path("tenants.toml")
        lines += [
            "# the gateway's tenants (python -m glm53_serving.tenants add FILE TENANT)",
            create_secret(opts, TENANTS_SECRET, "tenants.toml", str(tenants_file)),
        ]
    inst = labels(topo)["app.kubernetes.io/instance"]
    lines += [
        f"kubectl apply -f {out / 'deployment.yaml'}",
        f"kubectl -n {opts.namespace} wait pod -l app.kubernetes.io/instance={inst} --for=condition=Ready "
        f"--timeout={STARTUP_WINDOW_S}s",
    ]
    return "\n".join(lines)


def write(topo: Topology, opts: argparse.Namespace, objects: list[dict], out: Path) -> list[Path]:
    class Plain(yaml.SafeDumper):  # no &anchors / *aliases: each object reads on its own
        def ignore_aliases(self, data):
            return True

    out.mkdir(parents=True, exist_ok=True)
    head = f"# Rendered from {topo.source} by python -m glm53_serving.launch --render k8s; do not edit.\n"
    files = {
        "namespace.yaml": ("", objects[:1]),
        "deployment.yaml": ("", objects[1:]),
        # Not *.yaml: `kubectl apply -f DIR` skips it, so no apply ever blanks the real Secrets.
        "secrets.yaml.example": (
            "# The Secrets the pods mount, WITHOUT data, and not applied: create them from your files with the\n"
            "# commands in README.md (annotation glm53-serving/create-with), or hand these to your secret manager.\n",
            secret_templates(topo, opts),
        ),
    }
    written = []
    for name, (note, docs) in files.items():
        (out / name).write_text(head + note + yaml.dump_all(docs, Dumper=Plain, sort_keys=False))
        written.append(out / name)
    places = topo.placements()
    internal = sorted(
        {
            f"{p.host}:{port}"
            for p in places
            if p.role != "gateway"
            for port in (p.port, p.bootstrap_port, p.metrics_port)
            if port
        }
    )
    gw = next(p for p in places if p.role == "gateway")
    (out / "README.md").write_text(
        README.format(
            deployment=topo.deployment(),
            source=topo.source,
            commands="```bash\n" + commands(topo, opts, out) + "\n```",
            service_type=opts.service_type,
            port=gw.port,
            internal=", ".join(internal),
        )
    )
    return [*written, out / "README.md"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Kubernetes (--render k8s)")
    g.add_argument("--render", choices=("k8s",), default=None, help="write manifests for the topology, start nothing")
    g.add_argument("--out", type=Path, default=None, help="where the manifests go; default k8s/<deployment>/")
    g.add_argument("--namespace", default=None, help="default: the deployment's name")
    g.add_argument("--image", default=f"{NAME}:{__version__}", help="an image with SGLang and glm53-serving")
    g.add_argument("--model-pvc", default=None, help="mount the model from this PVC; default a hostPath at model.path")
    g.add_argument("--service-type", choices=("LoadBalancer", "NodePort"), default="LoadBalancer")
    g.add_argument("--rdma-resource", default=RDMA_RESOURCE, help="device-plugin resource for nodes with ib_devices")
    g.add_argument("--shm-size", default="64Gi", help="/dev/shm of each server pod")


def render_main(topo: Topology, args: argparse.Namespace, plan: Callable, tenancy: Callable) -> int:
    """`launch --render k8s`: write the manifests, print where and how to apply them; 2 if refused."""
    args.namespace = k8s_name(args.namespace or topo.deployment())
    out = args.out or Path("k8s") / k8s_name(topo.deployment())
    try:
        objects = manifests(topo, args, plan, tenancy)
    except RenderError as e:
        print(f"[launch] cannot render k8s: {e}", file=sys.stderr)
        return 2
    files = write(topo, args, objects, out)
    print(f"wrote {', '.join(str(f) for f in files)}\nthen:\n{commands(topo, args, out)}")
    return 0
