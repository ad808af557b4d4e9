"""Batch-invariant CPU matmuls: a row's result depends on that row alone, not on the batch it came in.

For the isolation suite's differential oracle, which compares every answer with the same request
served alone. On this machine's MKL a row of `x @ W` differs in its last bits with the number of
rows in `x` (fp32, K=64: 4 of 7 batch sizes differ from the whole batch's rows; MKL_CBWR does not
change it): the kernel's blocking follows M. On the GQA stand-in that never changed a greedy token
in the suite; on GLM-5.3's DSA a last-bit difference can move an fp8 index key across a rounding
step and change the top-k selection, so a request served in a batch of 62 differed from its solo
run at token 35 (docs/suite.md). That is numerics, not a leak, but an oracle that tolerates it
would tolerate a leak that looks like it; so the suite's servers compute deterministically instead.

`GLM53_BATCH_INVARIANT=1` (CPU processes only) replaces the CPU kernels of aten::mm, addmm and bmm
(and their out= forms): rows go through MKL in blocks of exactly ROWS rows (the last one
zero-padded), copied to a fresh buffer, so every row meets the same call whatever the batch; SDPA
takes its math path, which is built on bmm. The DSA attention (cpu_dsa.py) then gives every
request the same number of key slots, so that a token's KV is the same bits whether a decode step
or a prefill computed it (a retracted request is prefilled again). Everything else on the model's
path is elementwise or reduces along a row, which torch's CPU kernels never split across threads.
`enable()` checks on this machine that rows come out bit-identical alone and in batches of every
shape it tries; a server where they do not refuses to start (plugin.problems). It costs the suite about 3x the matmul time; it is never for
serving tenants (the launcher does not set it; the suite does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS = 16  # rows per MKL call; any fixed count works, 16 measured 7x faster than one row at a time

_lib: torch.library.Library | None = None


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    m, k = a.shape
    block = a.new_empty((1, ROWS, k))
    res = out.new_empty((1, ROWS, b.shape[1]))
    for i in range(0, m, ROWS):
        n = min(ROWS, m - i)
        block[0, :n] = a[i : i + n]
        if n < ROWS:
            block[0, n:] = 0
        # baddbmm.out (beta 0: `res` is only written) is not among the kernels replaced below
        torch.baddbmm(res, block, b[None], beta=0, out=res)
        out[i : i + n] = res[0, :n]


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=torch.result_type(a, b))
    _mm_into(a, b, out)
    return out


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    out = mm(a, b)
    if alpha != 1:
        out.mul_(alpha)
    if beta != 0:
        out.add_(bias, alpha=beta)
    return out


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=torch.result_type(a, b))
    for j in range(a.shape[0]):
        _mm_into(a[j], b[j], out[j])
    return out


# The out= forms (SGLang's MLA writes its w_vc product with torch.bmm(..., out=)).
def mm_out(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(mm(a, b))


def addmm_out(bias, a, b, *, beta=1, alpha=1, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(addmm(bias, a, b, beta=beta, alpha=alpha))


def bmm_out(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(bmm(a, b))


KERNELS = {"mm": mm, "mm.out": mm_out, "addmm": addmm, "addmm.out": addmm_out, "bmm": bmm, "bmm.out": bmm_out}


def enable(cpu: bool) -> list[str]:
    """Install the kernels in this process and check them; returns what keeps it from holding."""
    global _lib
    if not cpu:
        return ["GLM53_BATCH_INVARIANT=1 is for CPU servers; on a GPU use SGLang's --enable-deterministic-inference"]
    if _lib is None:
        lib = torch.library.Library("aten", "IMPL")
        for name, fn in KERNELS.items():
            lib.impl(name, fn, "CPU")
        _lib = lib  # kept: the registrations last as long as the Library object
    # SDPA's flash kernel blocks its queries by their count; the math path is matmul + softmax.
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    return violations()


def active() -> bool:
    return _lib is not None


def violations(seed: int = 0) -> list[str]:
    """Rows computed alone vs in batches of other rows, for every op the model's forward uses."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * ROWS + 5, 64, generator=g)
    w = torch.randn(96, 64, generator=g)
    bias = torch.randn(96, generator=g)
    q = torch.randn(4, 2 * ROWS + 5, 16, generator=g)
    kv = torch.randn(4, 50, 16, generator=g)
    mask = torch.rand(2 * ROWS + 5, 50, generator=g) > 0.3
    mask[:, 0] = True
    ops = {
        "linear": lambda r: F.linear(x[r], w),
        "linear+bias": lambda r: F.linear(x[r], w, bias),
        "matmul 3d": lambda r: torch.matmul(q[:, r], kv.transpose(1, 2)),
        "einsum": lambda r: torch.einsum("htd,hsd->ths", q[:, r], kv),
        "sdpa": lambda r: F.scaled_dot_product_attention(q[:, r], kv, kv, attn_mask=mask[r]),
        "mm out=": lambda r: torch.mm(x[r], w.t(), out=x.new_empty((len(x[r]), 96))),
        "bmm out=": lambda r: torch.bmm(q[:, r], kv.transpose(1, 2), out=q.new_empty((4, len(x[r]), 50))),
    }
    found = []
    for name, op in ops.items():
        whole = op(slice(None))
        take = (lambda t, i: t[:, i]) if name in ("matmul 3d", "sdpa", "bmm out=") else (lambda t, i: t[i])
        for rows in ([0], [7], [ROWS - 1, ROWS], list(range(3, ROWS + 9)), [2 * ROWS + 4, 1, 5]):
            part = op(torch.tensor(rows))
            if not torch.equal(part, take(whole, torch.tensor(rows))):
                found.append(f"batch invariance: {name} gives rows {rows[:4]} other bits in a batch of {len(rows)}")
                break
    return found
