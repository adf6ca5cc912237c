"""Triton kernels of the fused lm_head (ops/linear_logprobs.py): one GEMM tile of the logits,
z = hidden[rows] @ weight[cols]^T accumulated in fp32, consumed in the kernel's epilogue, so that
the logits never reach memory.

- ``_lm_head_stats_kernel`` (forward): the tile's row statistics in the base-2 units of
  kernels/logprobs.py: max m, s = sum 2^d and t = sum 2^d d with d = z c - m c, and for the
  ids inside the tile their d against the tile's shift. Stored per (row, column tile); the
  caller folds the tiles (few numbers per row) as _chunk_merge_kernel folds chunks.
- ``_lm_head_dlogits_kernel`` (backward): the tile's d logits from the whole rows' statistics,
  d z_j = scatter_j - p_j (a + b log2 p_j) (a, b per row, as _logprobs_entropy_backward_kernel
  folds them), rounded once to the output's dtype and stored: the d weight and d hidden GEMMs
  read it.

- ``_ids_kernel``, ``_scatter_ids_kernel``: a row's K ids where the epilogues leave them out
  (more than the lm_head_epilogue_ids setting: each tile's epilogue would look at each of its
  rows' K ids, a cost that grows with K). Each id's logit is one row of hidden against one weight
  row (fp32 dot in H order); the forward stores its d, the backward its d logit once for the
  whole call, which each d logits chunk then takes at the id's column.

Tiles are visited in groups of GROUP_M row tiles per column sweep, so a group's hidden rows and
a column tile's weight rows stay in L2 while they are reused.
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton.language.extra import libdevice

from ..settings import INTERPRET
from ..settings import current as settings
from .._library import NOMINAL_SMS
from .logprobs import D_MIN, _shift_diff, _shifted

# the logits tiles' dot upcasts in Triton's interpreter (its dot has no bf16: _interpreter_dot);
# not EXACT_SHIFT, which a GPU launch also sets (a tensor temperature, or c past FMA_SHIFT_MAX_C)
_UPCAST = tl.constexpr(INTERPRET)


@triton.jit
def _tile_of(pid, n_m, n_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid, in groups of GROUP_M row tiles."""
    per_group = GROUP_M * n_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _logits_tile(p_h, p_w, p_b, N, V, H, stride_h, stride_w, pid_m, pid_n,
                 HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, PROMOTE: tl.constexpr):
    """(z [BM, BN] fp32, row offsets, column offsets): the logits of rows pid_m * BM .. against
    weight rows pid_n * BN .., columns past V at -inf. UPCAST: Triton's interpreter, whose dot has
    no bf16 (_interpreter_dot). PROMOTE: see _accumulate."""
    o_m = pid_m * BM + tl.arange(0, BM)
    o_n = pid_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    # rows past the ends read row 0 (in bounds; their results are masked out), so that the
    # inner loop needs no row mask
    r_m = tl.where(o_m < N, o_m, 0).to(tl.int64)
    r_n = tl.where(o_n < V, o_n, 0).to(tl.int64)
    p_a = p_h + r_m[:, None] * stride_h + o_k[None, :]
    p_bw = p_w + r_n[:, None] * stride_w + o_k[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BK)):
        k_left = H - k * BK
        b_a = tl.load(p_a, mask=o_k[None, :] < k_left, other=0.0)
        b_w = tl.load(p_bw, mask=o_k[None, :] < k_left, other=0.0)
        if UPCAST:
            acc += _interpreter_dot(b_a, tl.trans(b_w))
        else:
            acc = _accumulate(acc, b_a, tl.trans(b_w), PROMOTE)
        p_a += BK
        p_bw += BK
    return _finish_tile(acc, p_b, o_n, V, HAS_BIAS), o_m, o_n


@triton.jit
def _interpreter_dot(b_a, b_b):
    """b_a @ b_b in Triton's interpreter: in float64, rounded to fp32. Its dot is numpy's, whose
    BLAS rounds an output element differently by its place in the tile, which would hide whether
    the kernels' own order of work depends on the batch; float64 products and sums of a block
    round to the same fp32 value wherever the element sits."""
    return tl.dot(b_a.to(tl.float64), b_b.to(tl.float64)).to(tl.float32)


@triton.jit
def _accumulate(acc, b_a, b_b, PROMOTE: tl.constexpr):
    """acc + b_a @ b_b (fp32 acc). Without PROMOTE: one chain of matrix instructions accumulating
    into acc (tl.dot(a, b, acc)). With PROMOTE: the block's product from a zero accumulator,
    then added to acc with a rounded fp32 add. bf16 / fp16 tensor-core instructions add their
    products into the accumulator without rounding to nearest (the low bits are cut, a bias
    that grows with the accumulator's size and the number of steps); a block's product starts
    from zero, so its cut is relative to the block's own sum, and the running sum takes only
    rounded adds. The add is libdevice's add_rn, not ``+``: Triton's combine pass rewrites
    ``acc + tl.dot(a, b)`` into ``tl.dot(a, b, acc)``."""
    if PROMOTE:
        return libdevice.add_rn(acc, tl.dot(b_a, b_b))
    else:
        return tl.dot(b_a, b_b, acc)


@triton.jit
def _finish_tile(acc, p_b, o_n, V, HAS_BIAS: tl.constexpr):
    """The logits of an accumulated tile: plus the bias, columns past V at -inf."""
    if HAS_BIAS:
        acc += tl.load(p_b + o_n, mask=o_n < V, other=0.0).to(tl.float32)[None, :]
    return tl.where((o_n < V)[None, :], acc, float("-inf"))


@triton.jit
def _logits_tile_tma(d_h, d_w, p_b, V, H, pid_m, pid_n,
                     HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     PROMOTE: tl.constexpr):
    """_logits_tile with the operands read through the tensor descriptors d_h [N, H] and d_w
    [V, H] (blocks [BM, BK] and [BN, BK]; out-of-range rows and columns read as zeros)."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(tl.cdiv(H, BK)):
        b_a = d_h.load([pid_m * BM, k * BK])
        b_w = d_w.load([pid_n * BN, k * BK])
        acc = _accumulate(acc, b_a, b_w.T, PROMOTE)
    o_m = pid_m * BM + tl.arange(0, BM)
    o_n = pid_n * BN + tl.arange(0, BN)
    return _finish_tile(acc, p_b, o_n, V, HAS_BIAS), o_m, o_n


@triton.jit
def _stats_epilogue(z, o_m, o_n, pid_n, p_idx, p_part, p_u, p_mo, N, V, K, n_tiles_n, v_off, scale,
                    EXACT_SHIFT: tl.constexpr, BN: tl.constexpr):
    c = scale
    m = tl.max(z, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    d = _shifted(z, m[:, None], c, EXACT_SHIFT)
    e = tl.exp2(d)
    s = tl.sum(e, axis=1)
    t = tl.sum(e * tl.maximum(d, D_MIN), axis=1)
    live = o_m < N
    rows = o_m.to(tl.int64)
    plane = N * n_tiles_n  # (< 2^31: the launcher bounds the partials' size)
    p_row = p_part + rows * n_tiles_n + pid_n
    tl.store(p_row, m, mask=live)
    tl.store(p_row + plane, s, mask=live)
    tl.store(p_row + 2 * plane, t, mask=live)
    n0 = pid_n * BN
    # the ids in a loop at run time: one compiled kernel serves every K (unrolled over a constexpr
    # K, the kernels of a top-k teacher at K 100 took minutes to compile for sm_90, once per K)
    for k in range(K):
        i_k = tl.load(p_idx + rows * K + k, mask=live, other=-1).to(tl.int64) - v_off
        inside = live & (i_k >= n0) & (i_k < n0 + BN) & (i_k < V)
        # the tile's [BM, BN] search for id k only where one of its rows has that id in this
        # tile (with K ids a row's ids fall in K of the row's V / BN tiles at most)
        if tl.max(inside.to(tl.int32), axis=0) > 0:
            u_k = tl.sum(tl.where(o_n[None, :] == i_k[:, None], d, 0.0), axis=1)
            tl.store(p_u + rows * K + k, u_k, mask=inside)
            tl.store(p_mo + rows * K + k, m, mask=inside)


@triton.jit
def _lm_head_stats_kernel(
    p_h, p_w, p_b, p_idx, p_part, p_u, p_mo,
    N, V, H, K, stride_h, stride_w, n_tiles_n, v_off,
    scale,  # c = log2(e) / T
    HAS_BIAS: tl.constexpr, EXACT_SHIFT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PROMOTE: tl.constexpr,
):
    """Rows 0 .. N-1 of hidden against weight rows 0 .. V-1 (vocabulary ids v_off ..). Stores
    p_part[3, N, n_tiles_n] = (m, s, t) of each (row, column tile); a tile row of only -inf
    logits has s = 0 and the placeholder m = 0. For each of a row's K ids inside the tile,
    stores u = z c - m c (against the tile's m) in p_u and the tile's m in p_mo."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(N, BM)
    pid_m, pid_n = _tile_of(pid, n_m, n_tiles_n, GROUP_M)
    z, o_m, o_n = _logits_tile(p_h, p_w, p_b, N, V, H, stride_h, stride_w, pid_m, pid_n, HAS_BIAS, _UPCAST, BM, BN, BK, PROMOTE)
    _stats_epilogue(z, o_m, o_n, pid_n, p_idx, p_part, p_u, p_mo, N, V, K, n_tiles_n, v_off, scale,
                    EXACT_SHIFT, BN)


@triton.jit
def _lm_head_stats_tma_kernel(
    d_h, d_w, p_b, p_idx, p_part, p_u, p_mo,
    N, V, H, K, n_tiles_n, v_off,
    scale,  # c = log2(e) / T
    HAS_BIAS: tl.constexpr, EXACT_SHIFT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    PROMOTE: tl.constexpr,
):
    """_lm_head_stats_kernel with the operands read by TMA (_logits_tile_tma), one persistent
    program per multiprocessor looping over the tiles."""
    n_m = tl.cdiv(N, BM)
    for tile in tl.range(tl.program_id(0), n_m * n_tiles_n, NUM_SMS):
        pid_m, pid_n = _tile_of(tile, n_m, n_tiles_n, GROUP_M)
        z, o_m, o_n = _logits_tile_tma(d_h, d_w, p_b, V, H, pid_m, pid_n, HAS_BIAS, BM, BN, BK, PROMOTE)
        _stats_epilogue(z, o_m, o_n, pid_n, p_idx, p_part, p_u, p_mo, N, V, K, n_tiles_n, v_off, scale,
                        EXACT_SHIFT, BN)


@triton.jit
def _lm_head_dlogits_kernel(
    p_h, p_w, p_b, p_idx, p_g, p_coef, p_dz,
    N, V, H, K, stride_h, stride_w, stride_dz, n_tiles_n, v_off,
    scale,  # c = log2(e) / T
    HAS_BIAS: tl.constexpr, HAS_GLP: tl.constexpr, EXACT_SHIFT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PROMOTE: tl.constexpr,
    SUM_G: tl.constexpr,
):
    """d z of rows 0 .. N-1 against weight rows 0 .. V-1 (ids v_off ..): stored in p_dz [N, V]
    (row stride stride_dz, the output's dtype). p_coef[4, N] = (m, log2 s, a, b) per row:
    d z_j = -p_j (a + b max(d_j, D_MIN)) + g_k at the row's ids, with d_j = z_j c - m c - log2 s
    (log2 p_j). p_g [N, K]: the ids' log-prob gradients, already zero at ignore_index and
    scaled by 1 / T; SUM_G: the kernel adds their sum to the a of p_coef, in id order."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(N, BM)
    pid_m, pid_n = _tile_of(pid, n_m, n_tiles_n, GROUP_M)
    z, o_m, o_n = _logits_tile(p_h, p_w, p_b, N, V, H, stride_h, stride_w, pid_m, pid_n, HAS_BIAS, _UPCAST, BM, BN, BK, PROMOTE)
    _dlogits_epilogue(z, o_m, o_n, p_idx, p_g, p_coef, p_dz, N, V, K, stride_dz, v_off, scale,
                      HAS_GLP, EXACT_SHIFT, SUM_G)


@triton.jit
def _dlogits_epilogue(z, o_m, o_n, p_idx, p_g, p_coef, p_dz, N, V, K, stride_dz, v_off, scale,
                      HAS_GLP: tl.constexpr, EXACT_SHIFT: tl.constexpr, SUM_G: tl.constexpr):
    live = o_m < N
    rows = tl.where(live, o_m, 0).to(tl.int64)
    m = tl.load(p_coef + rows)
    log2s = tl.load(p_coef + N + rows)
    a = tl.load(p_coef + 2 * N + rows)
    b = tl.load(p_coef + 3 * N + rows)
    if SUM_G:
        # a += the ids' scaled gradients, added here one id after the other: an order that is the
        # row's own (a torch reduction over them may split it by the batch's size)
        for k in range(K):
            a += tl.load(p_g + rows * K + k)
    d = _shifted(z, m[:, None], scale, EXACT_SHIFT) - log2s[:, None]
    dz = -tl.exp2(d) * (a[:, None] + b[:, None] * tl.maximum(d, D_MIN))
    if HAS_GLP:
        n_lo = tl.min(o_n, axis=0)
        n_hi = tl.max(o_n, axis=0)
        for k in range(K):
            i_k = tl.load(p_idx + rows * K + k).to(tl.int64) - v_off
            # as in _stats_epilogue: the [BM, BN] add only where a row's id k is in this tile
            # (elsewhere it would add 0.0 everywhere; a -0.0 stays -0.0, which no sum can tell)
            if tl.max((live & (i_k >= n_lo) & (i_k <= n_hi)).to(tl.int32), axis=0) > 0:
                g_k = tl.load(p_g + rows * K + k)
                dz += tl.where(o_n[None, :] == i_k[:, None], g_k[:, None], 0.0)
    p_out = p_dz + rows[:, None] * stride_dz + o_n[None, :]
    tl.store(p_out, dz.to(p_dz.dtype.element_ty), mask=live[:, None] & (o_n < V)[None, :])


@triton.jit
def _lm_head_dlogits_tma_kernel(
    d_h, d_w, p_b, p_idx, p_g, p_coef, p_dz,
    N, V, H, K, stride_dz, n_tiles_n, v_off,
    scale,  # c = log2(e) / T
    HAS_BIAS: tl.constexpr, HAS_GLP: tl.constexpr, EXACT_SHIFT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    PROMOTE: tl.constexpr, SUM_G: tl.constexpr,
):
    """_lm_head_dlogits_kernel with the operands read by TMA, persistent (as
    _lm_head_stats_tma_kernel)."""
    n_m = tl.cdiv(N, BM)
    for tile in tl.range(tl.program_id(0), n_m * n_tiles_n, NUM_SMS):
        pid_m, pid_n = _tile_of(tile, n_m, n_tiles_n, GROUP_M)
        z, o_m, o_n = _logits_tile_tma(d_h, d_w, p_b, V, H, pid_m, pid_n, HAS_BIAS, BM, BN, BK, PROMOTE)
        _dlogits_epilogue(z, o_m, o_n, p_idx, p_g, p_coef, p_dz, N, V, K, stride_dz, v_off, scale,
                          HAS_GLP, EXACT_SHIFT, SUM_G)


@triton.jit
def _ids_kernel(
    p_h, p_w, p_b, p_idx, p_g, p_coef, p_out,
    N, K, H, V, stride_h, stride_w, v_lo,
    scale,  # c = log2(e) / T
    HAS_BIAS: tl.constexpr, DLOGITS: tl.constexpr, EXACT_SHIFT: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """The ids' side of the fused head where its epilogues leave them out (more ids per row than
    the lm_head_epilogue_ids setting): one row and BLOCK_K of its K ids per program. An id of
    the weight rows p_w (ids v_lo .. v_lo + V - 1) has its logit z = hidden[row] . weight[id] (+
    bias) summed in fp32 in H order (the row's own order, whatever N is), and d = z c - m c
    against the row's max (p_coef[2 or 4, N]: m, log2 s, a, b). Stored at p_out[row, k] (fp32
    [N, K]; an id outside the rows: 0.0): forward (not DLOGITS), d; backward (DLOGITS), the id's d
    logit, -p (a + b max(log2 p, D_MIN)) + the sum of p_g[row, j] over the row's ids j equal to
    it (log2 p = d - log2 s): the value the d logits epilogue gives with the ids, which
    _scatter_ids_kernel writes over each chunk's d logits."""
    # a row's id blocks are neighbouring programs, so its hidden row is read once from memory
    pid = tl.program_id(0).to(tl.int64)
    n_kb = tl.cdiv(K, BLOCK_K)
    row = pid // n_kb
    o_k = (pid % n_kb) * BLOCK_K + tl.arange(0, BLOCK_K)
    live = o_k < K
    ids = tl.load(p_idx + row * K + o_k, mask=live, other=-1)
    loc = ids - v_lo
    inside = live & (loc >= 0) & (loc < V)
    r_w = tl.where(inside, loc, 0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    if tl.max(inside.to(tl.int32), axis=0) > 0:
        for h0 in range(0, H, BLOCK_H):
            in_h = h0 + o_h < H
            b_h = tl.load(p_h + row * stride_h + h0 + o_h, mask=in_h, other=0.0).to(tl.float32)
            b_w = tl.load(p_w + r_w[:, None] * stride_w + (h0 + o_h)[None, :],
                          mask=inside[:, None] & in_h[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(b_w * b_h[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(p_b + r_w, mask=inside, other=0.0).to(tl.float32)
    d = _shifted(acc, tl.load(p_coef + row), scale, EXACT_SHIFT)
    if DLOGITS:
        lp2 = d - tl.load(p_coef + N + row)
        a = tl.load(p_coef + 2 * N + row)
        b = tl.load(p_coef + 3 * N + row)
        d = -tl.exp2(lp2) * (a + b * tl.maximum(lp2, D_MIN))
        o_j = tl.arange(0, BLOCK_J)
        for j0 in range(0, K, BLOCK_J):
            live_j = j0 + o_j < K
            ids_j = tl.load(p_idx + row * K + j0 + o_j, mask=live_j, other=-1)
            g_j = tl.load(p_g + row * K + j0 + o_j, mask=live_j, other=0.0)
            d += tl.sum(tl.where(ids_j[None, :] == ids[:, None], g_j[None, :], 0.0), axis=1)
    tl.store(p_out + row * K + o_k, tl.where(inside, d, 0.0), mask=live)


@triton.jit
def _scatter_ids_kernel(p_val, p_idx, p_dz, NK, K, VC, stride_dz, v_lo, BLOCK: tl.constexpr):
    """Each (row, id) of p_idx [N, K] (NK = N K) whose id is one of the chunk's columns v_lo ..
    v_lo + VC - 1: p_val[row, k] (_ids_kernel's d logit, fp32) rounded once to the chunk's dtype
    and stored at p_dz[row, id - v_lo]. A repeated id stores the same value from each slot."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = e < NK
    loc = tl.load(p_idx + e, mask=live, other=-1) - v_lo
    inside = live & (loc >= 0) & (loc < VC)
    val = tl.load(p_val + e, mask=inside, other=0.0)
    tl.store(p_dz + (e // K) * stride_dz + loc, val.to(p_dz.dtype.element_ty), mask=inside)


@triton.jit
def _add_id_grads_kernel(p_coef, p_g, N, K, BLOCK_R: tl.constexpr):
    """a (p_coef[2, :]) += the row's K ids' gradients p_g[N, K], added one id after the other: the
    order _dlogits_epilogue's SUM_G adds them in, the row's own whatever N is."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < N
    r = rows.to(tl.int64)
    a = tl.load(p_coef + 2 * N + r, mask=live, other=0.0)
    for k in range(K):
        a += tl.load(p_g + r * K + k, mask=live, other=0.0)
    tl.store(p_coef + 2 * N + r, a, mask=live)


@triton.jit
def _tile_merge_kernel(
    p_part, p_run, NT, plane, stride_run,
    scale,  # c = log2(e) / T
    EXACT_SHIFT: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """One row per program: its statistics from the forward's per-tile ones, p_part[3, N, NT]
    (m, s, t of each column tile; a tile with s = 0 saw only -inf logits and holds the
    placeholder m = 0; plane = N NT), merged as ops.logprobs.merge_row_stats merges them, into
    p_run[row, 0:3].
    The tiles are taken BLOCK_T at a time in index order and reduced inside the program: the
    order is the row's own, whatever N is (a torch reduction over the tiles chooses its split
    from the number of rows)."""
    row = tl.program_id(0).to(tl.int64)
    c = scale
    o_t = tl.arange(0, BLOCK_T)
    p_m = p_part + row * NT
    big = tl.full([BLOCK_T], float("-inf"), tl.float32)
    for t0 in range(0, NT, BLOCK_T):
        live = (t0 + o_t < NT)
        s_b = tl.load(p_m + plane + t0 + o_t, mask=live, other=0.0)
        m_b = tl.load(p_m + t0 + o_t, mask=live, other=0.0)
        big = tl.maximum(big, tl.where(s_b > 0.0, m_b, float("-inf")))
    m = tl.max(big, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    s_acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    t_acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for t0 in range(0, NT, BLOCK_T):
        live = (t0 + o_t < NT)
        m_b = tl.load(p_m + t0 + o_t, mask=live, other=0.0)
        s_b = tl.load(p_m + plane + t0 + o_t, mask=live, other=0.0)
        t_b = tl.load(p_m + 2 * plane + t0 + o_t, mask=live, other=0.0)
        da = _shift_diff(m_b, m, c, EXACT_SHIFT)
        e = tl.where(s_b > 0.0, tl.exp2(da), 0.0)
        s_acc += s_b * e
        t_acc += tl.where(s_b > 0.0, e * (t_b + da * s_b), 0.0)
    p_out = p_run + row * stride_run
    tl.store(p_out, m)
    tl.store(p_out + 1, tl.sum(s_acc, axis=0))
    tl.store(p_out + 2, tl.sum(t_acc, axis=0))


@triton.jit
def _matmul_kernel(
    p_a, p_b, p_c, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
    ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, PROMOTE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """c (+)= a @ b: a [M, K], b [K, N] (any strides; bf16, fp16 or fp32), c [M, N] fp32 with
    unit column stride. ACCUMULATE: the running sum starts from c's values (the fused head's d
    hidden over vocabulary chunks), else from zero. Each output tile is one program's
    accumulation over K in BK steps, in order, with no split of K: an element's result depends
    on its own row of a and column of b only, never on M (the batch-invariant GEMM of the fused
    head). IEEE: fp32 operands multiplied in full fp32 (no TF32). UPCAST: the interpreter."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    pid_m, pid_n = _tile_of(pid, n_m, n_n, GROUP_M)
    o_m = pid_m * BM + tl.arange(0, BM)
    o_n = pid_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    r_m = tl.where(o_m < M, o_m, 0).to(tl.int64)
    r_n = tl.where(o_n < N, o_n, 0).to(tl.int64)
    p_ab = p_a + r_m[:, None] * stride_am + o_k[None, :].to(tl.int64) * stride_ak
    p_bb = p_b + o_k[:, None].to(tl.int64) * stride_bk + r_n[None, :] * stride_bn
    p_out = p_c + r_m[:, None] * stride_cm + o_n[None, :]
    keep = (o_m < M)[:, None] & (o_n < N)[None, :]
    if ACCUMULATE:
        acc = tl.load(p_out, mask=keep, other=0.0)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        k_left = K - k * BK
        b_a = tl.load(p_ab, mask=o_k[None, :] < k_left, other=0.0)
        b_b = tl.load(p_bb, mask=o_k[:, None] < k_left, other=0.0)
        if UPCAST:
            acc += _interpreter_dot(b_a, b_b)
        elif IEEE:
            acc = tl.dot(b_a, b_b, acc, input_precision="ieee")
        else:
            acc = _accumulate(acc, b_a, b_b, PROMOTE)
        p_ab += BK * stride_ak
        p_bb += BK * stride_bk
    tl.store(p_out, acc, mask=keep)


# (BM, BN, BK, GROUP_M, num_warps, num_stages) per kernel. CONFIG: the tiles of devices with
# 160 KiB or more of shared memory per block (A100, H100 / H200: the operand pipeline takes
# stages * (BM + BN) * BK * 2 bytes = 144 KiB); one table for the four kernels, which share
# the GEMM main loop (pointer loads or TMA). GROUP_M 16: consecutive tiles take 16 row tiles of
# the hidden states against one weight column tile before the next (more of each weight tile
# read from L2); python -m torch_fused.bench --sweep --only lm_head times it beside 8 and 32
# (figures: docs/BENCHMARKS.md, "Fused lm_head").
CONFIG = dict.fromkeys(("stats", "dlogits", "stats_tma", "dlogits_tma"), (128, 256, 64, 16, 8, 3))
# Devices with less (sm_86 / sm_89: 99 KiB; sm_75: 64 KiB): half the tile width and depth, a
# 48 KiB pipeline. Chosen to fit, not tuned on those devices. Where neither fits, the fused
# head makes its logits with cuBLAS GEMMs instead (ops/linear_logprobs.py).
SMALL_SMEM_CONFIG = dict.fromkeys(CONFIG, (128, 128, 32, 8, 4, 3))
# With promotion (_accumulate, the lm_head_promote setting) a program holds two fp32 tiles, the
# running sum and the K step's product: at 128 x 256 over 8 warps that is 256 registers a thread
# for the two, past the 255 a thread has, so the promoted kernels take 128-column tiles (and a
# fourth pipeline stage in the shared memory the narrower tile leaves).
PROMOTE_CONFIG = dict.fromkeys(CONFIG, (128, 128, 64, 16, 8, 4))
# The batch-invariant GEMM (_matmul_kernel): 16-bit operands as the fused kernels; fp32 operands
# (IEEE products on the CUDA cores) with half the depth, the same 96 KiB pipeline as 16-bit ones.
MATMUL_CONFIG = {"matmul": (128, 256, 64, 16, 8, 3), "matmul32": (128, 128, 32, 8, 8, 3)}
PROMOTE_MATMUL_CONFIG = {"matmul": (128, 128, 64, 16, 8, 4), "matmul32": MATMUL_CONFIG["matmul32"]}
SMALL_SMEM_MATMUL_CONFIG = {"matmul": (128, 128, 32, 8, 4, 3), "matmul32": (64, 64, 32, 8, 4, 3)}
# the tile statistics merged BLOCK_T tiles at a time (_tile_merge_kernel)
MERGE_BLOCK_T = 1024
SMEM_MARGIN = 16 << 10  # bytes left beside the pipeline (the epilogue's layout conversions)


def pipeline_smem(cfg, elem_bytes: int = 2) -> int:
    """Shared memory of a config's operand pipeline: stages x (BM + BN) x BK elements."""
    bm, bn, bk, _, _, stages = cfg
    return stages * (bm + bn) * bk * elem_bytes


def pick_config(kernel: str, smem_limit: int | None, promote: bool = False):
    """The tiles for ``kernel`` on a device with ``smem_limit`` bytes of shared memory per block
    (None: no limit, the interpreter): CONFIG's (PROMOTE_CONFIG's for promoted tiles) where it
    fits with SMEM_MARGIN to spare, else SMALL_SMEM_CONFIG's, else None (the caller takes the
    cuBLAS path). The lm_head_tiles setting replaces CONFIG."""
    if kernel.startswith("matmul"):
        swept = settings.lm_head_tiles  # a sweep's table replaces the shipped one where it names the GEMM
        shipped = PROMOTE_MATMUL_CONFIG if promote else MATMUL_CONFIG
        tables = (swept if swept and kernel in swept else shipped, SMALL_SMEM_MATMUL_CONFIG)
    else:
        tables = (settings.lm_head_tiles or (PROMOTE_CONFIG if promote else CONFIG), SMALL_SMEM_CONFIG)
    elem = 4 if kernel == "matmul32" else 2
    for table in tables:
        if smem_limit is None or pipeline_smem(table[kernel], elem) + SMEM_MARGIN <= smem_limit:
            return table[kernel]
    return None


def compile_cases():
    """(name, kernel, signature, constexprs, num_warps) for tests/test_kernels_compile.py: each
    kernel compiled for a CUDA target without a GPU."""
    stats = {"p_h": "*bf16", "p_w": "*bf16", "p_b": "*bf16", "p_idx": "*i64", "p_part": "*fp32", "p_u": "*fp32",
             "p_mo": "*fp32", "N": "i32", "V": "i32", "H": "i32", "K": "i32", "stride_h": "i32", "stride_w": "i32",
             "n_tiles_n": "i32", "v_off": "i32", "scale": "fp32"}
    bm, bn, bk, gm, warps, _ = CONFIG["stats"]
    yield ("lm_head_stats", _lm_head_stats_kernel, stats,
           {"HAS_BIAS": True, "EXACT_SHIFT": False, "BM": bm, "BN": bn, "BK": bk, "GROUP_M": gm,
            "PROMOTE": True}, warps)
    dl = {"p_h": "*bf16", "p_w": "*bf16", "p_b": "*bf16", "p_idx": "*i64", "p_g": "*fp32", "p_coef": "*fp32",
          "p_dz": "*bf16", "N": "i32", "V": "i32", "H": "i32", "K": "i32", "stride_h": "i32", "stride_w": "i32",
          "stride_dz": "i32", "n_tiles_n": "i32", "v_off": "i32", "scale": "fp32"}
    bm, bn, bk, gm, warps, _ = CONFIG["dlogits"]
    yield ("lm_head_dlogits", _lm_head_dlogits_kernel, dl,
           {"HAS_BIAS": False, "HAS_GLP": True, "EXACT_SHIFT": False, "BM": bm, "BN": bn, "BK": bk,
            "GROUP_M": gm, "PROMOTE": False, "SUM_G": True}, warps)
    # EXACT_SHIFT on a GPU: a temperature whose scale c = log2(e) / T passes FMA_SHIFT_MAX_C
    bm, bn, bk, gm, warps, _ = CONFIG["stats"]
    yield ("lm_head_stats exact shift", _lm_head_stats_kernel, stats,
           {"HAS_BIAS": False, "EXACT_SHIFT": True, "BM": bm, "BN": bn, "BK": bk, "GROUP_M": gm,
            "PROMOTE": False, "p_b": None}, warps)
    bm, bn, bk, gm, warps, _ = CONFIG["dlogits"]
    yield ("lm_head_dlogits exact shift", _lm_head_dlogits_kernel, dl,
           {"HAS_BIAS": True, "HAS_GLP": True, "EXACT_SHIFT": True, "BM": bm, "BN": bn, "BK": bk,
            "GROUP_M": gm, "PROMOTE": False, "SUM_G": False}, warps)
    for name, kernel, sig, flags in (("lm_head_stats_tma", _lm_head_stats_tma_kernel, stats, {}),
                                     ("lm_head_dlogits_tma", _lm_head_dlogits_tma_kernel, dl,
                                      {"HAS_GLP": True, "SUM_G": False})):
        bm, bn, bk, gm, warps, _ = CONFIG[name[:-4].replace("lm_head_", "") + "_tma"]
        sig = {k: t for k, t in sig.items() if k not in ("p_h", "p_w", "stride_h", "stride_w")}
        sig = {"d_h": f"tensordesc<bf16[{bm},{bk}]>", "d_w": f"tensordesc<bf16[{bn},{bk}]>", **sig}
        yield (name, kernel, sig, {"HAS_BIAS": True, "EXACT_SHIFT": False, "BM": bm, "BN": bn, "BK": bk,
                                   "GROUP_M": gm, "NUM_SMS": NOMINAL_SMS, "PROMOTE": True, **flags}, warps)
    ids = {"p_h": "*bf16", "p_w": "*bf16", "p_b": "*bf16", "p_idx": "*i64", "p_g": "*fp32", "p_coef": "*fp32",
           "p_out": "*fp32", "N": "i32", "K": "i32", "H": "i32", "V": "i32", "stride_h": "i32", "stride_w": "i32",
           "v_lo": "i32", "scale": "fp32"}
    for name, dlogits in (("lm_head_ids", False), ("lm_head_ids_dlogits", True)):
        yield (name, _ids_kernel, ids, {"HAS_BIAS": True, "DLOGITS": dlogits, "EXACT_SHIFT": False, "BLOCK_K": 16,
                                        "BLOCK_H": 128, "BLOCK_J": 64}, 4)
    yield ("lm_head_scatter_ids", _scatter_ids_kernel,
           {"p_val": "*fp32", "p_idx": "*i64", "p_dz": "*bf16", "NK": "i64", "K": "i32", "VC": "i32",
            "stride_dz": "i32", "v_lo": "i32"}, {"BLOCK": 1024}, 4)
    yield ("lm_head_add_id_grads", _add_id_grads_kernel, {"p_coef": "*fp32", "p_g": "*fp32", "N": "i32", "K": "i32"},
           {"BLOCK_R": 128}, 4)
    yield ("lm_head_tile_merge", _tile_merge_kernel,
           {"p_part": "*fp32", "p_run": "*fp32", "NT": "i32", "plane": "i64", "stride_run": "i32", "scale": "fp32"},
           {"EXACT_SHIFT": False, "BLOCK_T": MERGE_BLOCK_T}, 4)
    mm = {"p_a": "*bf16", "p_b": "*bf16", "p_c": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32",
          "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32", "stride_cm": "i32"}
    for name, dtype, ieee in (("matmul", "*bf16", False), ("matmul32", "*fp32", True)):
        bm, bn, bk, gm, warps, _ = MATMUL_CONFIG[name]
        yield (f"lm_head_{name}", _matmul_kernel, {**mm, "p_a": dtype, "p_b": dtype},
               {"ACCUMULATE": True, "UPCAST": False, "IEEE": ieee, "PROMOTE": True, "BM": bm, "BN": bn, "BK": bk,
                "GROUP_M": gm}, warps)
