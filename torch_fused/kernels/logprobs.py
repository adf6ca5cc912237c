"""Triton kernels for log-probs at indices and entropy of softmax(logits / T), and their backward.

Conventions (after flash-linear-attention): ``p_`` pointers, ``b_`` blocks, int64 row offsets.
One program handles one row of V logits in a single streaming pass; a row may start anywhere,
given by two (size, stride) pairs for the leading dims, so strided views run without a copy.

Numerics. Work is in base 2 with c = log2(e) / T. In the forward a block of logits is a
[NR, EPT] tile, each tile row one thread's 16-byte vector; every tile row keeps its own running
max m_k of the raw logits and sums s_k = sum 2^d and, for the entropy, t_k = sum 2^d d, with
d = x c - m_k c formed by one fma (see _shifted), so d carries only a relative rounding of
itself. Max, rescale and sums never leave the thread; the tile rows are combined once per row
(_forward_combine) against the row max m, with the shifts' difference taken between the same
rounded products that _shifted used. The row statistics saved for the backward are the pair
(m, log2 s), never lse = m c + log2 s as one fp32 number: for |z| ~ 1e4 that sum would carry a
rounding of ~1e-3, which every log-prob and gradient would inherit. In nats:
logp = (d_i - log2 s) ln2 and H = (log2 s - t / s) ln2 (no lse - E[z] cancellation).

Cost. Each thread keeps its own running maxima, combined once per row: a block max reduced
across the threads on every block (shuffles, a shared-memory exchange, two barriers) makes the
pass wait on itself and needs more registers, which costs occupancy. Full blocks run unmasked, with the next block's load issued before
the current block's math (one row per program leaves no other source of loads in flight); in
the backward the index term touches only the block that holds the index.
Non-finite input: a NaN or +inf logit makes its row NaN; -inf is a masked entry (probability 0);
a row of only -inf gives NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..settings import current as settings
from .._library import LN2 as _LN2, LOG2E as _LOG2E, T_MAX as _T_MAX, T_MIN as _T_MIN

# constexpr globals: usable inside @triton.jit
LOG2E_C = tl.constexpr(_LOG2E)
T_MIN_C = tl.constexpr(_T_MIN)
T_MAX_C = tl.constexpr(_T_MAX)
LN2 = tl.constexpr(_LN2)


@triton.jit
def _row_base(p_x, row, inner_size, stride_outer, stride_inner):
    return p_x + (row // inner_size) * stride_outer + (row % inner_size) * stride_inner


# exp2(-200) is 0 in fp32: the entropy sum t = sum e * max(d, D_MIN) then takes exactly 0 from
# a -inf logit (no 0 * inf). A NaN logit still poisons its row through e = exp2(NaN).
D_MIN = tl.constexpr(-200.0)


@triton.jit
def _shifted(b_x, m, c, EXACT_SHIFT: tl.constexpr):
    """d = x c - m c in base-2 units. On the GPU one fma (exact product, one rounding) against
    the rounded shift m c; every kernel forms m c the same way, so that rounding is a constant
    shift of the whole row and cancels in log2 s. Triton's interpreter has no single-rounding
    fma, so there (EXACT_SHIFT) the equally exact (x - m) c is used."""
    if EXACT_SHIFT:
        return (b_x - m) * c
    else:
        return tl.fma(b_x, c, -(m * c))


@triton.jit
def _forward_update(b_x, c, m_r, s_r, t_r, HAS_ENT: tl.constexpr, EXACT_SHIFT: tl.constexpr):
    """One [NR, EPT] block: every tile row (EPT contiguous logits, one thread's 16-byte vector)
    keeps its own running max m_r and sums s_r = sum 2^d, t_r = sum 2^d d, d against its own
    shift. Max, rescale and sums stay inside the thread: no cross-lane reduction per block."""
    m_new = tl.maximum(m_r, tl.max(b_x, axis=1))
    # rescale to the new shift (a factor of 1 where the max did not grow); -inf so far: the sums
    # are 0, shift by 0 (no inf - inf)
    dm = tl.where(m_r == float("-inf"), 0.0, _shift_diff(m_r, m_new, c, EXACT_SHIFT))
    alpha = tl.exp2(dm)
    if HAS_ENT:
        t_r = alpha * (t_r + dm * s_r)
    s_r = s_r * alpha
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    b_d = _shifted(b_x, m_ref[:, None], c, EXACT_SHIFT)
    b_e = tl.exp2(b_d)
    s_r += tl.sum(b_e, axis=1)
    if HAS_ENT:
        t_r += tl.sum(b_e * tl.maximum(b_d, D_MIN), axis=1)
    return m_new, s_r, t_r


@triton.jit
def _shift_diff(m_a, m_b, c, EXACT_SHIFT: tl.constexpr):
    """(a - b) in the base-2 units of _shifted: round(m_a c) - round(m_b c) on the GPU, the
    difference of the two rounded shifts that _shifted subtracted (exact by Sterbenz wherever it
    matters). mul_rn keeps ptxas from fusing a product into the subtraction, which would use
    the exact m_a c and be off by up to half an ulp of it (5e-4 at |m c| ~ 1.4e4).
    The interpreter's _shifted is (x - m) c, so there this is (m_a - m_b) c."""
    if EXACT_SHIFT:
        return (m_a - m_b) * c
    else:
        return libdevice.mul_rn(m_a, c) - libdevice.mul_rn(m_b, c)


@triton.jit
def _forward_combine(m_r, s_r, t_r, c, HAS_ENT: tl.constexpr, EXACT_SHIFT: tl.constexpr):
    """Row max m and the row sums s, t against the row's shift m c, from the tile rows' own."""
    m = tl.max(m_r, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    live = m_r != float("-inf")  # tile rows that saw a finite or +inf logit
    delta = tl.where(live, _shift_diff(m_r, m, c, EXACT_SHIFT), 0.0)
    w = tl.where(live, tl.exp2(delta), 0.0)
    s = tl.sum(w * s_r, axis=0)
    t = 0.0
    if HAS_ENT:
        t = tl.sum(tl.where(live, w * (t_r + delta * s_r), 0.0), axis=0)
    return m, s, t


@triton.jit
def _merge_pair(m_a, s_a, t_a, m_b, s_b, t_b, c, EXACT_SHIFT: tl.constexpr):
    """Two parts' (m, s, t) of one row merged, as _forward_combine merges tile rows: a side with
    s == 0 (only -inf logits so far) holds the placeholder max 0, so it neither sets the max nor
    weighs (its factor is 0: no 0 * inf)."""
    m = tl.where(s_b == 0.0, m_a, tl.where(s_a == 0.0, m_b, tl.maximum(m_a, m_b)))
    da = _shift_diff(m_a, m, c, EXACT_SHIFT)
    db = _shift_diff(m_b, m, c, EXACT_SHIFT)
    ea = tl.where(s_a == 0.0, 0.0, tl.exp2(da))
    eb = tl.where(s_b == 0.0, 0.0, tl.exp2(db))
    return m, s_a * ea + s_b * eb, ea * (t_a + da * s_a) + eb * (t_b + db * s_b)


@triton.jit
def _below_tau(b_x, tau, HAS_TAU: tl.constexpr):
    """b_x with the values below tau as -inf (HAS_TAU), else b_x. ``<``: a NaN is kept."""
    if HAS_TAU:
        return tl.where(b_x < tau, float("-inf"), b_x)
    else:
        return b_x


@triton.jit
def _row_statistics(p_row, V, c, tau, HAS_ENT: tl.constexpr, EXACT_SHIFT: tl.constexpr, HAS_TAU: tl.constexpr,
                    BLOCK_V: tl.constexpr, EPT: tl.constexpr):
    """(m, s, t) of one row of V logits in one streaming pass: the row max and the sums
    s = sum 2^d, t = sum 2^d d against the shift m c. A block is a [NR, EPT] tile, row k of
    it logits k*EPT .. k*EPT+EPT-1, one thread's 16-byte vector; full blocks run unmasked with
    the next block's load issued before this block's math. HAS_TAU: logits below the row's
    threshold tau count as -inf (the sampler's support; a NaN stays NaN)."""
    NR: tl.constexpr = BLOCK_V // EPT
    o_v = tl.arange(0, NR)[:, None] * EPT + tl.arange(0, EPT)[None, :]
    s_r = tl.zeros([NR], dtype=tl.float32)
    t_r = tl.zeros([NR], dtype=tl.float32)
    m_r = tl.full([NR], float("-inf"), tl.float32)
    v_full = V - V % BLOCK_V
    if v_full > 0:
        b_x = _below_tau(tl.load(p_row + o_v).to(tl.float32), tau, HAS_TAU)
        for start in range(BLOCK_V, v_full, BLOCK_V):
            b_nx = _below_tau(tl.load(p_row + start + o_v).to(tl.float32), tau, HAS_TAU)
            m_r, s_r, t_r = _forward_update(b_x, c, m_r, s_r, t_r, HAS_ENT, EXACT_SHIFT)
            b_x = b_nx
        m_r, s_r, t_r = _forward_update(b_x, c, m_r, s_r, t_r, HAS_ENT, EXACT_SHIFT)
    if v_full < V:
        o = v_full + o_v
        b_x = _below_tau(tl.load(p_row + o, mask=o < V, other=float("-inf")).to(tl.float32), tau, HAS_TAU)
        m_r, s_r, t_r = _forward_update(b_x, c, m_r, s_r, t_r, HAS_ENT, EXACT_SHIFT)
    return _forward_combine(m_r, s_r, t_r, c, HAS_ENT, EXACT_SHIFT)


@triton.jit
def _listed_statistics(p_row, p_list, n, V, c, HAS_ENT: tl.constexpr, EXACT_SHIFT: tl.constexpr,
                       BLOCK_V: tl.constexpr, EPT: tl.constexpr):
    """(m, s, t) as _row_statistics with a threshold, from the row's support list instead of the
    row: its n positions at p_list are every logit >= the threshold (the list of
    kernels/sampler.py, which lists no row holding a NaN), gathered and summed in [NR, EPT]
    blocks of list entries."""
    NR: tl.constexpr = BLOCK_V // EPT
    o_v = tl.arange(0, NR)[:, None] * EPT + tl.arange(0, EPT)[None, :]
    s_r = tl.zeros([NR], dtype=tl.float32)
    t_r = tl.zeros([NR], dtype=tl.float32)
    m_r = tl.full([NR], float("-inf"), tl.float32)
    for i0 in range(0, n, BLOCK_V):
        o = i0 + o_v
        pos = tl.load(p_list + o, mask=o < n, other=-1)
        live = (o < n) & (pos >= 0) & (pos < V)
        b_x = tl.load(p_row + pos, mask=live, other=float("-inf")).to(tl.float32)
        m_r, s_r, t_r = _forward_update(b_x, c, m_r, s_r, t_r, HAS_ENT, EXACT_SHIFT)
    return _forward_combine(m_r, s_r, t_r, c, HAS_ENT, EXACT_SHIFT)


@triton.jit
def _temperature_scale(scale, inv_t, p_temp, T_FROM_PTR: tl.constexpr):
    """(c, 1/T): from the launch arguments, or (T_FROM_PTR) from a device scalar T, which may
    require grad. A T read from memory that is not positive and finite (<= 0, inf, NaN) gives
    NaN (it cannot be checked without a sync)."""
    if T_FROM_PTR:
        t = tl.load(p_temp)
        ok = (t > 0.0) & (t < float("inf"))  # False for NaN
        # _library.kernel_temperature, in T's own dtype (a float64 1e-300 is positive); the NaN
        # goes in after the clamp, whose minimum and maximum return the non-NaN operand
        t = tl.minimum(tl.maximum(t, T_MIN_C), T_MAX_C)
        t = tl.where(ok, t, float("nan")).to(tl.float32)
        return LOG2E_C / t, 1.0 / t
    else:
        # fp32, as Triton's own launcher passes a Python float; Inductor's generated launches pass
        # one that fp32 cannot hold exactly as fp64 (the same value after this rounding)
        return tl.cast(scale, tl.float32), tl.cast(inv_t, tl.float32)


@triton.jit
def _logprobs_entropy_forward_kernel(
    p_x, p_idx, p_logp, p_ent, p_stats, p_temp, p_tau, p_sup,
    V, K, inner_size, stride_outer, stride_inner,
    scale,  # c = log2(e) / T: a Python float at launch, so fp32 in the kernel
    ignore_index,
    sup_stride,  # the support lists' row stride (count, then positions)
    HAS_INDEX: tl.constexpr, HAS_ENT: tl.constexpr, EXACT_SHIFT: tl.constexpr, T_FROM_PTR: tl.constexpr,
    HAS_TAU: tl.constexpr, HAS_SUP: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    EPT: tl.constexpr,
):
    """HAS_TAU: the row's logits below its threshold p_tau[row] are taken as -inf (the sampler's
    support, ops/sampler.py): an id there scores -inf. HAS_SUP: a row whose support list
    p_sup[row] = (n, positions...) has n >= 0 takes its statistics from the n listed logits
    (_listed_statistics) without reading the rest of the row."""
    row = tl.program_id(0).to(tl.int64)
    p_row = _row_base(p_x, row, inner_size, stride_outer, stride_inner)
    c, _ = _temperature_scale(scale, scale, p_temp, T_FROM_PTR)
    tau = 0.0
    if HAS_TAU:
        tau = tl.load(p_tau + row)

    if HAS_INDEX:
        # issue the few scattered loads first so their latency hides under the stream
        o_k = tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_idx = tl.load(p_idx + row * K + o_k, mask=m_k, other=0).to(tl.int64)
        inb = (b_idx >= 0) & (b_idx < V)
        b_xi = _below_tau(tl.load(p_row + b_idx, mask=m_k & inb, other=0.0).to(tl.float32), tau, HAS_TAU)

    # p_sup is None without HAS_SUP: the listed branch must not be compiled then (a local set to a
    # Python constant is a tensor to the compiler, so the test stays under the constexpr one)
    if HAS_SUP:
        n_sup = tl.load(p_sup + row * sup_stride)
        if n_sup >= 0:
            m, s, t = _listed_statistics(p_row, p_sup + row * sup_stride + 1, n_sup, V, c, HAS_ENT, EXACT_SHIFT,
                                         BLOCK_V, EPT)
        else:
            m, s, t = _row_statistics(p_row, V, c, tau, HAS_ENT, EXACT_SHIFT, HAS_TAU, BLOCK_V, EPT)
    else:
        m, s, t = _row_statistics(p_row, V, c, tau, HAS_ENT, EXACT_SHIFT, HAS_TAU, BLOCK_V, EPT)
    log2s = tl.log2(s)
    tl.store(p_stats + row * 2, m)
    tl.store(p_stats + row * 2 + 1, log2s)
    if HAS_ENT:
        tl.store(p_ent + row, (log2s - t / s) * LN2)
    if HAS_INDEX:
        b_lp = (_shifted(b_xi, m, c, EXACT_SHIFT) - log2s) * LN2
        b_lp = tl.where(inb, b_lp, float("nan"))
        b_lp = tl.where(b_idx == ignore_index, 0.0, b_lp)
        tl.store(p_logp + row * K + o_k, b_lp, mask=m_k)


@triton.jit
def _chunk_merge_kernel(
    p_x, p_idx, p_run, p_u, p_mo,
    V, K, stride_row, v_off, first,
    scale,  # c = log2(e) / T
    EXACT_SHIFT: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EPT: tl.constexpr,
):
    """One vocabulary chunk of the fused lm_head: columns v_off .. v_off + V - 1 of each row's
    logits (a contiguous [rows, V] fp32 chunk). Folds the chunk's statistics into the row's
    running ones, run = (m, s, t) with s = sum 2^d and t = sum 2^d d against the shift m c, as
    _forward_combine folds tile rows (first: the chunk's own are stored). For each of the row's K
    ids inside the chunk, stores u = x c - m_c c (its d against the chunk's shift) and the
    chunk's max m_c in p_mo; the caller finishes log2 s, the entropy and the log-probs."""
    row = tl.program_id(0).to(tl.int64)
    p_row = p_x + row * stride_row
    c = scale
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    b_loc = tl.load(p_idx + row * K + o_k, mask=m_k, other=-1).to(tl.int64) - v_off
    inside = m_k & (b_loc >= 0) & (b_loc < V)
    b_xi = tl.load(p_row + b_loc, mask=inside, other=0.0).to(tl.float32)

    m_c, s_c, t_c = _row_statistics(p_row, V, c, 0.0, True, EXACT_SHIFT, False, BLOCK_V, EPT)

    tl.store(p_u + row * K + o_k, _shifted(b_xi, m_c, c, EXACT_SHIFT), mask=inside)
    tl.store(p_mo + row * K + o_k, tl.zeros([BLOCK_K], dtype=tl.float32) + m_c, mask=inside)
    if first != 0:
        m, s, t = m_c, s_c, t_c
    else:
        m0 = tl.load(p_run + row * 3)
        s0 = tl.load(p_run + row * 3 + 1)
        t0 = tl.load(p_run + row * 3 + 2)
        m, s, t = _merge_pair(m0, s0, t0, m_c, s_c, t_c, c, EXACT_SHIFT)
    tl.store(p_run + row * 3, m)
    tl.store(p_run + row * 3 + 1, s)
    tl.store(p_run + row * 3 + 2, t)


@triton.jit
def _backward_block(b_x, o, p_drow, p_idx_row, p_g_row, g_sk, start, V, K, c, m, log2s, a, b, it,
                    idx0, g0, ignore_index, v_off, p_row, tau,
                    HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr, SINGLE_K: tl.constexpr,
                    MASKED: tl.constexpr, EXACT_SHIFT: tl.constexpr, HAS_DT: tl.constexpr,
                    BLOCK_V: tl.constexpr, LISTED: tl.constexpr, HAS_TAU: tl.constexpr):
    """Writes the block's d x; returns its sum of x * dx (for d T) when HAS_DT, else 0. LISTED:
    the block's columns o are a list's (any columns, V past the list's end), not a run from start.
    HAS_TAU: an id whose logit (in p_row) is below tau adds nothing (the single id's g0 comes
    zeroed already)."""
    b_d = _shifted(b_x, m, c, EXACT_SHIFT) - log2s  # log2 p
    b_p = tl.exp2(b_d)
    if HAS_GH:
        b_dx = -b_p * (a + b * tl.maximum(b_d, D_MIN))
    else:
        b_dx = -b_p * a
    if HAS_GLP:
        if SINGLE_K:
            if LISTED:
                b_dx += tl.where(o == idx0, g0, 0.0)
            elif (idx0 >= start) & (idx0 < start + BLOCK_V):  # only the block holding the id
                b_dx += tl.where(o == idx0, g0, 0.0)
        else:
            for k in range(0, K):
                i_k = tl.load(p_idx_row + k).to(tl.int64)
                g_k = tl.load(p_g_row + k * g_sk).to(tl.float32)
                g_k = tl.where(i_k == ignore_index, 0.0, g_k) * it
                if HAS_TAU:
                    inside = (i_k - v_off >= 0) & (i_k - v_off < V)
                    x_k = tl.load(p_row + (i_k - v_off), mask=inside, other=0.0).to(tl.float32)
                    g_k = tl.where(inside & (x_k < tau), 0.0, g_k)
                b_dx += tl.where(o == i_k - v_off, g_k, 0.0)
    if MASKED:
        tl.store(p_drow + o, b_dx.to(p_drow.dtype.element_ty), mask=o < V)
    else:
        tl.store(p_drow + o, b_dx.to(p_drow.dtype.element_ty))
    if HAS_DT:  # -inf logits have dx = 0 and lanes past V hold garbage: keep them out of the sum
        keep = b_dx != 0.0
        if MASKED:
            keep = keep & (o < V)
        # sum_j x_j dx_j = sum_j (x_j - m) dx_j, since a row's dx sums to zero: the shifted form
        # keeps a constant logit offset (rows near 1e4) out of the rounding
        return tl.sum(tl.where(keep, (b_x.to(tl.float32) - m) * b_dx, 0.0), axis=0)
    else:
        return 0.0


@triton.jit
def _zero_row(p_drow, V, BLOCK_V: tl.constexpr):
    o_v = tl.arange(0, BLOCK_V)
    b_z = tl.zeros([BLOCK_V], dtype=p_drow.dtype.element_ty)
    for start in range(0, V, BLOCK_V):
        tl.store(p_drow + start + o_v, b_z, mask=start + o_v < V)


@triton.jit
def _logprobs_entropy_backward_kernel(
    p_x, p_idx, p_glp, p_gh, p_stats, p_ent, p_dx, p_dz, p_temp, p_xdx, p_tau, p_sup,
    V, K, n_rows, inner_size, stride_outer, stride_inner,
    v_off, V_total,  # the rows hold ids v_off .. v_off + V - 1 of a vocabulary of V_total
    dx_inner, dx_outer, dx_stride,  # d x row layout (as the logits' rows)
    dz_inner, dz_outer, dz_stride,  # layout of the zero rows past n_rows (shift: position L)
    scale,  # c = log2(e) / T
    inv_t,  # 1 / T
    ignore_index,
    segs, seg_len,  # each row's columns in segs segments of seg_len (a multiple of BLOCK_V), one per program
    glp_sr, glp_sk, gh_s,  # strides of the upstream gradients [rows, K] and [rows] (0: expanded)
    sup_stride,  # the support lists' row stride (count, then positions)
    HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr, SINGLE_K: tl.constexpr, EXACT_SHIFT: tl.constexpr,
    T_FROM_PTR: tl.constexpr, HAS_DT: tl.constexpr, ZERO_TAIL: tl.constexpr, IN_PLACE: tl.constexpr,
    HAS_TAU: tl.constexpr, HAS_SUP: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """d z_j = sum_k g_k [j == idx_k] - p_j * (G + gH * (lp_j + H));  d x = d z / T.

    G: sum of the row's valid log-prob gradients; gH: the entropy gradient;
    lp_j = log p_j = ((x_j - m) c - log2 s) ln2. With HAS_DT, also the row's sum of x_j dx_j
    (d T = -(1/T) sum over all rows, as z = x / T). The V columns may be a slice of a larger
    vocabulary (ids v_off .. v_off + V - 1 of V_total, with the row statistics of the whole
    row): G counts every id, the scatter only ids in the slice. With ZERO_TAIL, programs past n_rows write
    the zero rows of d x that no row scores (shift: the last position of every sequence), so
    the whole gradient is written by one launch. With IN_PLACE, d x overwrites the logits: row r
    of d x (narrower elements) starts at the bytes of row r of x, so its block k lies in bytes of
    x blocks <= k; a barrier before each block's stores orders every warp's loads of those bytes
    before them (another warp's thread holds them).

    A row's columns are split into segs segments of seg_len columns, one program each (program
    row * segs + seg), so a launch of a few long rows still ends in short programs instead of a
    tail of whole-row programs (the segment length: docs/BENCHMARKS.md, the log-prob section).
    A segment is the V slice above with the whole row's statistics. HAS_DT and IN_PLACE launches
    keep one segment (their per-row sum, their in-row overlap of d x and x).

    HAS_TAU (the sampler's support, ops/sampler.py): logits below the row's threshold p_tau[row]
    are -inf, so their d x is 0, and an id below it passes no gradient (its log-prob was -inf).
    HAS_SUP: a row whose support list p_sup[row] = (n, positions...) has n >= 0 lists every
    column it keeps: its segment is zeroed and only the listed columns are read and written,
    without a pass over its logits; a row with n < 0 streams as without it."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // segs
    c0 = (pid % segs) * seg_len  # the segment's first column
    v_seg = tl.minimum(V - c0, seg_len).to(tl.int32)
    live = True
    if ZERO_TAIL:
        live = row < n_rows
    if live:
        _backward_row(p_x + c0, p_idx, p_glp, p_gh, p_stats, p_ent, p_dx + c0, p_temp, p_xdx, p_tau, p_sup, row,
                      v_seg, K, c0, v_off + c0, V_total, inner_size, stride_outer, stride_inner, dx_inner, dx_outer,
                      dx_stride, scale, inv_t, ignore_index, glp_sr, glp_sk, gh_s, sup_stride, HAS_GLP, HAS_GH,
                      SINGLE_K, EXACT_SHIFT, T_FROM_PTR, HAS_DT, IN_PLACE, HAS_TAU, HAS_SUP, BLOCK_V, BLOCK_K)
    elif ZERO_TAIL:  # p_dz is None without it
        _zero_row(_row_base(p_dz, row - n_rows, dz_inner, dz_outer, dz_stride) + c0, v_seg, BLOCK_V)


@triton.jit
def _backward_row(p_x, p_idx, p_glp, p_gh, p_stats, p_ent, p_dx, p_temp, p_xdx, p_tau, p_sup, row, V, K, c0, v_off,
                  V_total, inner_size, stride_outer, stride_inner, dx_inner, dx_outer, dx_stride,
                  scale, inv_t, ignore_index, glp_sr, glp_sk, gh_s, sup_stride,
                  HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr, SINGLE_K: tl.constexpr,
                  EXACT_SHIFT: tl.constexpr, T_FROM_PTR: tl.constexpr, HAS_DT: tl.constexpr,
                  IN_PLACE: tl.constexpr, HAS_TAU: tl.constexpr, HAS_SUP: tl.constexpr, BLOCK_V: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """One row's (segment's) d x; c0: the segment's first column in the row (p_x, p_dx and v_off
    are already past it)."""
    p_row = _row_base(p_x, row, inner_size, stride_outer, stride_inner)
    p_drow = _row_base(p_dx, row, dx_inner, dx_outer, dx_stride)
    c, it = _temperature_scale(scale, inv_t, p_temp, T_FROM_PTR)
    m = tl.load(p_stats + row * 2).to(tl.float32)
    log2s = tl.load(p_stats + row * 2 + 1).to(tl.float32)
    tau = 0.0
    if HAS_TAU:
        tau = tl.load(p_tau + row)

    gsum = 0.0
    idx0 = -1
    g0 = 0.0
    if HAS_GLP:
        o_k = tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_idx = tl.load(p_idx + row * K + o_k, mask=m_k, other=ignore_index).to(tl.int64)
        b_g = tl.load(p_glp + row * glp_sr + o_k * glp_sk, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.where(b_idx == ignore_index, 0.0, b_g)
        inb = (b_idx >= 0) & (b_idx < V_total)
        # an out-of-range index gave NaN forward: its row's gradient is NaN too
        b_g = tl.where((b_idx != ignore_index) & (~inb), float("nan"), b_g)
        if HAS_TAU:  # an id below the threshold scored -inf: no gradient through it
            b_xi = tl.load(p_row + (b_idx - v_off), mask=m_k & inb, other=0.0).to(tl.float32)
            b_g = tl.where(inb & (b_xi < tau), 0.0, b_g)
        gsum = tl.sum(b_g, axis=0)  # every id's term, also of ids outside these V columns
        if SINGLE_K:  # the column of the id; outside 0..V-1 it matches no column
            idx0 = tl.sum(tl.where(o_k == 0, b_idx - v_off, 0), axis=0)
            g0 = tl.sum(tl.where(o_k == 0, b_g, 0.0), axis=0) * it
    # d x_j = -p_j * (a + b * d_j) + scatter, d_j = log2 p_j, constants folded per row
    a = gsum
    b = 0.0
    if HAS_GH:
        gh = tl.load(p_gh + row * gh_s).to(tl.float32)
        h = tl.load(p_ent + row).to(tl.float32)
        a = a + gh * h
        b = gh * LN2
    a = a * it
    b = b * it

    p_idx_row = p_idx  # None without HAS_GLP (an argument the launch leaves out)
    p_g_row = p_glp
    if HAS_GLP:
        p_idx_row = p_idx + row * K
        p_g_row = p_glp + row * glp_sr
    xdx = 0.0
    if HAS_SUP:
        n_sup = tl.load(p_sup + row * sup_stride)
        if n_sup >= 0:
            xdx = _backward_listed(p_row, p_drow, p_sup + row * sup_stride, n_sup, c0, p_idx_row, p_g_row, glp_sk, V,
                                   K, c, m, log2s, a, b, it, idx0, g0, ignore_index, v_off, tau, HAS_GLP, HAS_GH,
                                   SINGLE_K, EXACT_SHIFT, HAS_DT, HAS_TAU, BLOCK_V)
        else:
            xdx = _backward_stream(p_row, p_drow, p_idx_row, p_g_row, glp_sk, V, K, c, m, log2s, a, b, it, idx0, g0,
                                   ignore_index, v_off, tau, HAS_GLP, HAS_GH, SINGLE_K, EXACT_SHIFT, HAS_DT, IN_PLACE,
                                   HAS_TAU, BLOCK_V)
    else:
        xdx = _backward_stream(p_row, p_drow, p_idx_row, p_g_row, glp_sk, V, K, c, m, log2s, a, b, it, idx0, g0,
                               ignore_index, v_off, tau, HAS_GLP, HAS_GH, SINGLE_K, EXACT_SHIFT, HAS_DT, IN_PLACE,
                               HAS_TAU, BLOCK_V)
    if HAS_DT:
        tl.store(p_xdx + row, xdx)


@triton.jit
def _backward_listed(p_row, p_drow, p_list, n, c0, p_idx_row, p_g_row, glp_sk, V, K, c, m, log2s, a, b, it, idx0, g0,
                     ignore_index, v_off, tau, HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr, SINGLE_K: tl.constexpr,
                     EXACT_SHIFT: tl.constexpr, HAS_DT: tl.constexpr, HAS_TAU: tl.constexpr, BLOCK_V: tl.constexpr):
    """A listed row's segment: zeros, then (after a barrier: other threads wrote zeros there) the
    d x of the listed columns inside the segment, read from the logits at those columns alone."""
    _zero_row(p_drow, V, BLOCK_V)
    tl.debug_barrier()
    o_l = tl.arange(0, BLOCK_V)
    xdx = 0.0
    for i0 in range(0, n, BLOCK_V):
        i = i0 + o_l
        j = tl.load(p_list + 1 + i, mask=i < n, other=-1) - c0
        j = tl.where((i < n) & (j >= 0) & (j < V), j, V)  # column V: not this segment's
        b_x = tl.load(p_row + j, mask=j < V, other=0.0).to(tl.float32)
        xdx += _backward_block(b_x, j, p_drow, p_idx_row, p_g_row, glp_sk, 0, V, K, c, m, log2s, a, b, it, idx0, g0,
                               ignore_index, v_off, p_row, tau, HAS_GLP, HAS_GH, SINGLE_K, True, EXACT_SHIFT, HAS_DT,
                               BLOCK_V, True, HAS_TAU)
    return xdx


@triton.jit
def _backward_stream(p_row, p_drow, p_idx_row, p_g_row, glp_sk, V, K, c, m, log2s, a, b, it, idx0, g0,
                     ignore_index, v_off, tau, HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr, SINGLE_K: tl.constexpr,
                     EXACT_SHIFT: tl.constexpr, HAS_DT: tl.constexpr, IN_PLACE: tl.constexpr, HAS_TAU: tl.constexpr,
                     BLOCK_V: tl.constexpr):
    """A row's (segment's) d x in one streaming pass over its logits."""
    o_v = tl.arange(0, BLOCK_V)
    v_full = V - V % BLOCK_V
    xdx = 0.0
    if v_full > 0:
        b_x = _below_tau(tl.load(p_row + o_v).to(tl.float32), tau, HAS_TAU)
        for start in range(BLOCK_V, v_full, BLOCK_V):
            b_nx = _below_tau(tl.load(p_row + start + o_v).to(tl.float32), tau, HAS_TAU)  # prefetch the next block
            if IN_PLACE:  # every warp's loads of blocks <= k+1 before any store of block k
                tl.debug_barrier()
            xdx += _backward_block(b_x, start - BLOCK_V + o_v, p_drow, p_idx_row, p_g_row, glp_sk, start - BLOCK_V, V, K, c,
                                   m, log2s, a, b, it, idx0, g0, ignore_index, v_off, p_row, tau, HAS_GLP, HAS_GH,
                                   SINGLE_K, False, EXACT_SHIFT, HAS_DT, BLOCK_V, False, HAS_TAU)
            b_x = b_nx
        if IN_PLACE:
            tl.debug_barrier()
        xdx += _backward_block(b_x, v_full - BLOCK_V + o_v, p_drow, p_idx_row, p_g_row, glp_sk, v_full - BLOCK_V, V, K, c,
                               m, log2s, a, b, it, idx0, g0, ignore_index, v_off, p_row, tau, HAS_GLP, HAS_GH, SINGLE_K,
                               False, EXACT_SHIFT, HAS_DT, BLOCK_V, False, HAS_TAU)
    if v_full < V:
        o = v_full + o_v
        b_x = _below_tau(tl.load(p_row + o, mask=o < V, other=0.0).to(tl.float32), tau, HAS_TAU)
        if IN_PLACE:
            tl.debug_barrier()
        xdx += _backward_block(b_x, o, p_drow, p_idx_row, p_g_row, glp_sk, v_full, V, K, c,
                               m, log2s, a, b, it, idx0, g0, ignore_index, v_off, p_row, tau, HAS_GLP, HAS_GH, SINGLE_K,
                               True, EXACT_SHIFT, HAS_DT, BLOCK_V, False, HAS_TAU)
    return xdx


# (BLOCK_V, num_warps) per kernel: small blocks and few warps keep many rows in flight per SM,
# which is what a streaming pass needs. python -m torch_fused.bench --sweep --only logprobs
# times them against the other points of SWEEP_CONFIGS (torch_fused/bench/logprobs.py).
_CONFIGS = {"fwd": (1024, 2), "fwd_ent": (1024, 2), "bwd": (2048, 4)}


def backward_segments(v: int, block_v: int) -> tuple[int, int]:
    """(segs, seg_len) of the backward over rows of v columns (segments of a row, see
    _logprobs_entropy_backward_kernel): about the logprobs_bwd_segment setting's columns each
    (0: one program per row), a multiple of block_v, the row split into equal segments (the
    last one shorter)."""
    seg = settings.logprobs_bwd_segment
    if seg <= 0 or v <= seg:
        return 1, max(v, 1)
    per = triton.cdiv(v, triton.cdiv(v, seg))
    seg_len = triton.cdiv(per, block_v) * block_v
    return triton.cdiv(v, seg_len), seg_len


def pick_block(v: int, elem_size: int, kind: str = "fwd") -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a row of v elements of elem_size bytes; kind is 'fwd'
    (log-probs only), 'fwd_ent' (with the entropy) or 'bwd'. The logprobs_block and small_tiles
    settings replace the choice."""
    if settings.logprobs_block is not None:
        block, warps = settings.logprobs_block
        return min(block, triton.next_power_of_2(max(v, 16))), warps
    if settings.small_tiles:  # several full 16-column blocks and a masked tail at small V
        return 16, 1
    block, warps = _CONFIGS[kind]
    if elem_size > 2:
        block //= 2  # same bytes per load
    block = min(block, triton.next_power_of_2(max(v, 16)))
    return block, min(warps, max(1, block // 256))


def compile_cases():
    """(name, kernel, signature, constexprs, warps) for tests/test_kernels_compile.py: every
    constexpr branch the launchers in ops/logprobs.py can take."""
    fwd = {"p_x": "*bf16", "p_idx": "*i64", "p_logp": "*fp32", "p_ent": "*fp32", "p_stats": "*fp32", "p_temp": "*fp32",
           "p_tau": "*fp32", "p_sup": "*i32", "V": "i32", "K": "i32", "inner_size": "i32", "stride_outer": "i64",
           "stride_inner": "i64", "scale": "fp32", "ignore_index": "i32", "sup_stride": "i32"}
    for hi, he, tp, tau, sup in [(True, True, False, False, False), (True, False, False, False, False),
                                 (False, True, False, False, False), (True, True, True, False, False),
                                 (True, False, False, True, False), (True, True, True, True, False),
                                 (True, False, False, True, True), (True, True, True, True, True)]:
        # the launcher passes None for the pointers of a feature that is off (a constexpr None)
        off = dict.fromkeys([n for n, on in (("p_idx", hi), ("p_logp", hi), ("p_ent", he), ("p_temp", tp),
                                             ("p_tau", tau), ("p_sup", sup)) if not on])
        yield (f"lp_fwd idx={hi} ent={he} t_ptr={tp} tau={tau} support={sup}", _logprobs_entropy_forward_kernel, fwd,
               {"HAS_INDEX": hi, "HAS_ENT": he, "EXACT_SHIFT": False, "T_FROM_PTR": tp, "HAS_TAU": tau, "HAS_SUP": sup,
                "BLOCK_V": 2048, "BLOCK_K": 2, "EPT": 8, **off}, 4)
    bwd = {"p_x": "*fp16", "p_idx": "*i32", "p_glp": "*fp32", "p_gh": "*fp32", "p_stats": "*fp32",
           "p_ent": "*fp32", "p_dx": "*fp16", "p_dz": "*fp16", "p_temp": "*fp32", "p_xdx": "*fp32", "p_tau": "*fp32",
           "p_sup": "*i32", "V": "i32",
           "K": "i32", "n_rows": "i32", "inner_size": "i32", "stride_outer": "i64", "stride_inner": "i64",
           "v_off": "i32", "V_total": "i32", "dx_inner": "i32", "dx_outer": "i64", "dx_stride": "i64", "dz_inner": "i32", "dz_outer": "i64",
           "dz_stride": "i64", "scale": "fp32", "inv_t": "fp32", "ignore_index": "i32", "segs": "i32",
           "seg_len": "i32", "glp_sr": "i32", "glp_sk": "i32", "gh_s": "i32", "sup_stride": "i32"}
    merge = {"p_x": "*fp32", "p_idx": "*i64", "p_run": "*fp32", "p_u": "*fp32", "p_mo": "*fp32", "V": "i32",
             "K": "i32", "stride_row": "i64", "v_off": "i32", "first": "i32", "scale": "fp32"}
    yield ("lp_chunk_merge", _chunk_merge_kernel, merge,
           {"EXACT_SHIFT": False, "BLOCK_V": 1024, "BLOCK_K": 2, "EPT": 4}, 2)
    for glp, gh, sk, dt, zt, tau, sup in [(True, True, True, False, False, False, False),
                                          (True, False, False, False, True, False, False),
                                          (False, True, True, False, True, False, False),
                                          (True, True, True, True, False, False, False),
                                          (True, False, True, False, True, True, True),
                                          (True, True, False, True, False, True, True),
                                          (False, True, True, False, False, True, False)]:
        yield (f"lp_bwd glp={glp} gh={gh} single={sk} dt={dt} zero_tail={zt} tau={tau} support={sup}",
               _logprobs_entropy_backward_kernel, bwd,
               {"HAS_GLP": glp, "HAS_GH": gh, "SINGLE_K": sk, "EXACT_SHIFT": False, "T_FROM_PTR": dt, "HAS_DT": dt,
                "ZERO_TAIL": zt, "IN_PLACE": False, "HAS_TAU": tau, "HAS_SUP": sup, "BLOCK_V": 2048, "BLOCK_K": 4}, 4)
    # as Inductor launches them where the ops' launches are traced into a compiled graph
    # (settings.compile_inline_kernels): a float that fp32 cannot hold exactly is passed as fp64
    yield ("lp_fwd fp64 scale (inductor)", _logprobs_entropy_forward_kernel, dict(fwd, scale="fp64"),
           {"HAS_INDEX": True, "HAS_ENT": True, "EXACT_SHIFT": False, "T_FROM_PTR": False, "HAS_TAU": False,
            "HAS_SUP": False, "BLOCK_V": 2048, "BLOCK_K": 2, "EPT": 8, "p_temp": None, "p_tau": None,
            "p_sup": None}, 4)
    yield ("lp_bwd fp64 scale (inductor)", _logprobs_entropy_backward_kernel, dict(bwd, scale="fp64", inv_t="fp64"),
           {"HAS_GLP": True, "HAS_GH": True, "SINGLE_K": True, "EXACT_SHIFT": False, "T_FROM_PTR": False,
            "HAS_DT": False, "ZERO_TAIL": False, "IN_PLACE": False, "HAS_TAU": False, "HAS_SUP": False,
            "BLOCK_V": 2048, "BLOCK_K": 2}, 4)
    # the fused lm_head's backward: fp32 logits chunk, bf16 d logits written over it
    inplace = dict(bwd, p_x="*fp32", p_dx="*bf16", p_dz="*bf16", p_idx="*i64")
    yield ("lp_bwd in_place", _logprobs_entropy_backward_kernel, inplace,
           {"HAS_GLP": True, "HAS_GH": True, "SINGLE_K": True, "EXACT_SHIFT": False, "T_FROM_PTR": False,
            "HAS_DT": False, "ZERO_TAIL": False, "IN_PLACE": True, "HAS_TAU": False, "HAS_SUP": False,
            "BLOCK_V": 1024, "BLOCK_K": 2}, 4)
