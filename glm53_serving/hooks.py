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
    # Where the row is in effect and verified: "any" process, or only "scheduler" processes
    # (rows applied by a scheduler-side hook, so that other processes never import their module).
    process: str = "any"

    def __post_init__(self):
        assert self.target.startswith("sglang."), self.target
        assert (self.kind is Kind.ATTR) == (self.impl is None), self
        assert self.why, self
        assert self.process in ("any", "scheduler"), self

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
    # --- admission: one limit, hard 4xx (admission.py, http_guard.py) --------------------------
    Hook(
        "sglang.srt.entrypoints.http_server.launch_server", Kind.BEFORE,
        "glm53_serving.http_guard:install_middleware_hook", ("server_args",),
        "install the middleware that sends a rejected request's 4xx before any byte of a 200 "
        "(upstream streams /generate rejections under HTTP 200)",
    ),
    # --- request validation: size, schema, domains (request_guard.py, validation.py) ---------
    Hook(
        "sglang.srt.entrypoints.http_server._setup_and_run_http_server", Kind.BEFORE,
        "glm53_serving.request_guard:install_hook", ("server_args", "tokenizer_manager"),
        "before uvicorn starts: install the body-size limit (413 before reading), the validation "
        "of every generation request before SGLang's handler (upstream crashes on some, 500s or "
        "ignores others), and the contract shape for every 4xx upstream answers itself",
    ),
    Hook(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request", Kind.BEFORE,
        "glm53_serving.intake:validate_request_hook", ("self", "obj", "input_ids"),
        "in the HTTP process, before any scheduler sees the request: token ids inside the "
        "vocabulary (upstream crashes), PD routing fields on PD roles (upstream decode crashes), "
        "and the deployment-wide length limit (upstream checks only context_len here)",
    ),
    # --- KV hygiene: zero before reuse (kv_guard.py) ----------------------------------------
    Hook(
        "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.alloc", Kind.AFTER,
        "glm53_serving.kv_guard:zero_after_alloc", ("self", "need_size"),
        "page size 1: every slot handed out reads zeros until its request writes it",
    ),
    Hook(
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc", Kind.AFTER,
        "glm53_serving.kv_guard:zero_after_alloc", ("self", "need_size"),
        "paged pools: plain allocations (decode pre-allocation, chunked prefill) read zeros",
    ),
    Hook(
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_extend", Kind.AFTER,
        "glm53_serving.kv_guard:zero_after_alloc", ("self", "prefix_lens", "prefix_lens_cpu", "seq_lens"),
        "paged pools: prefill extension slots read zeros",
    ),
    Hook(
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_decode", Kind.AFTER,
        "glm53_serving.kv_guard:zero_after_alloc", ("self", "seq_lens", "seq_lens_cpu", "last_loc"),
        "paged pools: each decode step's new slot reads zeros",
    ),
    Hook(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc", Kind.AFTER,
        "glm53_serving.kv_guard:publish_after_zeroing", ("self",),
        "PD decode: the zero fills complete before the destination's page indices go to prefill",
    ),
    # --- CPU development stack only (glm53_serving/cpu.py) ----------------------------------
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.__init__", Kind.BEFORE,
        "glm53_serving.cpu:apply_scheduler_attrs", ("self", "server_args"),
        "set the ATTR rows below in scheduler processes only: importing the Mooncake module in "
        "the HTTP process would import prometheus_client before SGLang sets multiprocess mode",
        guard=False, cpu_only=True,
    ),
    Hook(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.supports_host_tensor_indices",
        Kind.ATTR, None, (),
        "prefill's host-index send path allocates pin_memory tensors and a torch.cuda.Event "
        "(disaggregation/prefill.py _send_kv_chunk), which needs a CUDA driver",
        guard=False, cpu_only=True, value=False, process="scheduler",
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
    """Hand callable rows to HookRegistry; set process-wide ATTR rows now (scheduler-only ATTR
    rows are set by `apply_attrs` from a scheduler-side hook)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for h in hooks:
        if h.kind is not Kind.ATTR:
            HookRegistry.register(h.target, h.resolve_impl(), HookType(h.kind.value))
    apply_attrs(tuple(h for h in hooks if h.process == "any"))


def apply_attrs(hooks: tuple[Hook, ...]) -> None:
    for h in hooks:
        if h.kind is Kind.ATTR:
            owner, attr = _split(h.target)
            setattr(owner, attr, h.value)


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


def verify_applied(hooks: tuple[Hook, ...], process: str = "scheduler") -> list[str]:
    """One line per row that is NOT in effect in this process (empty list: all good). In a
    non-scheduler process, rows that only schedulers carry are not checked."""
    missing = []
    for h in hooks:
        if h.process == "scheduler" and process != "scheduler":
            continue
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
