"""SGLang general-plugin entry point (`sglang.srt.plugins` group, see pyproject.toml).

SGLang calls `register()` once in every process that runs `load_plugins()` (the HTTP/tokenizer
process, each scheduler, the detokenizer) and only *logs* an exception from it. So `register()`
never raises: it records what went wrong, and the start-up handshake (startup.py) turns any
recorded problem into a refusal to start.

`GLM53_SERVING_DISABLE=1`, and only that exact value, switches the guards off; the server then
says so in every process's log and in `/server_info` (`glm53_serving.active == false`).

`GLM53_KV_GUARD_OFF=<parts>` (comma-separated, from `hooks.KV_PARTS`: zero, owner, handoff)
switches off only those parts of the KV guard; unset or empty keeps all of them, an unknown part
is refused. Switched-off parts are logged at start-up and listed in `/server_info`
(`glm53_serving.kv_guard`).
"""

from __future__ import annotations

import logging
import os

from glm53_serving import batch_invariant, env, hooks

logger = logging.getLogger("glm53_serving")

DISABLE_ENV = env.SERVING_DISABLE.name
KV_OFF_ENV = env.KV_GUARD_OFF.name

_active: tuple[hooks.Hook, ...] = ()
_problems: list[str] = []
_disabled = False
_kv_off: frozenset[str] = frozenset()
_registered = False


def guards_disabled() -> bool:
    """Explicit opt-out only: unset or "0" keeps the guards; any other value but "1" is refused."""
    raw = os.environ.get(DISABLE_ENV, "")
    if raw in ("", "0"):
        return False
    if raw == "1":
        return True
    raise ValueError(f"{DISABLE_ENV}={raw!r}: set it to 1 to disable the guards, or unset it")


def kv_parts_off() -> frozenset[str]:
    """The KV guard parts switched off explicitly; anything unknown is refused (fail closed)."""
    parts = frozenset(p.strip() for p in os.environ.get(KV_OFF_ENV, "").split(",") if p.strip())
    unknown = parts - set(hooks.KV_PARTS)
    if unknown:
        raise ValueError(f"{KV_OFF_ENV}: unknown part(s) {sorted(unknown)}; known: {', '.join(hooks.KV_PARTS)}")
    return parts


def kv_part_on(part: str) -> bool:
    if part not in hooks.KV_PARTS:
        raise ValueError(f"no KV guard part {part!r}")
    return _registered and not _disabled and part not in _kv_off


def _is_cpu() -> bool:
    from sglang.srt.utils import is_cpu

    return is_cpu()


def register() -> None:
    global _active, _disabled, _kv_off, _registered
    if _registered:
        return
    _registered = True
    # The handshake rows go in first and on their own, so that whatever fails below is still
    # reported by a hook that refuses to start.
    handshake = tuple(h for h in hooks.HOOKS if h.impl and h.impl.startswith("glm53_serving.startup:"))
    try:
        hooks.register(handshake)
    except Exception as e:  # noqa: BLE001 - recorded, and the missing rows fail verification
        _problems.append(f"registering the start-up handshake failed: {type(e).__name__}: {e}")
    try:
        _disabled = guards_disabled()
        _kv_off = kv_parts_off()
        rows = hooks.active_hooks(cpu=_is_cpu(), guards=not _disabled, parts_off=_kv_off, dsa=env.CPU_DSA.get() == "1")
        hooks.register(tuple(h for h in rows if h not in handshake))
        _active = rows
    except Exception as e:  # noqa: BLE001
        _problems.append(f"registering hooks failed: {type(e).__name__}: {e}")
        _active = hooks.HOOKS  # verify everything: it cannot all be in place
    _problems.extend(_batch_invariance())
    if _disabled:
        logger.warning(
            "\n%s\n!! glm53_serving guards are DISABLED (%s=1): this server does NOT enforce\n"
            "!! admission limits, KV isolation or tenant isolation. Never expose it to tenants.\n%s",
            "!" * 78,
            DISABLE_ENV,
            "!" * 78,
        )
    elif _kv_off:
        logger.warning(
            "!! glm53_serving KV guard parts switched OFF (%s=%s): %s. This server does NOT enforce "
            "them; never expose it to tenants.",
            KV_OFF_ENV,
            os.environ.get(KV_OFF_ENV),
            ", ".join(sorted(_kv_off)),
        )


def _batch_invariance() -> list[str]:
    raw = env.BATCH_INVARIANT.get() or ""
    if raw in ("", "0"):
        return []
    if raw != "1":
        return [f"{env.BATCH_INVARIANT.name}={raw!r}: set it to 1 or unset it"]
    try:
        return batch_invariant.enable(cpu=_is_cpu())
    except Exception as e:  # noqa: BLE001 - a server asked to be deterministic that is not refuses to start
        return [f"{env.BATCH_INVARIANT.name}=1 could not be applied: {type(e).__name__}: {e}"]


def problems(process: str) -> list[str]:
    """Everything that keeps this process ("scheduler" or "http") from being protected (empty:
    protected, or guards explicitly disabled)."""
    if not _registered:
        return ["glm53_serving.plugin.register() never ran in this process (plugin not loaded?)"]
    return [*_problems, *hooks.verify_applied(_active, process)]


def guards_active() -> bool:
    return _registered and not _disabled


def active_rows() -> tuple[hooks.Hook, ...]:
    return _active


def status() -> dict:
    """What /server_info reports under `glm53_serving`."""
    from glm53_serving import __version__

    return {
        "active": not _disabled,
        "version": __version__,
        "disabled_by": f"{DISABLE_ENV}=1" if _disabled else None,
        "kv_guard": {part: not _disabled and part not in _kv_off for part in hooks.KV_PARTS},
        "kv_guard_off_by": f"{KV_OFF_ENV}={os.environ.get(KV_OFF_ENV)}" if _kv_off and not _disabled else None,
        "hooks": [h.target for h in _active],
        "batch_invariant": batch_invariant.active(),
    }


def apply_scheduler_attrs(self, *args, **kwargs):
    """BEFORE Scheduler.__init__: set the scheduler-only ATTR rows of this process's table."""
    hooks.apply_attrs(tuple(h for h in _active if h.process == "scheduler"))
    return None
