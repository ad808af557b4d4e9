"""Owner tags and the read check, on the real SGLang scheduler objects (CPU), by stateful property test.

Every allocation is a real batch build: real `Req`s in a real `ScheduleBatch` (init_new) over a
real ReqToTokenPool, allocator, pool and RadixCache; `prepare_for_extend` / `prepare_for_decode`
call SGLang's `alloc_for_extend` / `alloc_for_decode`, and the plugin's "zero" and "owner" rows on
those and on the allocators are applied by SGLang's own HookRegistry, as in a server
(tests/unit/real_hooks.py). So the tags are set, checked and reset because SGLang called the
hooks; the tests call no hook function. Random multi-owner extend/decode/prefix-share/evict/free
sequences release through the allocator's real `free`, `free_page_ids` and free groups; faults
(a foreign index in a row) are injected into the row or into SGLang's own row writer and prefix
match, and the next real batch build must catch them."""

import logging
from array import array
from types import SimpleNamespace

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from glm53_serving import kv_owner, kv_zero
from tests.unit import real_hooks
from tests.unit.machine_steps import CountedSteps, examples

kv_hooks = pytest.fixture(autouse=True)(real_hooks.fixture(("zero", "owner"), real_hooks.batch_rows))

SIZE, LAYERS, ROWS, MAXLEN = 64, 2, 12, 48
NAMESPACES = [(None, None), ("tenant-a", None), ("tenant-b", None), (None, "lora-x")]  # (cache_salt, extra_key)
OWNERS = [kv_owner.namespace_id(*ns) for ns in NAMESPACES]


def make(page_size, mla=False):
    if mla:
        pool = MLATokenToKVPool(SIZE, page_size, torch.float32, 16, 8, LAYERS, "cpu", False)
    else:
        pool = MHATokenToKVPool(SIZE, page_size, torch.float32, 2, 4, LAYERS, "cpu", False)
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", pool, False)
    else:
        alloc = PagedTokenToKVPoolAllocator(SIZE, page_size, torch.float32, "cpu", pool, False)
    return pool, alloc


FREES = ("free", "free_page_ids", "group")


def free(alloc, slots, how="free"):
    """Give `slots` back through one of the allocator's real free paths (hooks applied)."""
    if how == "free":
        alloc.free(slots)
    elif how == "free_page_ids":
        alloc.free_page_ids(torch.unique(slots // alloc.page_size))
    else:  # a free group, as the scheduler frees a batch's finished requests
        alloc.free_group_begin()
        half = slots.numel() // 2
        alloc.free(slots[:half])
        alloc.free(slots[half:])
        alloc.free_group_end()


def test_namespace_ids_are_stable_nonzero_and_distinct():
    assert kv_owner.namespace_id(None, None) == kv_owner.DEFAULT_NAMESPACE == 1
    assert len(set(OWNERS)) == len(OWNERS) and all(0 < o < 2**63 for o in OWNERS)
    assert kv_owner.namespace_id("tenant-a", None) == OWNERS[1]  # stable across calls
    assert kv_owner.namespace_id("a", "b") != kv_owner.namespace_id("b", "a")


def test_namespace_ids_are_stable_across_processes():
    """Prefill and decode are different processes: one namespace must be one owner id in both."""
    import subprocess
    import sys

    code = "from glm53_serving import kv_owner; print(kv_owner.namespace_id('tenant-a', None), kv_owner.namespace_id(None, 'lora-x'))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin"},
        ).stdout
        for seed in ("0", "1", "random")
    }
    assert runs == {f"{OWNERS[1]} {OWNERS[3]}\n"}


class _Flagged(logging.Handler):
    """Collects the row positions of each KV isolation violation the plugin logs."""

    def __init__(self, into):
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record):
        if "KV isolation violation" in record.msg:
            self.into.append(list(record.args[4]))


# --- real batch builds ---------------------------------------------------------------------
#
# A real ScheduleBatch (ScheduleBatch.init_new) over a real ReqToTokenPool, allocator, pool and
# RadixCache, with real Reqs, built the way the scheduler builds one: Req.init_next_round_input
# (the prefix match), then prepare_for_extend / prepare_for_decode, which call SGLang's
# alloc_for_extend / alloc_for_decode; the plugin's rows on those (and on the allocators) are
# applied by HookRegistry, so the tagging and the check run because SGLang called them.
# Two stand-ins: ModelConfig needs a Hugging Face model, and a batch build reads only
# `vocab_size` (init_new, the sampling info) and `is_encoder_decoder` of it; the runtime
# context (speculative algorithm, attention backend) is published from a default ServerArgs
# (model_path "dummy": SGLang looks nothing up for it).
MODEL = SimpleNamespace(vocab_size=32, is_encoder_decoder=False)


@pytest.fixture(scope="module", autouse=True)
def scheduler_context():
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", device="cpu", attention_backend="torch_native")
    with runtime_context.use_context(runtime_context.create_context(args, role="scheduler")):
        yield


class Scheduler:
    """The scheduler's memory: a real ReqToTokenPool, allocator and pool, a real RadixCache."""

    def __init__(self, page_size, mla=False, radix=True):
        self.pool, self.alloc = make(page_size, mla)
        self.req_to_token_pool = ReqToTokenPool(ROWS - 1, MAXLEN, "cpu", False)
        self.tree = RadixCache(
            CacheInitParams(
                disable=not radix,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.alloc,
                page_size=page_size,
            )
        )

    @property
    def r2t(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token

    def extend(self, reqs, matched=True) -> ScheduleBatch:
        for r in reqs:
            if matched:
                r.init_next_round_input(self.tree)  # the prefix match
            r.extend_end = len(r.full_untruncated_fill_ids)  # PrefillAdder, for an unchunked request
        batch = ScheduleBatch.init_new(
            reqs, self.req_to_token_pool, self.alloc, self.tree, MODEL, False, SpeculativeAlgorithm.NONE
        )
        batch.prepare_for_extend()  # -> alloc_for_extend, hooked
        return batch

    def row(self, req, n=None) -> torch.Tensor:
        return self.r2t[req.kv.req_pool_idx, : n if n is not None else req.kv.kv_allocated_len].to(torch.int64)


class OwnerTags(CountedSteps, RuleBasedStateMachine):
    """Requests of several namespaces extend, decode, share cached prefixes, finish and are
    evicted; every allocation is a real batch build (prepare_for_extend / prepare_for_decode ->
    alloc_for_extend / alloc_for_decode, hooked), so the plugin tags and checks because SGLang
    called it. A shared prefix is presented the way a request that holds its row presents it
    (alloc_for_extend reads row[:prefix_len] of a request that holds its row): the machine keeps
    the namespaced prefix cache itself (the RadixCache is off), so that eviction and release can
    take each of the allocator's free paths."""

    page_size = 1
    mla = False

    def __init__(self):
        super().__init__()
        self.s = Scheduler(self.page_size, self.mla, radix=False)
        self.pool, self.alloc, self.r2t = self.s.pool, self.s.alloc, self.s.r2t
        self.p = self.alloc.page_size
        self.live: dict[int, dict] = {}  # row -> {"req", "batch", "owner", "len", "shared", "prefix"}
        self.cache: list[dict] = []  # cached prefixes: {"owner", "slots", "users"}
        self.n = 0
        self.flagged: list[list[int]] = []  # positions of each violation the plugin logged
        self._log = _Flagged(self.flagged)
        logging.getLogger("glm53_serving").addHandler(self._log)

    def teardown(self):
        logging.getLogger("glm53_serving").removeHandler(self._log)
        super().teardown()

    # -- helpers ------------------------------------------------------------------------------
    def _row(self, row, n):
        return self.r2t[row, :n].to(torch.int64)

    def _fresh_reads_zero(self, slots):
        for buf in kv_zero.layer_buffers(self.pool):
            assert torch.count_nonzero(buf[slots]) == 0, "a page given to a new owner holds a previous owner's KV"

    def _write(self, slots, owner):
        for buf in kv_zero.layer_buffers(self.pool):
            buf[slots] = float(owner % 1000 + 1)

    def _release(self, row, how):
        """The request's release: the slots of its row it holds go back through `how`, its row too."""
        r = self.live.pop(row)
        own = self._row(row, r["len"])[r["shared"] :]
        if r["prefix"] is not None:
            r["prefix"]["users"] -= 1
        if own.numel():
            free(self.alloc, own, how)
        self.s.req_to_token_pool.free(r["req"])

    def _page_decode_opens(self, n):
        """The free page a decode step at row length n takes (the head of the allocator's free
        list, both allocators), or None when it continues the row's last page. Read before the
        step: after it, a caught request's out_cache_loc follows its repaired row."""
        if n % self.p:
            return None
        if not len(self.alloc.free_pages):
            self.alloc.merge_and_sort_free()
        return int(self.alloc.free_pages[0])

    # -- rules --------------------------------------------------------------------------------
    @precondition(lambda self: self.s.req_to_token_pool.available_size())
    @rule(ns=st.sampled_from(NAMESPACES), n=st.integers(1, 24), share=st.booleans())
    def extend(self, ns, n, share):
        owner = kv_owner.namespace_id(*ns)
        prefix = next((c for c in self.cache if c["owner"] == owner), None) if share else None
        pre = prefix["slots"] if prefix is not None else torch.empty(0, dtype=torch.int64)
        total = pre.numel() + n
        if total > MAXLEN or self.alloc.available_size() < n + self.p:
            return
        self.n += 1
        req = Req(f"r{self.n}", "", array("q", [5] * total), SamplingParams(), cache_salt=ns[0], extra_key=ns[1])
        req.init_next_round_input(self.s.tree)  # the cache is off: no match, fill ids set
        if prefix is not None:  # the request holds its row, its prefix in it (and does not free it)
            self.s.req_to_token_pool.alloc([req])
            self.r2t[req.kv.req_pool_idx, : pre.numel()] = pre.to(torch.int32)
            req.prefix_len = req.kv.cache_protected_len = pre.numel()
            req.kv.kv_allocated_len = req.kv.kv_committed_len = pre.numel()
        batch = self.s.extend([req], matched=False)
        new = batch.out_cache_loc
        row = req.kv.req_pool_idx
        self._fresh_reads_zero(new)
        assert req.to_finish is None, "an owner failed the check on its own pages"
        assert torch.equal(self._row(row, total)[pre.numel() :], new.to(torch.int64))
        self._write(new, owner)
        if prefix is not None:
            prefix["users"] += 1
        self.live[row] = {
            "req": req,
            "batch": batch,
            "owner": owner,
            "len": total,
            "shared": pre.numel(),
            "prefix": prefix,
        }

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100))
    def decode(self, pick):
        row = sorted(self.live)[pick % len(self.live)]
        r = self.live[row]
        if r["len"] >= MAXLEN or self.alloc.available_size() < self.p:
            return
        r["batch"].prepare_for_decode()
        new = r["batch"].out_cache_loc
        assert int(self.r2t[row, r["len"]]) == int(new[0])
        r["len"] += 1
        assert r["req"].to_finish is None, "an owner failed the check on its own pages"
        self._write(new, r["owner"])

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100), keep=st.booleans(), how=st.sampled_from(FREES))
    def finish(self, pick, keep, how):
        """Release a request; with `keep`, its whole pages become a cached prefix (the radix insert)."""
        row = sorted(self.live)[pick % len(self.live)]
        r = self.live[row]
        if keep and r["prefix"] is None:
            whole = r["len"] // self.p * self.p
            if whole:
                self.cache.append({"owner": r["owner"], "slots": self._row(row, whole).clone(), "users": 0})
                r["shared"] = whole  # no longer the request's to free
        self._release(row, how)

    @precondition(lambda self: any(c["users"] == 0 for c in self.cache))
    @rule(pick=st.integers(0, 100), how=st.sampled_from(FREES))
    def evict(self, pick, how):
        idle = [c for c in self.cache if c["users"] == 0]
        c = idle[pick % len(idle)]
        self.cache = [x for x in self.cache if x is not c]
        free(self.alloc, c["slots"], how)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100), pos=st.integers(0, MAXLEN - 1), other=st.integers(0, SIZE))
    def foreign_index_is_caught_and_stale_tail_is_ignored(self, pick, pos, other):
        """Poison one row position with another slot, then build the request's next decode batch:
        the check flags it (and only it) iff the position is inside the row's length and the
        slot's page is not the row owner's; a flagged request is aborted and released."""
        row = sorted(self.live)[pick % len(self.live)]
        r = self.live[row]
        n = r["len"]
        if n >= MAXLEN or self.alloc.available_size() < 2 * self.p:  # the decode's page and a quarantine page
            return
        if self.p > 1 and pos == n - 1 and n % self.p:
            # The position alloc_decode continues the row's last page from (last_loc): poisoned,
            # the allocator itself hands out the next slot of the poisoned page, a different
            # fault: test_a_foreign_last_position_is_caught_with_the_slot_the_decode_continues_it_with.
            return
        saved = self.r2t[row].clone()
        slot = other % (SIZE + self.p)  # any slot id, owned by anyone or free
        self.r2t[row, pos] = slot
        page_owner = int(kv_owner.tags_of(self.alloc)[slot // self.p])
        taken = self._page_decode_opens(n)
        flagged_before = len(self.flagged)
        r["batch"].prepare_for_decode()
        new = r["batch"].out_cache_loc
        r["len"] = n + 1
        if page_owner == kv_owner.FREE and slot // self.p == taken:
            page_owner = r["owner"]  # a free page this very decode took: the row's when the check ran
        caught = pos < n and page_owner != r["owner"]
        req = r["req"]
        if not caught:
            assert req.to_finish is None and len(self.flagged) == flagged_before
            saved[n] = new[0]  # the decode's slot; the poisoned position back as it was
            self.r2t[row] = saved
            self._write(new, r["owner"])
            return
        assert req.to_finish is not None and req.to_finish.err_type == "kv_isolation_violation"
        assert self.flagged[flagged_before:] == [[pos]], "only the poisoned position is flagged"
        # The quarantine re-pointed the poisoned logical page and does not free what it displaced
        # (it cannot trust it); what it displaced here is the request's own, so give it back.
        held = set((self._row(row, n + 1)[r["shared"] :] // self.p).tolist())
        displaced = set((saved[r["shared"] : n].to(torch.int64) // self.p).tolist()) - held
        if displaced:
            self.alloc.free_page_ids(torch.tensor(sorted(displaced), dtype=torch.int64))
        self._release(row, "free")

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def each_page_has_exactly_one_owner_or_is_free(self):
        tags = kv_owner.tags_of(self.alloc)
        expected = torch.zeros_like(tags)
        held = []
        for c in self.cache:
            held.append((c["slots"], c["owner"]))
        for row, r in self.live.items():
            held.append((self._row(row, r["len"])[r["shared"] :], r["owner"]))
        for slots, owner in held:
            pages = torch.unique(slots // self.p)
            assert ((expected[pages] == 0) | (expected[pages] == owner)).all(), "a page is held by two owners"
            expected[pages] = owner
        free_pages = self.alloc.get_all_free_pages()
        assert (tags[free_pages] == 0).all(), "a free page still carries an owner"
        assert torch.equal(tags, expected), "tags disagree with who holds the pages"

    @invariant()
    def no_page_leaks(self):
        used = sum(
            int(torch.unique(self._row(row, r["len"])[r["shared"] :] // self.p).numel()) for row, r in self.live.items()
        )
        used += sum(int(torch.unique(c["slots"] // self.p).numel()) for c in self.cache)
        assert used * self.p + self.alloc.available_size() == SIZE


class OwnerTagsPaged(OwnerTags):
    page_size = 4


class OwnerTagsMLA(OwnerTags):
    page_size = 4
    mla = True


_settings = settings(max_examples=examples(40), stateful_step_count=30, deadline=None)
TestOwnerTags = OwnerTags.TestCase
TestOwnerTags.settings = _settings
TestOwnerTagsPaged = OwnerTagsPaged.TestCase
TestOwnerTagsPaged.settings = _settings
TestOwnerTagsMLA = OwnerTagsMLA.TestCase
TestOwnerTagsMLA.settings = _settings


# --- the batch-level hooks and a violation ---------------------------------------------------


def _req(rid, salt, n=8):
    return Req(rid, "", array("q", [5] * n), SamplingParams(), cache_salt=salt)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_violation_aborts_only_that_request_and_its_forward_reads_zeros(page_size, caplog):
    s = Scheduler(page_size)
    a, b = _req("a", "tenant-a"), _req("victim-b", "tenant-b")
    batch = s.extend([a, b])
    assert a.to_finish is None and b.to_finish is None  # clean batch: nothing happens
    sa, sb = s.row(a), s.row(b)
    s.pool.k_buffer[0][sa] = 5.0
    s.pool.k_buffer[0][sb] = 5.0

    s.r2t[b.kv.req_pool_idx, 3] = int(sa[0])  # b's row now points at a's KV
    free_before = s.alloc.available_size()
    batch.prepare_for_decode()  # -> alloc_for_decode, hooked: the check runs before the forward
    decoded = torch.unique(batch.out_cache_loc // page_size).numel() * page_size
    assert a.to_finish is None, "a violation must abort only the request that would read foreign KV"
    assert b.to_finish.status_code == 500 and b.to_finish.err_type == "kv_isolation_violation"
    assert b.skip_radix_cache_insert
    row_b = s.row(b, 9)
    assert not torch.isin(row_b, sa).any(), "b's row still reaches a's pages"
    assert torch.count_nonzero(s.pool.k_buffer[0][row_b[3]]) == 0, "the redirected page must read zeros"
    assert not kv_owner.foreign(
        s.alloc,
        s.r2t,
        torch.tensor([b.kv.req_pool_idx]),
        torch.tensor([9]),
        MAXLEN,
        torch.tensor([kv_owner.owner_of(b)]),
    ).any()
    # one fresh page, owned by b, freed with it
    assert s.alloc.available_size() == free_before - decoded - page_size
    # The overlap scheduler builds one more batch with b before its abort lands: no second repair.
    free_before = s.alloc.available_size()
    batch.prepare_for_decode()
    decoded = sum(1 for n in (9, 9) if n % page_size == 0) * page_size
    assert s.alloc.available_size() == free_before - decoded
    assert "victim-b" in caplog.text and "KV isolation violation" in caplog.text
    assert bool((s.pool.k_buffer[0][sa] == 5.0).all()), "a's KV must be left untouched"


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_foreign_index_over_a_just_allocated_position_is_undone_without_leaking(page_size, monkeypatch):
    # The row position was filled by this very allocation: the repair puts back the slot the
    # allocator handed out (zeroed), so the request's release frees exactly what it holds.
    # The fault: SGLang's row writer (write_cache_indices, called by alloc_for_extend before
    # the hook runs) leaves one of a's live slots at b's position 0.
    from sglang.srt.mem_cache import allocation

    s = Scheduler(page_size)
    a, b = _req("a", "tenant-a"), _req("b", "tenant-b")
    s.extend([a])
    sa = s.row(a)
    real_write = allocation.write_cache_indices

    def corrupt_write(out_cache_loc, req_pool_indices, *args):
        real_write(out_cache_loc, req_pool_indices, *args)
        s.r2t[int(req_pool_indices[0]), 0] = int(sa[5])

    monkeypatch.setattr(allocation, "write_cache_indices", corrupt_write)
    free_before = s.alloc.available_size()
    batch = s.extend([b])
    sb = batch.out_cache_loc.to(torch.int64)
    assert b.to_finish.err_type == "kv_isolation_violation"
    assert torch.equal(s.row(b, 8), sb)
    assert s.alloc.available_size() == free_before - 8  # b's own 8 slots, nothing displaced or added


def test_a_foreign_page_in_the_protected_prefix_reads_the_padding_page_and_is_not_freed():
    # The fault: the prefix match does not carry the namespace (b is matched as tenant-a), so
    # b's row starts with a's cached page, which b protects (cache_protected_len) and never frees.
    s = Scheduler(4)
    a, b = _req("a", "tenant-a"), _req("b", "tenant-a")
    s.extend([a])
    checkpoint_kv_cache(a, s.tree)  # a's prompt goes into the radix cache
    sa = s.row(a)
    b.init_next_round_input(s.tree)
    assert b.prefix_len == 4 and b.kv.cache_protected_len == 4
    b.cache_salt = "tenant-b"
    b.extend_end = 8
    free_before = s.alloc.available_size()
    batch = ScheduleBatch.init_new([b], s.req_to_token_pool, s.alloc, s.tree, MODEL, False, SpeculativeAlgorithm.NONE)
    batch.prepare_for_extend()
    assert s.r2t[b.kv.req_pool_idx, :4].tolist() == [0, 1, 2, 3]
    assert s.alloc.available_size() == free_before - 4 and b.to_finish is not None  # only b's own new page
    assert kv_owner.tags_of(s.alloc)[int(sa[0]) // 4] == kv_owner.owner_of(a)  # a's page stays a's


def test_extend_and_decode_hooks_tag_new_slots_for_each_request():
    s = Scheduler(1)
    a, b = _req("a", "tenant-a", 3), _req("b", None, 5)
    batch = s.extend([a, b])
    out = batch.out_cache_loc
    tags = kv_owner.tags_of(s.alloc)
    assert tags[out[:3]].tolist() == [kv_owner.owner_of(a)] * 3 and tags[out[3:]].tolist() == [1] * 5
    assert a.to_finish is None and b.to_finish is None
    batch.prepare_for_decode()
    new = batch.out_cache_loc
    assert tags[new].tolist() == [kv_owner.owner_of(a), 1] and a.to_finish is None and b.to_finish is None


def test_claim_never_relabels_an_owned_page():
    _, alloc = make(4)
    slots = alloc.alloc(4)
    kv_owner.claim(alloc, slots[:2], torch.full((2,), 7))
    kv_owner.claim(alloc, slots[2:], torch.full((2,), 9))  # same page, another owner: stays 7
    assert int(kv_owner.tags_of(alloc)[slots[0] // 4]) == 7


def test_a_foreign_last_position_is_caught_with_the_slot_the_decode_continues_it_with(caplog):
    # A paged decode continues the row's last page from its last position (alloc_decode's
    # last_loc): a foreign index there makes the allocator itself hand out the next slot of the
    # foreign page. Both positions are caught; the logical page is re-pointed at a fresh one.
    s = Scheduler(4)
    a, b = _req("a", "tenant-a"), _req("b", "tenant-b", 6)
    s.extend([a])
    batch = s.extend([b])
    sa = s.row(a)
    s.pool.k_buffer[0][sa] = 5.0
    s.r2t[b.kv.req_pool_idx, 5] = int(sa[1])  # the same offset in its page as position 5
    free_before = s.alloc.available_size()
    batch.prepare_for_decode()
    assert b.to_finish.err_type == "kv_isolation_violation" and a.to_finish is None
    assert "positions [5, 6]" in caplog.text
    assert f"slots [{int(sa[1])}, {int(sa[2])}]" in caplog.text, "the decode continued the foreign page"
    row_b = s.row(b, 7)
    assert not torch.isin(row_b // 4, sa // 4).any(), "b's row still reaches a's pages"
    # and the forward writes b's new KV into b's fresh page, not into a's
    assert int(batch.out_cache_loc[0]) == int(row_b[6])
    assert torch.count_nonzero(s.pool.k_buffer[0][row_b[4:]]) == 0, "the redirected page must read zeros"
    assert (kv_owner.tags_of(s.alloc)[sa // 4] == kv_owner.owner_of(a)).all(), "a's pages stay a's"
    # All of a's KV, the slot the allocator handed out too: the "zero" part zeroes only pages a
    # decode step opens, so it no longer clears that slot of a's page before the check runs.
    assert bool((s.pool.k_buffer[0][sa] == 5.0).all()), "a's KV must be left untouched"
    assert s.alloc.available_size() == free_before - 4  # only the fresh page


def test_a_stale_last_position_into_a_free_page_is_caught_not_claimed(caplog):
    # a finished and freed its pages, which still hold its KV (zeroing happens when a page is
    # opened again). b's last position is made to point into a's freed page: alloc_decode
    # continues that page (last_loc + 1), which is free. The decode step must not claim it for
    # b (it opens no page: position 6 of 4-token pages), so the check flags both positions and
    # b never reads a's stale KV; what the forward writes follows b's repaired row.
    s = Scheduler(4)
    a, b = _req("a", "tenant-a"), _req("b", "tenant-b", 6)
    batch = s.extend([b])
    s.extend([a])
    sa = s.row(a)
    s.pool.k_buffer[0][sa] = 5.0
    s.alloc.free(sa)  # a's release
    s.req_to_token_pool.free(a)
    s.r2t[b.kv.req_pool_idx, 5] = int(sa[1])  # the same offset in its page as position 5
    batch.prepare_for_decode()
    assert b.to_finish is not None and b.to_finish.err_type == "kv_isolation_violation"
    assert "positions [5, 6]" in caplog.text
    assert "owners [0, 0]" in caplog.text, "the step claimed a's freed page for b before the check"
    row_b = s.row(b, 7)
    assert not bool((s.pool.k_buffer[0][row_b] == 5.0).any()), "b's row reaches a's stale KV"
    assert torch.count_nonzero(s.pool.k_buffer[0][row_b[4:]]) == 0, "the redirected page must read zeros"
    assert int(batch.out_cache_loc[0]) == int(row_b[6]), "the forward would write outside b's row"


def test_an_allocation_handing_out_a_slot_of_another_owners_partly_filled_page_is_caught(monkeypatch):
    # Two owners on one page: a's second page holds 2 of its 4 slots; the allocation for b
    # hands b the unwritten last slot of that page instead of its own (the fault is injected
    # into SGLang's row writer, which alloc_for_extend calls with the allocation). claim() leaves
    # the page a's, so b is caught; the forward writes and reads b's own slot, and b's release
    # frees b's pages only, never a's.
    from sglang.srt.mem_cache import allocation

    s = Scheduler(4)
    a, b = _req("a", "tenant-a", 6), _req("b", "tenant-b")
    s.extend([a])
    sa = s.row(a)
    shared = int(sa[4]) // 4 * 4 + 3  # a's partly filled page, the slot a has not written
    real_write = allocation.write_cache_indices
    displaced = []

    def share_a_page(out_cache_loc, req_pool_indices, *args):
        displaced.append(int(out_cache_loc[0]))
        out_cache_loc[0] = shared
        real_write(out_cache_loc, req_pool_indices, *args)

    monkeypatch.setattr(allocation, "write_cache_indices", share_a_page)
    free_before = s.alloc.available_size()
    batch = s.extend([b])
    assert b.to_finish.err_type == "kv_isolation_violation" and a.to_finish is None
    row_b = s.row(b, 8)
    assert int(row_b[0]) == displaced[0] and int(batch.out_cache_loc[0]) == displaced[0]
    assert not torch.isin(row_b // 4, sa // 4).any(), "b's row still reaches a's page"
    tags = kv_owner.tags_of(s.alloc)
    assert (tags[sa // 4] == kv_owner.owner_of(a)).all() and (tags[row_b // 4] == kv_owner.owner_of(b)).all()
    assert s.alloc.available_size() == free_before - 8
    s.alloc.free(row_b)  # b's release, as the scheduler does it
    assert s.alloc.available_size() == free_before
    assert (tags[sa // 4] == kv_owner.owner_of(a)).all(), "b's release freed a's page"
