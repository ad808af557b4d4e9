"""Zero before reuse, on the real SGLang allocators and pools (CPU), by stateful property test.

The state machines drive SGLang's real allocator methods (alloc, alloc_extend, free) with the
plugin's "zero" rows applied by SGLang's own HookRegistry, as in a server (tests/unit/real_hooks.py;
tests/e2e/test_kv_guard.py proves the wiring in a server), so random alloc/write/free sequences
run thousands of times through exactly what a server runs."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MHATokenToKVPool

from glm53_serving import kv_zero
from glm53_serving.bench import pools
from glm53_serving.models import dsa_tiny
from tests.unit import real_hooks
from tests.unit.machine_steps import CountedSteps, examples

zero_hooks = pytest.fixture(real_hooks.fixture(("zero",)))

SIZE, LAYERS = 64, 3
DSA_PAGE = pools.PAGE  # the only page size DSA takes


def make(page_size, dsa=False):
    if dsa:  # GLM-5.x's pool: MLA latent rows plus the DSA indexer's per-page key and scale rows
        pool = pools.dsa_pool(4 * DSA_PAGE, LAYERS, dsa_tiny.CONFIG, torch.bfloat16)
        return pool, PagedTokenToKVPoolAllocator(4 * DSA_PAGE, DSA_PAGE, torch.bfloat16, "cpu", pool, False)
    pool = MHATokenToKVPool(SIZE, page_size, torch.float32, 2, 4, LAYERS, "cpu", False)
    if page_size == 1:
        return pool, TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", pool, False)
    return pool, PagedTokenToKVPoolAllocator(SIZE, page_size, torch.float32, "cpu", pool, False)


def slot_views(pool, slots) -> list[tuple[torch.Tensor, tuple]]:
    """(tensor, index) pairs addressing everything `slots` own in `pool`: each layer buffer's rows
    and, for DSA, each indexer layer's key and scale bytes (IndexKeyCache's page layout)."""
    views = [(buf, (slots,)) for buf in kv_zero.layer_buffers(pool)]
    if isinstance(pool, DSATokenToKVPool):
        p, key_bytes = pool.page_size, pool.page_size * pool.index_head_dim
        for buf in pool.index_key_cache.buffer:
            for part in (buf[:, :key_bytes], buf[:, key_bytes:]):
                views.append((part.view(buf.shape[0], p, -1), (slots // p, slots % p)))
    return views


class ZeroBeforeReuse(CountedSteps, RuleBasedStateMachine):
    page_size, dsa, max_alloc = 1, False, 24

    def __init__(self):
        super().__init__()
        self.pool, self.alloc = make(self.page_size, self.dsa)
        self.size = self.alloc.size
        self.held: list[torch.Tensor] = []  # allocations of live "requests"

    def _check_fresh(self, slots):
        for t, idx in slot_views(self.pool, slots):
            assert torch.count_nonzero(t[idx]) == 0, "a newly allocated slot holds a previous owner's KV"

    @rule(n=st.integers(1, 24))
    def allocate_and_write(self, n):
        n = (n % 3 + 1) * self.page_size if self.dsa else n  # DSA: 1-3 of its 4 pages of 64 slots
        need = -(-n // self.page_size) * self.page_size
        slots = self.alloc.alloc(need)  # zeroed by the applied hook, as in a server
        if slots is None:
            return
        self._check_fresh(slots)
        for t, idx in slot_views(self.pool, slots):  # the request writes its KV (a recognisable value)
            t[idx] = 7
        self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.alloc.free(self.held.pop(i % len(self.held)))

    @invariant()
    def nothing_leaks(self):
        used = sum(int(s.numel()) for s in self.held)
        assert used + self.alloc.available_size() == self.size
        live = torch.cat(self.held) if self.held else torch.empty(0, dtype=torch.int64)
        assert live.unique().numel() == live.numel(), "a slot is held by two owners"


class ZeroBeforeReusePaged(ZeroBeforeReuse):
    page_size = 4


class ZeroBeforeReuseDSA(ZeroBeforeReuse):
    page_size, dsa = DSA_PAGE, True


def _case(machine, **kw):
    case = pytest.mark.usefixtures("zero_hooks")(machine.TestCase)
    case.settings = settings(deadline=None, **kw)
    return case


TestZeroBeforeReuse = _case(ZeroBeforeReuse, max_examples=examples(150), stateful_step_count=40)
TestZeroBeforeReusePaged = _case(ZeroBeforeReusePaged, max_examples=examples(150), stateful_step_count=40)
TestZeroBeforeReuseDSA = _case(ZeroBeforeReuseDSA, max_examples=examples(60), stateful_step_count=20)


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
    kv_zero.zero_slots(pool, torch.arange(1, 9))  # a decode step's few slots: one indexed fill per layer
    assert calls == ["index_fill_"] * LAYERS  # K and V are halves of one allocation per layer: one fill
    calls.clear()
    monkeypatch.setattr(kv_zero, "SMALL_ALLOC", 16)
    kv_zero.zero_slots(pool, torch.arange(1, 41))  # one contiguous run: one slice fill per layer
    assert calls == ["zero_"] * LAYERS
    calls.clear()
    kv_zero.zero_slots(pool, torch.arange(1, 61, 3))  # 20 runs: one indexed fill per layer
    assert calls == ["index_fill_"] * LAYERS
    for buf in kv_zero.layer_buffers(pool):
        assert torch.count_nonzero(buf[torch.arange(1, 61, 3)]) == 0


def test_unsupported_allocators_and_pools_are_refused():
    pool, alloc = make(1)
    assert kv_zero.allocator_problems(alloc) == []

    class SomeOtherAllocator(TokenToKVPoolAllocator):
        pass

    other = SomeOtherAllocator(SIZE, torch.float32, "cpu", pool, False)
    (msg,) = kv_zero.allocator_problems(other)
    assert "SomeOtherAllocator" in msg and "refused" in msg
    with pytest.raises(TypeError):
        kv_zero.layer_buffers(object())


def test_pools_not_indexed_by_token_slot_are_refused(monkeypatch):
    # HND leads with pages: zeroing "row = slot" there would clear another page's KV and leave
    # the allocated one stale.
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    pool = MHATokenToKVPool(SIZE, 4, torch.float32, 2, 4, LAYERS, "cpu", False)
    assert pool.kv_cache_layout == "hnd"
    (msg,) = kv_zero.allocator_problems(PagedTokenToKVPoolAllocator(SIZE, 4, torch.float32, "cpu", pool, False))
    assert "'hnd'" in msg and "refused" in msg


def test_dsa_zeroing_clears_exactly_the_slots_in_every_buffer_and_indexer_layer():
    pool, alloc = make(DSA_PAGE, dsa=True)
    assert kv_zero.allocator_problems(alloc) == []
    every = [t for t, _ in slot_views(pool, torch.arange(0))]
    for t in every:
        t.fill_(1)
    slots = torch.tensor([65, 127, 130])  # continuing pages 1 and 2 (no first slot: none opened)
    kv_zero.zero_slots(pool, slots)
    for t, idx in slot_views(pool, slots):
        assert torch.count_nonzero(t[idx]) == 0
    # ... and nothing else: each buffer lost exactly 3 slots' worth of bytes
    for t, idx in slot_views(pool, slots):
        assert t.numel() - torch.count_nonzero(t) == t[idx].numel()


def test_dsa_indexer_layouts_other_than_the_plain_one_are_refused():
    pool, alloc = make(DSA_PAGE, dsa=True)
    pool.index_kpool = 2  # pooled index keys: rows regroup tokens, slot -> byte offset differs
    (msg,) = kv_zero.allocator_problems(alloc)
    assert "index_kpool 2" in msg and "refused" in msg


def test_dsa_pages_covered_whole_are_zeroed_as_pages_and_partial_pages_slot_by_slot(monkeypatch):
    """Pages 1 and 3 whole (as one run each: memset speed), two slots of page 2: exactly these
    slots lose their bytes, in the latent and in the index-K keys and scales; page 2's other 62
    slots (another request's tokens, in a real pool) keep theirs."""
    pool, _ = make(DSA_PAGE, dsa=True)
    for t, _ in slot_views(pool, torch.arange(0)):
        t.fill_(1)
    as_pages = []
    real = kv_zero._zero_pages
    monkeypatch.setattr(
        kv_zero, "_zero_pages", lambda p, pages, size: as_pages.append(pages.tolist()) or real(p, pages, size)
    )
    slots = torch.cat([torch.arange(192, 256), torch.tensor([130, 131]), torch.arange(64, 128)])
    kv_zero.zero_slots(pool, slots)
    assert as_pages == [[1, 3]]
    for t, idx in slot_views(pool, slots):
        assert torch.count_nonzero(t[idx]) == 0
        assert t.numel() - torch.count_nonzero(t) == t[idx].numel()  # nothing else was touched


@pytest.mark.parametrize("min_run_bytes", [0, 1 << 40], ids=["runs-as-slices", "indexed-fill"])
def test_dsa_whole_pages_lose_every_byte_latent_keys_and_scales_by_either_fill(monkeypatch, min_run_bytes):
    """Pages 1, 2 and 4 (runs [1, 3) and [4, 5)), zeroed both ways _zero_page_rows can (runs as
    slices, all in one _foreach_zero_; one indexed fill of the page rows as 16-byte words):
    every byte of the three pages goes, in the latent and in the index-K keys and scales (the
    scales are the tail of each indexer page row), and nothing else."""
    monkeypatch.setattr(kv_zero, "MIN_RUN_BYTES", min_run_bytes)
    pool, _ = make(DSA_PAGE, dsa=True)
    for t, _ in slot_views(pool, torch.arange(0)):
        t.fill_(1)
    slots = torch.cat([torch.arange(64, 192), torch.arange(256, 320)])
    kv_zero.zero_slots(pool, slots)
    for t, idx in slot_views(pool, slots):
        assert torch.count_nonzero(t[idx]) == 0
        assert t.numel() - torch.count_nonzero(t) == t[idx].numel()  # nothing else was touched


def test_a_page_an_allocation_opens_is_zeroed_whole_its_unwritten_tail_too():
    """A prompt of 130 tokens opens pages 1, 2 and 3 and gets 2 slots of page 3 (its other 62
    are the request's later decode steps'): page 3 is zeroed whole, latent and index-K, so
    nothing of its previous owner stays in it (a PD transfer copies whole pages: a stale tail
    would reach decode). A decode step continuing page 3 zeroes only its own slot."""
    pool, _ = make(DSA_PAGE, dsa=True)
    for t, _ in slot_views(pool, torch.arange(0)):
        t.fill_(1)
    kv_zero.zero_slots(pool, torch.arange(64, 64 + 130))
    for t, idx in slot_views(pool, torch.arange(64, 256)):
        assert torch.count_nonzero(t[idx]) == 0
        assert t.numel() - torch.count_nonzero(t) == t[idx].numel()  # pages 1-3, nothing else
    for t, _ in slot_views(pool, torch.arange(0)):
        t.fill_(1)
    kv_zero.zero_slots(pool, torch.tensor([194]))  # a decode step continuing page 3
    for t, idx in slot_views(pool, torch.tensor([194])):
        assert torch.count_nonzero(t[idx]) == 0
        assert t.numel() - torch.count_nonzero(t) == t[idx].numel()


def test_on_a_gpu_a_decode_steps_opened_pages_become_indices_without_a_host_sync():
    # Two requests' decode slots: 128 opens page 2, 70 continues page 1.
    widened = kv_zero._with_opened_pages(torch.tensor([128, 70]), DSA_PAGE)
    assert sorted(set(widened.tolist())) == [70, *range(128, 192)]


@pytest.mark.usefixtures("zero_hooks")
def test_a_decode_step_zeroes_the_pages_it_opens_whole_and_touches_nothing_else(monkeypatch):
    """SGLang's alloc_decode, hooked: request A continues its page 1 (position 10), request B,
    its page 2 full, opens a free page. B's new page loses every byte, latent and index-K keys
    and scales; A's slot is not zeroed again (its page was zeroed whole when A's allocation
    opened it; what is there now is A's own, marked 3 here), nor is anything else. A step where
    every row continues its page makes no op on the pool at all (63 in 64 steps)."""
    pool, alloc = make(DSA_PAGE, dsa=True)
    held = alloc.alloc(2 * DSA_PAGE)  # pages for A and B; the pool's other 2 pages are free
    for t, _ in slot_views(pool, torch.arange(0)):
        t.fill_(1)  # what earlier owners left, everywhere
    page_a, page_b = sorted((held // DSA_PAGE).unique().tolist())
    a_next = page_a * DSA_PAGE + 10
    for t, idx in slot_views(pool, torch.tensor([a_next])):
        t[idx] = 3
    seq_lens = torch.tensor([11, DSA_PAGE + 1])  # with the new token
    last_loc = torch.tensor([a_next - 1, page_b * DSA_PAGE + DSA_PAGE - 1])
    out = alloc.alloc_decode(seq_lens, seq_lens.clone(), last_loc)
    assert int(out[0]) == a_next and int(out[1]) % DSA_PAGE == 0
    opened = torch.arange(int(out[1]), int(out[1]) + DSA_PAGE)
    for t, idx in slot_views(pool, opened):
        assert torch.count_nonzero(t[idx]) == 0, "the page B's step opened holds a previous owner's bytes"
        assert t.numel() - torch.count_nonzero(t) == t[idx].numel(), "zeroed beyond the opened page"
    for t, idx in slot_views(pool, torch.tensor([a_next])):
        assert bool((t[idx] == 3).all()), "A's own page was zeroed again"

    calls = []
    for name in ("index_fill_", "zero_", "_foreach_zero_", "__setitem__"):
        real = getattr(torch.Tensor, name, None) or getattr(torch, name)
        target = torch.Tensor if hasattr(torch.Tensor, name) else torch
        monkeypatch.setattr(target, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    seq_lens = torch.tensor([12, DSA_PAGE + 2])
    alloc.alloc_decode(seq_lens, seq_lens.clone(), torch.tensor([a_next, int(out[1])]))
    assert calls == [], f"a step that opens no page made {calls} on the pool"
