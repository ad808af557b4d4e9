"""Kubernetes manifests rendered from a multi-node topology (glm53_serving/k8s.py): schema-valid,
one public door, GPUs and nodes as placed, no key material, and the launcher's own commands."""

import re
import secrets
import shlex
import socket
from pathlib import Path

import httpx
import jwt
import kubernetes_validate
import pytest
import yaml

from glm53_serving import k8s, launch, pod_probe, tenants
from glm53_serving.topology import Topology
from tests.unit.test_nodes import THREE_NODES

K8S_VERSION = "1.33"  # the oldest Kubernetes these manifests are written for (StatefulSet without serviceName)


def render(tmp_path, body=THREE_NODES, *extra) -> tuple[int, Path]:
    (tmp_path / "nodes.toml").write_text(body)
    out = tmp_path / "out"
    rc = launch.main(["--config", str(tmp_path / "nodes.toml"), "--render", "k8s", "--out", str(out), *extra])
    return rc, out


def objects(out: Path, files=("namespace.yaml", "deployment.yaml")) -> list[dict]:
    return [d for f in files for d in yaml.safe_load_all((out / f).read_text()) if d]


def by(objs, kind) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


@pytest.fixture
def rendered(tmp_path):
    rc, out = render(tmp_path)
    assert rc == 0
    return out


def test_the_manifests_validate_offline_against_the_kubernetes_schemas(rendered, monkeypatch):
    def no_network(*a, **k):
        raise OSError("offline")

    monkeypatch.setattr(socket.socket, "connect", no_network)  # the schemas ship in the wheel
    objs = objects(rendered, ("namespace.yaml", "deployment.yaml", "secrets.yaml.example"))
    assert {o["kind"] for o in objs} == {"Namespace", "StatefulSet", "Service", "NetworkPolicy", "Secret"}
    for o in objs:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    # The check is not vacuous: a misspelt field fails.
    bad = by(objs, "StatefulSet")["decode-0"]
    pod(bad)["hostNetwerk"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _selected(service: dict, workloads: dict[str, dict]) -> list[dict]:
    sel = service["spec"].get("selector") or {}
    return [
        w
        for w in workloads.values()
        if sel and all(w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())
    ]


def _containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_no_worker_or_router_port_is_exposed_outside_the_cluster(rendered):
    objs = objects(rendered)
    workloads = by(objs, "StatefulSet")
    topo = Topology.load(rendered.parent / "nodes.toml")
    gw = next(p for p in topo.placements() if p.role == "gateway")
    external = [s for s in by(objs, "Service").values() if s["spec"].get("type") in ("LoadBalancer", "NodePort")]
    assert [s["metadata"]["name"] for s in external] == ["gateway"]
    for s in by(objs, "Service").values():
        assert s["spec"].get("type", "ClusterIP") in ("ClusterIP", "LoadBalancer", "NodePort")
        assert not s["spec"].get("externalIPs")
        if s in external:
            # A selector naming the gateway pod only, and the client port only.
            targets = _selected(s, workloads)
            assert [w["metadata"]["name"] for w in targets] == ["gateway"] and not pod(targets[0]).get("hostNetwork")
            ports = {p["name"]: p["containerPort"] for p in pod(targets[0])["containers"][0]["ports"]}
            for sp in s["spec"]["ports"]:
                target = sp["targetPort"]
                assert ports.get(target, target) == gw.port and sp["port"] == gw.port
            assert gw.operator_port not in [ports.get(sp["targetPort"]) for sp in s["spec"]["ports"]]
    for name, w in workloads.items():
        spec = pod(w)
        for c in _containers(spec):
            assert all("hostPort" not in p for p in c.get("ports", [])), name
            if spec.get("hostNetwork"):
                # On the node's network a container port would become a hostPort; and the process
                # binds the node's private address, never a wildcard.
                assert not c.get("ports"), name
        if spec.get("hostNetwork"):
            cmd = spec["containers"][0]["command"]
            assert cmd[cmd.index("--host") + 1] == topo.node(spec["nodeSelector"]["kubernetes.io/hostname"]).host


def test_gpu_requests_equal_the_placements_gpus_and_each_server_is_pinned_to_its_node(rendered):
    workloads = by(objects(rendered), "StatefulSet")
    topo = Topology.load(rendered.parent / "nodes.toml")
    for p in topo.placements():
        spec = pod(workloads[p.name])
        assert spec["nodeSelector"] == {"kubernetes.io/hostname": p.node}, p.name
        res = spec["containers"][0].get("resources", {})
        if p.role in ("prefill", "decode"):
            assert p.gpus == 4
            assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == p.gpus, p.name
            assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
            # The device plugin numbers the pod's GPUs from 0.
            assert "--base-gpu-id" not in spec["containers"][0]["command"]
        else:
            assert "nvidia.com/gpu" not in res.get("limits", {}), p.name


def test_the_secrets_carry_no_key_material_and_the_router_mounts_no_key(tmp_path):
    key = secrets.token_hex(32)
    (tmp_path / "assertion.key").write_text(key)  # the file THREE_NODES names
    tenant_key = tenants.add_tenant(tmp_path / "tenants.toml", "acme")
    body = THREE_NODES.replace('mode = "demo"', 'mode = "file"\nfile = "tenants.toml"')
    rc, out = render(tmp_path, body)
    assert rc == 0
    texts = "".join(f.read_text() for f in out.iterdir())
    digest = tenants.hash_key(tenant_key)
    assert key not in texts and tenant_key not in texts and digest not in texts
    secret_objs = by(objects(out, ("secrets.yaml.example",)), "Secret")
    assert set(secret_objs) == {"assertion-key", "tenants"}
    assert all("data" not in s and "stringData" not in s for s in secret_objs.values())
    # The operator's files are named (by path) in the commands, never read.
    assert f"--from-file=assertion.key={tmp_path / 'assertion.key'}" in (out / "README.md").read_text()
    workloads = by(objects(out), "StatefulSet")
    router = pod(workloads["router"])
    assert not [v for v in router["volumes"] if "secret" in v or "projected" in v]
    assert all(e["name"] != tenants.KEY_FILE_ENV for e in router["containers"][0]["env"])
    for name in ("prefill-0", "decode-0", "gateway"):
        mounts = {m["mountPath"]: m for m in pod(workloads[name])["containers"][0]["volumeMounts"]}
        assert mounts[k8s.SECRET_DIR]["readOnly"] is True, name


def _dry_run(tmp_path, capsys) -> dict[str, tuple[dict[str, str], list[str]]]:
    """{process: (env, argv)} from the launcher's --dry-run, the per-node commands."""
    rc = launch.main(["--config", str(tmp_path / "nodes.toml"), "--dry-run", "--run-dir", str(tmp_path / "run")])
    assert rc == 0
    out, name = {}, None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("# ") and not line.startswith("# client"):
            name = line[2:]
        elif name and not line.startswith("#"):
            words = shlex.split(line)
            i = next(i for i, w in enumerate(words) if "=" not in w)
            out[name] = (dict(w.split("=", 1) for w in words[:i]), words[i:])
            name = None
    return out


def _without(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + 2 :]


def test_each_containers_command_is_the_launchers_dry_run_command(rendered, capsys):
    capsys.readouterr()
    dry = _dry_run(rendered.parent, capsys)
    workloads = by(objects(rendered), "StatefulSet")
    assert set(dry) == set(workloads)
    paths = {tenants.KEY_FILE_ENV, "GLM53_EVENTS_LOG"}  # the run dir and the Secret's mount
    for name, (env_, argv) in dry.items():
        c = pod(workloads[name])["containers"][0]
        cmd = c["command"]
        assert cmd[0] == "python"
        if name == "gateway":  # its own address in the pod, its files at their mounts
            cmd, argv = _without(cmd, "--operator-host"), _without(argv, "--operator-host")
            for flag in ("--audit-log", "--tenants-file"):
                assert cmd[cmd.index(flag) + 1].startswith((k8s.RUN_DIR, k8s.SECRET_DIR))
                cmd, argv = _without(cmd, flag), _without(argv, flag)
        if "--base-gpu-id" in argv:
            argv = _without(argv, "--base-gpu-id")
        assert cmd[1:] == argv[1:], name
        pod_env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        assert set(pod_env) == set(env_), name
        assert {k: v for k, v in pod_env.items() if k not in paths} == {
            k: v for k, v in env_.items() if k not in paths
        }, name
        assert all(pod_env[k].startswith((k8s.RUN_DIR, k8s.SECRET_DIR)) for k in paths & set(pod_env)), name


REFUSED = [
    (  # a GPU file on one host: nothing to pin to a node
        'topology = "pd"\ndevice = "cuda"\ngpu_memory_gib = 288\n[model]\npath = "/models/GLM-5.3"\n'
        'context_length = 4096\n[worker]\nkv_tokens = 8192\nargs = ["--tp-size", "4", "--mem-fraction-static", "0.85"]\n',
        "names no \\[\\[nodes\\]\\]",
    ),
    (THREE_NODES.replace('device = "cuda"', 'device = "cpu"'), 'device = "cpu"'),
]


@pytest.mark.parametrize("body, msg", REFUSED, ids=["single-host", "cpu"])
def test_a_single_host_or_cpu_file_is_refused_with_a_message(tmp_path, capsys, body, msg):
    rc, out = render(tmp_path, body)
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert re.search(msg, err), err


def test_render_prints_where_it_wrote_and_how_to_apply(tmp_path, capsys):
    rc, out = render(tmp_path)
    printed = capsys.readouterr().out
    assert rc == 0 and str(out / "deployment.yaml") in printed
    assert "kubectl -n nodes create secret generic assertion-key --from-file=" in printed
    assert "kubectl apply -f" in printed


def _serve(key: bytes, answer: dict, code: int = 200) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":  # the operator's, for deployment "nodes" (THREE_NODES)
            try:
                claims = jwt.decode(
                    tenants.bearer(request.headers.get("authorization")) or "",
                    key,
                    algorithms=["HS256"],
                    audience=tenants.audience("nodes"),
                )
            except jwt.PyJWTError:
                return httpx.Response(401, json={})
            if claims["sub"] != tenants.ADMIN:
                return httpx.Response(401, json={})
        return httpx.Response(code, json=answer)

    return httpx.Client(transport=httpx.MockTransport(handler))


@pytest.mark.parametrize(
    "answer, code, ready",
    [
        ({"glm53_serving": {"active": True, "tenants": "enforced"}}, 200, True),
        ({}, 200, False),  # the plugin did not load
        ({"glm53_serving": {"active": True, "tenants": "off"}}, 200, False),
        ({"glm53_serving": {"active": True, "tenants": "enforced"}}, 503, False),
    ],
)
def test_the_server_probe_is_ready_only_with_the_guards_in_force(tmp_path, monkeypatch, answer, code, ready):
    key = tenants.load_assertion_key(tenants.new_assertion_key(tmp_path / "k"))
    monkeypatch.setenv(tenants.KEY_FILE_ENV, str(tmp_path / "k"))  # as the pod's env names its mount
    monkeypatch.setenv("GLM53_DEPLOYMENT", "nodes")
    monkeypatch.delenv("GLM53_TENANTS", raising=False)
    why = pod_probe.check("server", "http://10.0.0.11:30000", _serve(key, answer, code), 0)
    assert (why is None) is ready, why
    # Without the operator's assertion for this deployment, never ready.
    monkeypatch.setenv("GLM53_DEPLOYMENT", "another")
    assert pod_probe.check("server", "http://10.0.0.11:30000", _serve(key, answer, code), 0) is not None


def test_the_router_probe_waits_for_every_worker(tmp_path):
    client = _serve(b"", {"total": 2})
    assert pod_probe.check("router", "http://10.0.0.10:8000", client, 3) is not None
    assert pod_probe.check("router", "http://10.0.0.10:8000", client, 2) is None
