"""Every SGLang symbol glm53_serving hooks or overrides, in one table.

"What do we patch in SGLang?" has exactly one answer: `HOOKS` below. Each row names the
target (a dotted path into the pinned sglang==0.5.23), how we hook it, our implementation, the
parameter names we rely on (checked by tests/unit/test_hook_drift.py against the installed
SGLang), and why. `register()` hands the rows to SGLang's HookRegistry; `verify_applied()` proves
in a running process that each one really is in place, because HookRegistry only *logs* a hook
it could not apply and a security plugin must not serve unprotected (fail closed).

Kinds: BEFORE / AFTER / AROUND / REPLACE are HookRegistry's. ATTR sets a class attribute to a
constant (HookRegistry wraps callables only).
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable


class Kind(str, Enum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"
    ATTR = "attr"


@dataclass(frozen=True, slots=True)
class Hook:
    target: str
    kind: Kind
    impl: str | None  # "module:function" for callables; None for ATTR
    params: tuple[str, ...]  # the target's parameter names we depend on (ATTR: ())
    why: str
    guard: bool = True  # a security guard (off only with GLM53_SERVING_DISABLE=1) vs. a platform fix
    cpu_only: bool = False
    value: Any = None  # ATTR only

    def __post_init__(self):
        assert self.target.startswith("sglang."), self.target
        assert (self.kind is Kind.ATTR) == (self.impl is None), self
        assert self.why, self

    def resolve_impl(self) -> Callable:
        assert self.impl is not None
        return pkgutil.resolve_name(self.impl)


HOOKS: tuple[Hook, ...] = (
    # --- start-up handshake: fail closed (glm53_serving/startup.py) -------------------------
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.get_init_info", Kind.AFTER,
        "glm53_serving.startup:scheduler_verified_info", ("self",),
        "a scheduler whose hooks did not all apply raises instead of reporting ready, and a "
        "verified one tells the HTTP process so in its init info (and /server_info)",
        guard=False,  # also reports "disabled" when the guards are switched off
    ),
    Hook(
        "sglang.srt.entrypoints.engine._wait_for_scheduler_ready", Kind.AFTER,
        "glm53_serving.startup:require_verified_schedulers", ("scheduler_pipe_readers", "scheduler_procs"),
        "the HTTP/tokenizer process refuses to start unless every scheduler verified its hooks "
        "and its own hooks are in place",
        guard=False,
    ),
    # --- CPU development stack only (glm53_serving/cpu.py) ----------------------------------
    Hook(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.supports_host_tensor_indices",
        Kind.ATTR, None, (),
        "prefill's host-index send path allocates pin_memory tensors and a torch.cuda.Event "
        "(disaggregation/prefill.py _send_kv_chunk), which needs a CUDA driver",
        guard=False, cpu_only=True, value=False,
    ),
)


def active_hooks(*, cpu: bool, guards: bool) -> tuple[Hook, ...]:
    """The rows that apply to a process on this platform with guards on or off."""
    return tuple(h for h in HOOKS if (cpu or not h.cpu_only) and (guards or not h.guard))


def _split(target: str) -> tuple[Any, str]:
    owner, attr = target.rsplit(".", 1)
    return pkgutil.resolve_name(owner), attr


def resolve_target(target: str) -> Any:
    """The object currently at `target` (unwrapping classmethod/staticmethod descriptors)."""
    owner, attr = _split(target)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    if isinstance(raw, (classmethod, staticmethod)):
        return raw.__func__
    return getattr(owner, attr)


def register(hooks: tuple[Hook, ...]) -> None:
    """Hand callable rows to HookRegistry and set ATTR rows now."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for h in hooks:
        if h.kind is Kind.ATTR:
            owner, attr = _split(h.target)
            setattr(owner, attr, h.value)
        else:
            HookRegistry.register(h.target, h.resolve_impl(), HookType(h.kind.value))


def _chain_contains(fn: Any, impl: Callable) -> bool:
    """True if `impl` is one of the hooks in HookRegistry's wrapper chain around `fn`."""
    seen = 0
    while fn is not None and seen < 64:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is impl:
                    return True
            except ValueError:  # empty cell
                pass
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


def verify_applied(hooks: tuple[Hook, ...]) -> list[str]:
    """Return one line per row that is NOT in effect in this process (empty list: all good)."""
    missing = []
    for h in hooks:
        try:
            current = resolve_target(h.target)
        except Exception as e:  # noqa: BLE001 - any resolution failure is a missing hook
            missing.append(f"{h.target}: cannot resolve ({type(e).__name__}: {e})")
            continue
        if h.kind is Kind.ATTR:
            if current != h.value:
                missing.append(f"{h.target}: is {current!r}, expected {h.value!r}")
        elif not _chain_contains(current, h.resolve_impl()):
            missing.append(f"{h.target}: {h.kind.value} hook {h.impl} is not applied")
    return missing
