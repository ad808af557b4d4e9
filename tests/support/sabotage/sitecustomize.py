"""Test harness, never installed: simulates SGLang drift by making HookRegistry fail on one target.

Put this directory on PYTHONPATH and set GLM53_TEST_BREAK_HOOK to a hook target: in every
process (spawned SGLang children inherit both), applying hooks to that target then fails the way
a renamed or moved upstream symbol does, and SGLang merely logs it. The server must refuse to start.
"""

import os

_broken = os.environ.get("GLM53_TEST_BREAK_HOOK")
if _broken:
    from sglang.srt.plugins.hook_registry import HookRegistry

    _orig = HookRegistry._apply_target.__func__

    def _apply_target(cls, target, hooks):
        if target == _broken:
            raise AttributeError(f"simulated upstream drift: {target} does not exist")
        return _orig(cls, target, hooks)

    HookRegistry._apply_target = classmethod(_apply_target)
