"""Every environment variable glm53_serving reads, in one place: name, meaning, default, who sets it.

"What can the environment change?" has one answer: `VARS`. The launcher sets the deployment's
variables on every process it starts (topology.py derives them from the topology file); the
servers and the gateway read them through the `Var`s below, never by a string of their own.
Ground floor: this module imports nothing of the package, so the launcher, the gateway and the
worker side can all use it without importing each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Var:
    name: str
    doc: str
    set_by: str  # "launcher", "operator", "tests"
    default: str | None = None

    def get(self) -> str | None:
        return os.environ.get(self.name, self.default)

    def is_set(self) -> bool:
        return self.name in os.environ


# --- the deployment's facts: the launcher sets them on every process ---------------------------
DEPLOYMENT_LIMITS = Var(
    "GLM53_DEPLOYMENT_LIMITS",
    "JSON of admission.Limits: the one length limit of the deployment, the minimum over every role",
    "launcher",
)
CLIP_OUTPUT = Var("GLM53_CLIP_OUTPUT", '"1": clip max_new_tokens to the budget instead of a 400', "launcher")
MAX_BODY_BYTES = Var(
    "GLM53_MAX_BODY_BYTES", "a server's request body limit in bytes (413 above it)", "launcher", str(16 * 1024 * 1024)
)
ASSERTION_KEY_FILE = Var(
    "GLM53_ASSERTION_KEY_FILE", "the key that signs the gateway's tenant assertions (tenants on)", "launcher"
)
TENANTS = Var(
    "GLM53_TENANTS",
    '"on": every tenant route needs the gateway\'s signed assertion; "off": one trust domain (chosen explicitly '
    "in the topology; operator routes stay the operator's)",
    "launcher",
    "on",
)
DEPLOYMENT = Var(
    "GLM53_DEPLOYMENT",
    "the deployment's name, in the audience of its tenant assertions (another deployment's do not verify)",
    "launcher",
    "glm53",
)
CPU_DSA = Var(
    "GLM53_CPU_DSA",
    '"1": apply the CPU rows for GLM-5.x DSA models (cpu_dsa.py); set for a DSA model on a CPU topology',
    "launcher",
)
EVENTS_LOG = Var(
    "GLM53_EVENTS_LOG",
    "path prefix of this server's event log (events.py): each process writes PREFIX.PID.jsonl",
    "launcher",
)
PREFILL_BOOTSTRAP = Var(
    "GLM53_PREFILL_BOOTSTRAP", '"host:port,...": the only prefill bootstrap endpoints a PD worker accepts', "launcher"
)

# --- switches an operator sets explicitly ------------------------------------------------------
SERVING_DISABLE = Var("GLM53_SERVING_DISABLE", '"1": every guard off (benchmarks only; announced)', "operator")
KV_GUARD_OFF = Var(
    "GLM53_KV_GUARD_OFF", "comma list of KV guard parts to switch off (zero, owner, handoff)", "operator"
)
BATCH_INVARIANT = Var(
    "GLM53_BATCH_INVARIANT",
    '"1": CPU matmuls computed batch-invariantly (batch_invariant.py), for the isolation suite\'s servers',
    "operator",
)
TOPOLOGY = Var("GLM53_TOPOLOGY", "the launcher's default topology file", "operator")
CACHE_DIR = Var("GLM53_CACHE_DIR", "where embedded models are generated", "operator")

VARS: tuple[Var, ...] = (
    DEPLOYMENT_LIMITS,
    CLIP_OUTPUT,
    MAX_BODY_BYTES,
    ASSERTION_KEY_FILE,
    TENANTS,
    DEPLOYMENT,
    CPU_DSA,
    EVENTS_LOG,
    PREFILL_BOOTSTRAP,
    SERVING_DISABLE,
    KV_GUARD_OFF,
    BATCH_INVARIANT,
    TOPOLOGY,
    CACHE_DIR,
)

ROLES = ("single", "prefill", "decode")


def role() -> str:
    """This SGLang server's role: "single", "prefill" or "decode" (from its disaggregation mode)."""
    from sglang.srt.runtime_context import get_disagg

    return {"prefill": "prefill", "decode": "decode"}.get(get_disagg().disaggregation_mode or "null", "single")
