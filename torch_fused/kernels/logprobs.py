"""Triton kernels for log-probs at indices and entropy of softmax(logits / T), and their backward.

Conventions (after flash-linear-attention): ``p_`` pointers, ``b_`` blocks, int64 row offsets.
One program handles one row of V logits in a single streaming pass; a row may start anywhere,
given by two (size, stride) pairs for the leading dims, so strided views run without a copy.

Numerics. Work is in base 2 with c = log2(e) / T. The row keeps its running max m of the raw
logits and per lane of the block s = sum 2^(d) and, for the entropy, t = sum 2^(d) * d, with
d = (x - m) c: the subtraction of two fp32 numbers close together is exact, so d carries only a
relative rounding of itself. The row statistics saved for the backward are the pair (m, log2 s),
never lse = m c + log2 s as one fp32 number: for |z| ~ 1e4 that sum would carry a rounding of
~1e-3, which every log-prob and gradient would inherit. In nats:
logp = ((x_i - m) c - log2 s) ln2 and H = (log2 s - t / s) ln2 (no lse - E[z] cancellation).
One exp2 per element; the lane vectors are rescaled when the row max grows.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _row_base(p_x, row, inner_size, stride_outer, stride_inner):
    return p_x + (row // inner_size) * stride_outer + (row % inner_size) * stride_inner


@triton.jit
def _logprobs_entropy_forward_kernel(
    p_x, p_idx, p_logp, p_ent, p_stats,
    V, K, inner_size, stride_outer, stride_inner,
    scale,  # c = log2(e) / T: a Python float at launch, so fp32 in the kernel
    ignore_index,
    HAS_INDEX: tl.constexpr, HAS_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p_row = _row_base(p_x, row, inner_size, stride_outer, stride_inner)
    c = scale
    NEG_INF: tl.constexpr = float("-inf")

    if HAS_INDEX:
        # issue the few scattered loads first so their latency hides under the stream
        o_k = tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_idx = tl.load(p_idx + row * K + o_k, mask=m_k, other=0).to(tl.int64)
        inb = (b_idx >= 0) & (b_idx < V)
        b_xi = tl.load(p_row + b_idx, mask=m_k & inb, other=0.0).to(tl.float32)

    o_v = tl.arange(0, BLOCK_V)
    b_s = tl.zeros([BLOCK_V], dtype=tl.float32)
    b_t = tl.zeros([BLOCK_V], dtype=tl.float32)
    m = tl.full([], NEG_INF, tl.float32)
    for start in range(0, V, BLOCK_V):
        o = start + o_v
        b_x = tl.load(p_row + o, mask=o < V, other=NEG_INF).to(tl.float32)
        m_new = tl.maximum(m, tl.max(b_x, axis=0))
        # all -inf so far: shift by 0 so that no inf - inf appears
        m_ref = tl.where(m_new == NEG_INF, 0.0, m_new)
        dm = (m - m_ref) * c  # <= 0; -inf on the first finite block
        alpha = tl.exp2(dm)
        b_d = (b_x - m_ref) * c
        b_e = tl.exp2(b_d)
        if HAS_ENT:
            dm = tl.where(m == NEG_INF, 0.0, dm)
            b_t = alpha * (b_t + dm * b_s) + tl.where(b_e > 0.0, b_e * b_d, 0.0)
        b_s = b_s * alpha + b_e
        m = m_new

    m = tl.where(m == NEG_INF, 0.0, m)
    log2s = tl.log2(tl.sum(b_s, axis=0))
    tl.store(p_stats + row * 2, m)
    tl.store(p_stats + row * 2 + 1, log2s)
    if HAS_ENT:
        s = tl.sum(b_s, axis=0)
        t = tl.sum(b_t, axis=0)
        tl.store(p_ent + row, (log2s - t / s) * LN2)
    if HAS_INDEX:
        b_lp = ((b_xi - m) * c - log2s) * LN2
        b_lp = tl.where(inb, b_lp, float("nan"))
        b_lp = tl.where(b_idx == ignore_index, 0.0, b_lp)
        tl.store(p_logp + row * K + o_k, b_lp, mask=m_k)


@triton.jit
def _logprobs_entropy_backward_kernel(
    p_x, p_idx, p_glp, p_gh, p_stats, p_ent, p_dx,
    V, K, inner_size, stride_outer, stride_inner,
    scale,  # c = log2(e) / T
    inv_t,  # 1 / T
    ignore_index,
    HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr, SINGLE_K: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """d z_j = sum_k g_k [j == idx_k] - p_j * (G + gH * (lp_j + H));  d x = d z / T.

    G: sum of the row's valid log-prob gradients; gH: the entropy gradient; lp_j = log p_j = ((x_j - m) c - log2 s) ln2."""
    row = tl.program_id(0).to(tl.int64)
    p_row = _row_base(p_x, row, inner_size, stride_outer, stride_inner)
    p_drow = p_dx + row * V
    c = scale
    it = inv_t
    m = tl.load(p_stats + row * 2).to(tl.float32)
    log2s = tl.load(p_stats + row * 2 + 1).to(tl.float32)

    gsum = 0.0
    if HAS_GLP:
        o_k = tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_idx = tl.load(p_idx + row * K + o_k, mask=m_k, other=ignore_index).to(tl.int64)
        b_g = tl.load(p_glp + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.where(b_idx == ignore_index, 0.0, b_g)
        inb = (b_idx >= 0) & (b_idx < V)
        # an out-of-range index gave NaN forward: its row's gradient is NaN too
        b_g = tl.where((b_idx != ignore_index) & (~inb), float("nan"), b_g)
        gsum = tl.sum(b_g, axis=0)
        if SINGLE_K:
            idx0 = tl.sum(tl.where(o_k == 0, b_idx, 0), axis=0)
            g0 = tl.sum(tl.where(o_k == 0, b_g, 0.0), axis=0) * it
    # d x_j = -p_j * (a + b * d_j) + scatter, d_j = log2 p_j, constants folded per row
    a = gsum
    b = 0.0
    if HAS_GH:
        gh = tl.load(p_gh + row).to(tl.float32)
        h = tl.load(p_ent + row).to(tl.float32)
        a = a + gh * h
        b = gh * LN2
    a = a * it
    b = b * it

    o_v = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        o = start + o_v
        msk = o < V
        b_d = (tl.load(p_row + o, mask=msk, other=0.0).to(tl.float32) - m) * c - log2s
        b_p = tl.exp2(b_d)
        if HAS_GH:
            b_dx = -b_p * (a + b * tl.where(b_p > 0.0, b_d, 0.0))
        else:
            b_dx = -b_p * a
        if HAS_GLP:
            if SINGLE_K:
                b_dx += tl.where(o == idx0, g0, 0.0)
            else:
                for k in range(0, K):
                    i_k = tl.load(p_idx + row * K + k).to(tl.int64)
                    g_k = tl.load(p_glp + row * K + k).to(tl.float32)
                    g_k = tl.where(i_k == ignore_index, 0.0, g_k) * it
                    b_dx += tl.where(o == i_k, g_k, 0.0)
        tl.store(p_drow + o, b_dx.to(p_dx.dtype.element_ty), mask=msk)


def pick_block(v: int, elem_size: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a row of v elements: 16 bytes x 2 loads per thread in flight."""
    target = 8192 if elem_size <= 2 else 4096
    block = min(target, triton.next_power_of_2(max(v, 16)))
    warps = 8 if block >= 4096 else (4 if block >= 1024 else 2)
    return block, warps
