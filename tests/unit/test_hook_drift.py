"""Every target in glm53_serving.hooks.HOOKS still exists in the pinned SGLang, with the parameters we use."""

import inspect
from importlib.metadata import version

import pytest

from glm53_serving import hooks


def test_pinned_sglang_version():
    assert version("sglang") == "0.5.23"
    assert version("sglang-router") == "0.3.2"


@pytest.mark.parametrize("hook", hooks.HOOKS, ids=lambda h: h.target)
def test_target_exists_with_expected_signature(hook):
    current = hooks.resolve_target(hook.target)
    if hook.kind is hooks.Kind.ATTR:
        # An attribute we override must still be an attribute of that type upstream.
        assert type(current) is type(hook.value), (hook.target, current)
        return
    original = inspect.unwrap(current)
    params = tuple(inspect.signature(original).parameters)
    assert params[: len(hook.params)] == hook.params, f"{hook.target}: upstream parameters are now {params}"


@pytest.mark.parametrize("hook", [h for h in hooks.HOOKS if h.impl], ids=lambda h: h.target)
def test_impl_resolves(hook):
    assert callable(hook.resolve_impl())


def test_table_is_the_single_source():
    targets = [h.target for h in hooks.HOOKS]
    assert len(targets) == len(set(targets)), "one row per target: merge hooks on the same target"


def test_verify_applied_reports_unapplied_rows():
    # In this test process nothing was registered: every callable row must be reported missing.
    callable_rows = tuple(h for h in hooks.HOOKS if h.kind is not hooks.Kind.ATTR)
    missing = hooks.verify_applied(callable_rows)
    assert len(missing) == len(callable_rows)
    assert all("is not applied" in m for m in missing)


def test_verify_applied_reports_unresolvable_target():
    bogus = hooks.Hook(
        "sglang.srt.no_such_module.fn", hooks.Kind.AFTER, "glm53_serving.startup:scheduler_verified_info", (), "test"
    )
    (line,) = hooks.verify_applied((bogus,))
    assert "cannot resolve" in line


@pytest.mark.parametrize("name", hooks.INTERNALS)
def test_every_internal_we_use_outside_the_table_resolves(name):
    import pkgutil

    pkgutil.resolve_name(name.rsplit(".", 1)[0] + ":" + name.rsplit(".", 1)[1])


@pytest.mark.parametrize("cls_name", sorted(hooks.INTERNAL_ATTRS))
def test_every_attribute_we_touch_on_sglang_objects_exists_and_ours_do_not_collide(cls_name):
    import pkgutil
    import re

    cls = pkgutil.resolve_name(cls_name)
    source = "".join(inspect.getsource(k) for k in cls.__mro__ if k.__module__.startswith("sglang"))
    missing = [
        a
        for a in hooks.INTERNAL_ATTRS[cls_name]
        if not hasattr(cls, a) and not re.search(rf"self\.{a}\b|^\s+{a}\s*:", source, re.M)
    ]
    assert not missing, f"{cls_name} no longer has {missing}"
    assert "_glm53" not in source  # the attributes we stamp cannot shadow upstream ones
