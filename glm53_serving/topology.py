"""A deployment described by one TOML file under launch/, and every process argument derived from it.

Nothing is typed twice: ports, bootstrap endpoints, router workers and the client URL all come
from one `Topology`. Validation happens at load time (dataclass `__post_init__`), so a bad file
fails before any process starts.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from glm53_serving import cpu

REPO_LAUNCH_DIR = Path(__file__).resolve().parent.parent / "launch"
DEFAULT_CONFIG = REPO_LAUNCH_DIR / "cpu.toml"
PRESETS = ("glm53-tiny",)


@dataclass(slots=True)
class ModelConf:
    preset: str | None = None  # an embedded model generated locally ("glm53-tiny")
    path: str | None = None  # or a checkpoint directory
    served_model_name: str = "glm53"
    context_length: int | None = None
    dtype: str | None = None

    def __post_init__(self):
        assert (self.preset is None) != (self.path is None), "model: set exactly one of preset, path"
        assert self.preset is None or self.preset in PRESETS, f"model.preset must be one of {PRESETS}"
        assert self.context_length is None or self.context_length > 0


@dataclass(slots=True)
class RoleConf:
    count: int = 1
    args: list[str] = field(default_factory=list)  # extra SGLang flags for this role, verbatim

    def __post_init__(self):
        assert self.count >= 1, "a role needs at least one server"


@dataclass(slots=True)
class RouterConf:
    policy: str = "round_robin"
    args: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Topology:
    topology: Literal["single", "pd"]
    model: ModelConf
    device: Literal["cpu", "cuda"] = "cuda"
    host: str = "127.0.0.1"
    transfer_backend: str = "mooncake"
    worker: RoleConf = field(default_factory=RoleConf)  # flags common to every server
    prefill: RoleConf = field(default_factory=RoleConf)
    decode: RoleConf = field(default_factory=RoleConf)
    router: RouterConf = field(default_factory=RouterConf)
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 600.0
    source: str = "<inline>"

    def __post_init__(self):
        assert self.topology in ("single", "pd"), f"topology must be single or pd, not {self.topology!r}"
        assert self.device in ("cpu", "cuda"), f"device must be cpu or cuda, not {self.device!r}"
        assert self.worker.count == 1, "[worker] holds flags shared by all servers; set counts per role"
        assert self.ready_timeout_s > 0

    @classmethod
    def load(cls, path: Path | str, topology: str | None = None) -> "Topology":
        path = Path(path)
        with path.open("rb") as f:
            raw = tomllib.load(f)
        file_topology = raw.pop("topology", "pd")
        try:
            return cls(
                topology=topology or file_topology,
                model=ModelConf(**raw.pop("model", {})),
                worker=RoleConf(**raw.pop("worker", {})),
                prefill=RoleConf(**raw.pop("prefill", {})),
                decode=RoleConf(**raw.pop("decode", {})),
                router=RouterConf(**raw.pop("router", {})),
                source=str(path),
                **raw,
            )
        except (TypeError, AssertionError) as e:
            raise ValueError(f"{path}: {e}") from e

    # --- derived -----------------------------------------------------------------------------

    def process_env(self) -> dict[str, str]:
        env = {
            # The bootstrap server and the transfer engine advertise this address to peers;
            # left unset they advertise the first NIC's address instead of the configured host.
            "SGLANG_HOST_IP": self.host,
        }
        if self.device == "cpu":
            env.update(cpu.ENV)
        env.update(self.env)
        return env

    def server_argv(self, model_path: str, port: int, role: str, bootstrap_port: int | None = None) -> list[str]:
        m = self.model
        argv = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", model_path,
            "--served-model-name", m.served_model_name,
            "--host", self.host, "--port", str(port),
        ]
        if m.context_length:
            argv += ["--context-length", str(m.context_length)]
        if m.dtype:
            argv += ["--dtype", m.dtype]
        if self.device == "cpu":
            argv += list(cpu.SERVER_ARGS)
        argv += self.worker.args
        if role == "prefill":
            argv += ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", self.transfer_backend,
                     "--disaggregation-bootstrap-port", str(bootstrap_port)]
            argv += self.prefill.args
        elif role == "decode":
            argv += ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", self.transfer_backend]
            if self.device == "cpu":
                argv += list(cpu.DECODE_ARGS)
            argv += self.decode.args
        else:
            assert role == "single", role
        return argv

    def router_argv(self, port: int, prometheus_port: int, prefills: list[tuple[str, int]], decodes: list[str]) -> list[str]:
        argv = [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--host", self.host, "--port", str(port), "--policy", self.router.policy,
            # Its exporter binds 0.0.0.0:29000 by default; two routers on a host then collide.
            "--prometheus-host", self.host, "--prometheus-port", str(prometheus_port),
        ]
        for url, boot in prefills:
            argv += ["--prefill", url, str(boot)]
        for url in decodes:
            argv += ["--decode", url]
        return argv + self.router.args


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, argv)])


def default_config_path() -> Path:
    return Path(os.environ.get("GLM53_TOPOLOGY", DEFAULT_CONFIG))
