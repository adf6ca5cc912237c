"""Triton kernels for log-probs at indices and entropy of softmax(logits / T), and their backward.

Conventions (after flash-linear-attention): ``p_`` pointers, ``b_`` blocks, int64 row offsets.
One program handles one row of V logits in a single streaming pass; a row may start anywhere,
given by two (size, stride) pairs for the leading dims, so strided views run without a copy.

Forward, one read of the logits. Work is in base 2: y = x * log2(e) / T. Per lane of the block
we keep s = sum 2^(y - M) and, for the entropy, t = sum 2^(y - M) * (y - M), against one running
scalar max M of the row (one exp2 per element; a rescale of the lane vectors when M grows).
Then, in nats, lse = ln2 * (M + log2 s) and H = ln2 * (log2 s - t / s): the entropy never forms
lse - E[z], which would cancel catastrophically for |z| ~ 1e4.
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
    p_x, p_idx, p_logp, p_ent, p_lse,
    V, K, inner_size, stride_outer, stride_inner,
    scale,  # log2(e) / T, fp32
    ignore_index,
    HAS_INDEX: tl.constexpr, HAS_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p_row = _row_base(p_x, row, inner_size, stride_outer, stride_inner)
    c = scale  # a Python float at launch: fp32 in the kernel
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
        b_y = tl.load(p_row + o, mask=o < V, other=NEG_INF).to(tl.float32) * c
        m_new = tl.maximum(m, tl.max(b_y, axis=0))
        # all-(-inf) so far: keep the reference at 0 so no inf - inf appears
        m_ref = tl.where(m_new == NEG_INF, 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        b_e = tl.exp2(b_y - m_ref)
        if HAS_ENT:
            dm = tl.where(m == NEG_INF, 0.0, m - m_ref)
            b_t = alpha * (b_t + dm * b_s) + tl.where(b_e > 0.0, b_e * (b_y - m_ref), 0.0)
        b_s = b_s * alpha + b_e
        m = m_new

    s = tl.sum(b_s, axis=0)
    m_ref = tl.where(m == NEG_INF, 0.0, m)
    log2s = tl.log2(s)
    lse2 = m_ref + log2s  # base-2 log-sum-exp of y
    tl.store(p_lse + row, lse2 * LN2)
    if HAS_ENT:
        t = tl.sum(b_t, axis=0)
        tl.store(p_ent + row, (log2s - t / s) * LN2)
    if HAS_INDEX:
        b_lp = (b_xi * c - lse2) * LN2
        b_lp = tl.where(inb, b_lp, float("nan"))
        b_lp = tl.where(b_idx == ignore_index, 0.0, b_lp)
        tl.store(p_logp + row * K + o_k, b_lp, mask=m_k)


@triton.jit
def _logprobs_entropy_backward_kernel(
    p_x, p_idx, p_glp, p_gh, p_lse, p_ent, p_dx,
    V, K, inner_size, stride_outer, stride_inner,
    scale,  # log2(e) / T
    inv_t,  # 1 / T
    ignore_index,
    HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr, SINGLE_K: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """d z_j = sum_k g_k [j == idx_k] - p_j * (G + gH * (lp_j + H));  d x = d z / T."""
    row = tl.program_id(0).to(tl.int64)
    p_row = _row_base(p_x, row, inner_size, stride_outer, stride_inner)
    p_drow = p_dx + row * V
    c = scale  # a Python float at launch: fp32 in the kernel
    it = inv_t
    lse2 = tl.load(p_lse + row).to(tl.float32) * (1.0 / LN2)

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
    # d x_j = -p_j * (a + b * y_j') + scatter, with the constants folded per row
    a = gsum
    b = 0.0
    if HAS_GH:
        gh = tl.load(p_gh + row).to(tl.float32)
        h = tl.load(p_ent + row).to(tl.float32)
        # gH * (lp + H) with lp = (y - lse2) * ln2
        a = a + gh * h
        b = gh * LN2
    a = a * it
    b = b * it

    o_v = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        o = start + o_v
        msk = o < V
        b_d = tl.load(p_row + o, mask=msk, other=0.0).to(tl.float32) * c - lse2
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
