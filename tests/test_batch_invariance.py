"""Batch invariance: a row's results are bitwise the same whatever else is in the batch.

A row alone, inside batches of several sizes, at another position, in reversed order: its
log-probs and entropy (the logits ops and the fused lm_head) and the fused head's d hidden row
(d weight and d bias sum over rows and are exempt) must be equal bit for bit. Where this breaks,
it is a reduction whose order follows the batch: a split chosen from N, a chunk width chosen from
N, a library reduction (cuBLAS, torch's reductions) that picks its strategy from the shape.

Runs on the Triton path only: CUDA, and the real kernels under TRITON_INTERPRET=1 (where the
chunk widths and merges are the same code; the GEMMs are numpy's). The plain CPU reference makes
no such promise (its GEMMs are the CPU BLAS's).
"""

from __future__ import annotations

import pytest
import torch

import torch_fused
from torch_fused._library import INTERPRET

TRITON_DEVICES = (["cpu"] if INTERPRET else []) + [pytest.param("cuda", marks=pytest.mark.cuda)]
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="the Triton path: CUDA, or the interpreter run")


@pytest.fixture(autouse=True)
def _invariant_head(settings_override):
    """The fused head's batch invariance is the lm_head_batch_invariant setting."""
    settings_override(lm_head_batch_invariant=True)


def _sizes(device):
    """(V, H, batch sizes, rows probed): the issue's shapes on a GPU, small ones in the interpreter."""
    if device == "cuda":
        return 151936, 1024, (2, 7, 64, 300), (0, 5, 299)
    return 130, 16, (3,), (0,)


def _batches(n_total, sizes, row):
    """Index tensors of the batches holding ``row``: alone, then inside the first k rows (k from
    sizes, row placed last where k allows), the whole batch reversed."""
    out = [torch.tensor([row])]
    for k in sizes:
        rows = [r for r in range(k) if r != row][: k - 1] + [row]
        out.append(torch.tensor(rows))
    out.append(torch.arange(n_total - 1, -1, -1))
    return out


def _equal_rows(name, results, row):
    ref = results[0]
    for i, got in enumerate(results[1:], 1):
        assert torch.equal(got, ref), f"{name}: row {row} differs in batch #{i} (max |diff| {(got - ref).abs().max()})"


# The fused head's ways of making its logits on the Triton path: (dtype, settings, keywords) of
# inside the GEMM kernels (bf16), and GEMM chunks (fp32 weights; bf16 with the fused GEMMs
# switched off; a softcap)
HEAD_PATHS = {"fused-gemm": (torch.bfloat16, {}, {}), "chunks-fp32": (torch.float32, {}, {}),
              "chunks-bf16": (torch.bfloat16, {"lm_head_fused_gemm": frozenset()}, {}),
              "softcap": (torch.bfloat16, {}, {"softcap": 30.0}),
              # K ids inside the GEMM epilogues (by default K > 1 ids take the side kernel)
              "epilogue-ids": (torch.bfloat16, {"lm_head_epilogue_ids": 8}, {}),
              # the sampler's support: token-row chunks of whole rows (the row count per chunk
              # does not follow N, but the last chunk's size does)
              "support": (torch.bfloat16, {"lm_head_support_chunk_bytes": {"cuda": 4 * 151936 * 96, "cpu": 4 * 130 * 2}},
                          {"top_k": 50, "top_p": 0.95})}


# the interpreter run takes two of the cases (its time is the suite's long pole)
HEAD_CASES = ([("fused-gemm", 3), ("chunks-fp32", None), ("support", 3)] if INTERPRET else
              [(p, k) for p in HEAD_PATHS for k in (None, 3) if p != "epilogue-ids" or k])


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("path,k", HEAD_CASES)
def test_fused_head_rows_do_not_depend_on_the_batch(device, path, k, settings_override):
    """Forward log-probs, entropy and the d hidden row of the fused head, each row alone and inside
    batches: bitwise equal. Chunk budgets small enough that the chunk width would follow N."""
    dtype, setting, kw = HEAD_PATHS[path]
    settings_override(**setting)
    v, hd, sizes, probe = _sizes(device)
    if device == "cpu":  # chunk widths that would change with N (a budget of a few columns a row)
        settings_override(lm_head_chunk_bytes={"cpu": 4 * 400}, lm_head_min_cols={}, lm_head_dlogits_min_cols={})
    gen = torch.Generator().manual_seed(11)
    n_total = max(sizes) + 1
    h_all = (torch.randn(n_total, hd, generator=gen) * 0.5).to(dtype).to(device)
    w = (torch.randn(v, hd, generator=gen) * 0.5).to(dtype).to(device)
    idx_all = torch.randint(0, v, (n_total,) if k is None else (n_total, k), generator=gen).to(device)
    g_lp = torch.randn(idx_all.shape, generator=gen).to(device)  # upstream gradients travel with their row
    g_ent = torch.randn(n_total, generator=gen).to(device)
    for row in probe:
        outs = []
        for sel in _batches(n_total, sizes, row):
            sel = sel.to(device)
            h = h_all[sel].clone().requires_grad_(True)
            lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx_all[sel], temperature=0.9, **kw)
            (dh,) = torch.autograd.grad((lp * g_lp[sel]).sum() + (ent * g_ent[sel]).sum(), h)
            at = (sel == row).nonzero()[0, 0]
            outs.append((lp[at], ent[at], dh[at]))
        for j, name in enumerate(("log-probs", "entropy", "d hidden")):
            _equal_rows(f"{path} {name}", [o[j] for o in outs], row)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_fused_head_shift_sequences_do_not_depend_on_the_batch(device, settings_override):
    """shift=True on [B, L+1, H]: a sequence alone and inside a batch of sequences (reversed)."""
    v, hd, _, _ = _sizes(device)
    if device == "cpu":
        settings_override(lm_head_chunk_bytes={"cpu": 4 * 400}, lm_head_min_cols={}, lm_head_dlogits_min_cols={})
    gen = torch.Generator().manual_seed(12)
    b, l = 3, 2
    h_all = (torch.randn(b, l + 1, hd, generator=gen) * 0.5).to(torch.bfloat16).to(device)
    w = (torch.randn(v, hd, generator=gen) * 0.5).to(torch.bfloat16).to(device)
    idx_all = torch.randint(0, v, (b, l), generator=gen).to(device)
    outs = []
    for sel in (torch.tensor([1]), torch.arange(b - 1, -1, -1)):
        sel = sel.to(device)
        h = h_all[sel].clone().requires_grad_(True)
        lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx_all[sel], shift=True)
        (dh,) = torch.autograd.grad(lp.sum() + ent.sum(), h)
        at = (sel == 1).nonzero()[0, 0]
        outs.append((lp[at], ent[at], dh[at]))
    for j, name in enumerate(("log-probs", "entropy", "d hidden")):
        _equal_rows(f"shift {name}", [o[j] for o in outs], 1)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("case", ["k-ids"] if INTERPRET else ["one-id", "k-ids", "shift", "tensor-temperature"])
def test_logits_ops_rows_do_not_depend_on_the_batch(device, case):
    """logprobs_and_entropy (log-probs, entropy, d logits row) on the logits: a row alone and
    inside batches of several sizes, reversed. Small and large N take different launches."""
    v, _, sizes, probe = _sizes(device)
    gen = torch.Generator().manual_seed(13)
    n_total = max(sizes) + 1
    x_all = (torch.randn(n_total, 2 if case == "shift" else 1, v, generator=gen) * 3).to(torch.bfloat16).to(device)
    k = 4 if case == "k-ids" else None
    idx_all = torch.randint(0, v, (n_total, 1) if k is None else (n_total, 1, k), generator=gen).to(device)
    temp = torch.tensor(0.8, device=device) if case == "tensor-temperature" else None
    for row in probe:
        outs = []
        for sel in _batches(n_total, sizes, row):
            sel = sel.to(device)
            x = x_all[sel].clone().requires_grad_(True)
            kw = dict(temperature=temp if temp is not None else 0.9)
            lp, ent = torch_fused.logprobs_and_entropy(x, idx_all[sel], shift=case == "shift", **kw)
            (dx,) = torch.autograd.grad(lp.sum() + ent.sum(), x)
            at = (sel == row).nonzero()[0, 0]
            outs.append((lp[at], ent[at], dx[at]))
        for j, name in enumerate(("log-probs", "entropy", "d logits")):
            _equal_rows(f"{case} {name}", [o[j] for o in outs], row)


@pytest.mark.cuda
def test_fused_head_compiled_rows_equal_eager():
    """Under torch.compile (dynamic shapes) the head's rows equal the eager ones bit for bit, for
    two batch sizes."""
    gen = torch.Generator().manual_seed(14)
    v, hd = 151936, 1024
    w = (torch.randn(v, hd, generator=gen) * 0.5).to(torch.bfloat16).cuda()
    h_all = (torch.randn(64, hd, generator=gen) * 0.5).to(torch.bfloat16).cuda()
    idx_all = torch.randint(0, v, (64,), generator=gen).cuda()

    def f(h, idx):
        lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx)
        return lp, ent

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    for n in (7, 64):
        e_lp, e_ent = f(h_all[:1], idx_all[:1])
        c_lp, c_ent = cf(h_all[:n], idx_all[:n])
        assert torch.equal(c_lp[0], e_lp[0]) and torch.equal(c_ent[0], e_ent[0])


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_on_policy_ratio_is_exactly_one(device):
    """README's worked check: old log-probs by micro-batches of 2, new ones by one batch of 8
    (same weights, same inputs): exp(new - old) is exactly 1.0 at every token."""
    v, hd, _, _ = _sizes(device)
    gen = torch.Generator().manual_seed(15)
    h = (torch.randn(8, 5, hd, generator=gen) * 0.5).to(torch.bfloat16).to(device)
    w = (torch.randn(v, hd, generator=gen) * 0.5).to(torch.bfloat16).to(device)
    ids = torch.randint(0, v, (8, 5), generator=gen).to(device)
    old = torch.cat([torch_fused.linear_logprobs_and_entropy(h[i:i + 2], w, ids[i:i + 2])[0] for i in range(0, 8, 2)])
    new, _ = torch_fused.linear_logprobs_and_entropy(h[:8], w, ids[:8])
    assert torch.equal(torch.exp(new - old), torch.ones_like(new))
