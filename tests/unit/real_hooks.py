"""The plugin's real hook rows applied in a unit test process, and taken off again.

Unit tests of the KV guard drive SGLang's real allocators (alloc, alloc_extend, free,
free_page_ids, free groups, clear) with the rows of hooks.HOOKS applied by SGLang's own
HookRegistry, exactly as in a server, instead of calling our hook functions by hand."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from glm53_serving import hooks

ALLOCATOR_CLASSES = ("TokenToKVPoolAllocator.", "PagedTokenToKVPoolAllocator.")


def allocator_rows(parts: tuple[str, ...]) -> tuple[hooks.Hook, ...]:
    """The rows on the allocators' own methods for these KV guard parts."""
    return tuple(h for h in hooks.HOOKS if h.part in parts and any(c in h.target for c in ALLOCATOR_CLASSES))


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
            setattr(cls, attr, raw)
        HookRegistry.reset()


def fixture(parts: tuple[str, ...]) -> Callable:
    """A pytest fixture body applying the allocator rows of `parts` for one test."""

    def body():
        with applied(allocator_rows(parts)):
            yield

    return body
