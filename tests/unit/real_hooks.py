"""The plugin's real hook rows applied in a unit test process, and taken off again.

Unit tests of the KV guard drive SGLang's real allocators (alloc, alloc_extend, free,
free_page_ids, free groups, clear) with the rows of hooks.HOOKS applied by SGLang's own
HookRegistry, exactly as in a server, instead of calling our hook functions by hand."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable

from glm53_serving import hooks

ALLOCATOR_CLASSES = ("TokenToKVPoolAllocator.", "PagedTokenToKVPoolAllocator.")
# The scheduler's batch-build entry points (ScheduleBatch.prepare_for_extend / prepare_for_decode
# call them through their own `from ... import` binding, which HookRegistry re-points too).
BATCH_ENTRY_POINTS = (
    "sglang.srt.mem_cache.allocation.alloc_for_extend",
    "sglang.srt.mem_cache.allocation.alloc_for_decode",
)


def allocator_rows(parts: tuple[str, ...]) -> tuple[hooks.Hook, ...]:
    """The rows on the allocators' own methods for these KV guard parts."""
    return tuple(h for h in hooks.HOOKS if h.part in parts and any(c in h.target for c in ALLOCATOR_CLASSES))


def batch_rows(parts: tuple[str, ...]) -> tuple[hooks.Hook, ...]:
    """The allocator rows plus the rows on the batch-build entry points for these parts."""
    return allocator_rows(parts) + tuple(h for h in hooks.HOOKS if h.part in parts and h.target in BATCH_ENTRY_POINTS)


@contextlib.contextmanager
def applied(rows: tuple[hooks.Hook, ...]):
    from sglang.srt.plugins.hook_registry import HookRegistry

    saved = []
    for h in rows:
        owner, attr = h.target.rsplit(".", 1)
        import pkgutil

        cls = pkgutil.resolve_name(owner)
        saved.append((cls, attr, cls.__dict__[attr]))
    HookRegistry.reset()
    hooks.register(rows)
    HookRegistry.apply_hooks()
    missing = hooks.verify_applied(rows, process="scheduler")
    if missing:
        raise RuntimeError(f"hooks did not apply: {missing}")
    try:
        yield
    finally:
        for cls, attr, raw in saved:
            wrapped = cls.__dict__[attr]
            setattr(cls, attr, raw)
            if isinstance(cls, types.ModuleType):  # HookRegistry also re-pointed every importer's binding
                for mod in list(sys.modules.values()):
                    if isinstance(mod, types.ModuleType) and vars(mod).get(attr) is wrapped:
                        setattr(mod, attr, raw)
        HookRegistry.reset()


def fixture(parts: tuple[str, ...], rows: Callable = allocator_rows) -> Callable:
    """A pytest fixture body applying the rows of `parts` (by default the allocator rows) for one test."""

    def body():
        with applied(rows(parts)):
            yield

    return body
