"""Counting and scaling the allocator state machines, for the isolation suite, which runs them as
part of its `ci` and `thorough` profiles (glm53_serving/suite/allocator.py) and reports the steps.

GLM53_SUITE_STEPS_FILE: each machine run appends its step count (one line) there.
GLM53_SUITE_STEP_SCALE: the machines' max_examples times this (default 1: the unit suite's)."""

import os

from hypothesis.stateful import invariant

STEPS_FILE = os.environ.get("GLM53_SUITE_STEPS_FILE")
SCALE = float(os.environ.get("GLM53_SUITE_STEP_SCALE", "1"))


def examples(n: int) -> int:
    return max(1, round(n * SCALE))


class CountedSteps:
    """Mixin for a RuleBasedStateMachine: Hypothesis checks invariants once before the first
    step and after every step, so steps = checks - 1."""

    _checks = 0

    @invariant()
    def _count_step(self):
        self._checks += 1

    def teardown(self):
        if STEPS_FILE:
            with open(STEPS_FILE, "a") as f:
                f.write(f"{type(self).__name__} {max(0, self._checks - 1)}\n")
        super().teardown()
