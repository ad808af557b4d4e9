"""Zero before reuse, on the real SGLang allocators and pools (CPU), by stateful property test.

The hook function is exactly what HookRegistry wraps around the allocation methods in a server
(tests/e2e/test_kv_guard.py proves the wiring); here it wraps them by hand so that random
alloc/write/free sequences can run thousands of times."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from glm53_serving import kv_guard
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

SIZE, LAYERS = 64, 3


def make(page_size):
    pool = MHATokenToKVPool(SIZE, page_size, torch.float32, 2, 4, LAYERS, "cpu", False)
    if page_size == 1:
        return pool, TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", pool, False)
    return pool, PagedTokenToKVPoolAllocator(SIZE, page_size, torch.float32, "cpu", pool, False)


class ZeroBeforeReuse(RuleBasedStateMachine):
    page_size = 1

    def __init__(self):
        super().__init__()
        self.pool, self.alloc = make(self.page_size)
        self.held: list[torch.Tensor] = []  # allocations of live "requests"

    def _check_fresh(self, slots):
        for buf in kv_guard.layer_buffers(self.pool):
            assert torch.count_nonzero(buf[slots]) == 0, "a newly allocated slot holds a previous owner's KV"

    @rule(n=st.integers(1, 24))
    def allocate_and_write(self, n):
        need = -(-n // self.page_size) * self.page_size
        slots = kv_guard.zero_after_alloc(self.alloc.alloc(need), self.alloc, need)
        if slots is None:
            return
        self._check_fresh(slots)
        for buf in kv_guard.layer_buffers(self.pool):  # the request writes its KV (a recognisable value)
            buf[slots] = 7.0
        self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.alloc.free(self.held.pop(i % len(self.held)))

    @invariant()
    def nothing_leaks(self):
        used = sum(int(s.numel()) for s in self.held)
        assert used + self.alloc.available_size() == SIZE
        live = torch.cat(self.held) if self.held else torch.empty(0, dtype=torch.int64)
        assert live.unique().numel() == live.numel(), "a slot is held by two owners"


class ZeroBeforeReusePaged(ZeroBeforeReuse):
    page_size = 4


TestZeroBeforeReuse = ZeroBeforeReuse.TestCase
TestZeroBeforeReuse.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestZeroBeforeReusePaged = ZeroBeforeReusePaged.TestCase
TestZeroBeforeReusePaged.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_without_the_guard_a_reused_slot_holds_the_previous_owners_kv():
    # The failure the guard exists for, on the unguarded upstream allocator: proves the
    # property test above can fail.
    pool, alloc = make(1)
    a = alloc.alloc(8)
    pool.k_buffer[0][a] = 7.0
    alloc.free(a)
    b = alloc.alloc(SIZE)
    assert torch.count_nonzero(pool.k_buffer[0][b]) > 0


def test_zeroing_is_batched_per_buffer_never_a_loop_per_slot(monkeypatch):
    pool, alloc = make(1)
    calls = []
    for name in ("index_fill_", "zero_"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _r=real: calls.append(_n) or _r(self, *a))
    kv_guard.zero_slots(pool, torch.arange(1, 9))  # a decode step's few slots: one indexed fill per buffer
    assert calls == ["index_fill_"] * (2 * LAYERS)
    calls.clear()
    monkeypatch.setattr(kv_guard, "SMALL_ALLOC", 16)
    kv_guard.zero_slots(pool, torch.arange(1, 41))  # one contiguous run: one slice fill per buffer
    assert calls == ["zero_"] * (2 * LAYERS)
    calls.clear()
    kv_guard.zero_slots(pool, torch.arange(1, 61, 3))  # 20 runs: one indexed fill per buffer
    assert calls == ["index_fill_"] * (2 * LAYERS)
    for buf in kv_guard.layer_buffers(pool):
        assert torch.count_nonzero(buf[torch.arange(1, 61, 3)]) == 0


def test_unsupported_allocators_and_pools_are_refused():
    pool, alloc = make(1)
    assert kv_guard.allocator_problems(alloc) == []

    class SomeOtherAllocator(TokenToKVPoolAllocator):
        pass

    other = SomeOtherAllocator(SIZE, torch.float32, "cpu", pool, False)
    (msg,) = kv_guard.allocator_problems(other)
    assert "SomeOtherAllocator" in msg and "refused" in msg
    with pytest.raises(TypeError):
        kv_guard.layer_buffers(object())
