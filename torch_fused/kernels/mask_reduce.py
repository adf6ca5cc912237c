"""Triton kernel of fused::mask_reduce: y = sum over one dim of x * scale where mask != 0.

The launcher hands every operand as (pointer, 4 strides): the reduce dim r, two outer output dims
and the innermost output dim i. Broadcast operands keep stride 0, so a mask expanded over the
hidden size is read from its few stored elements and never materialized. A program owns a
[BLOCK_R, BLOCK_I] tile of one output row block, walks r, and accumulates into a tile-shaped
register accumulator (one reduction over the tile's rows at the end). Where the mask is
constant along the fast (contiguous) axis, as a [T, k, 1] keep-mask is along the hidden size,
the x load is predicated on it and masked-off rows of x cost no memory traffic; a mask that
varies along the fast axis would break the vectorized load into scalar ones, so there x is
loaded whole and the mask applied by a select. Either way a NaN under the mask never reaches y.
Whichever of r or i has stride 1 is specialized by Triton (integer arguments equal to 1 are
compile-time constants) and becomes the fast axis of the tile, so both the MoE combine
(reduce a small middle dim, contiguous hidden size) and token losses (reduce the contiguous
last dim) read coalesced memory with the same code.

Two details carry the bandwidth (measured on an H200, docs/BENCHMARKS.md):
- Register layout. The fast-axis offsets are marked contiguous in runs of VEC = 16 bytes of x
  only, so x and a narrower mask get the same layout (one 16-byte x vector and one VEC-byte mask
  vector per thread and row). Left alone, the compiler may give a bool mask 16 elements per
  thread and x 8, and convert one layout to the other through shared memory on every trip.
- Bytes in flight. ptxas places each load right before its first use, so several row vectors
  loaded for one trip are still consumed one at a time. The loads of trip k+1 are therefore
  issued before the adds of trip k (software pipelining), which keeps a whole tile per program
  in flight while the previous one is added.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_offsets(s_r, s_i, BCAST_R: tl.constexpr, BCAST_I: tl.constexpr, WIDE: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, VEC: tl.constexpr):
    """In-tile element offsets of one operand: [BLOCK_R, BLOCK_I], or [1, BLOCK_I] / [BLOCK_R, 1]
    when the operand is broadcast (stride 0) along r / i, so a broadcast mask is loaded once per
    distinct stored element instead of once per lane. int32 unless WIDE. Contiguity is declared
    in runs of VEC only (see the module docstring)."""
    o_r = tl.max_contiguous(tl.arange(0, BLOCK_R), VEC)
    o_i = tl.max_contiguous(tl.arange(0, BLOCK_I), VEC)
    if WIDE:
        o_r = o_r.to(tl.int64)
        o_i = o_i.to(tl.int64)
    if BCAST_R:
        return (o_i * s_i)[None, :]
    elif BCAST_I:
        return (o_r * s_r)[:, None]
    else:
        return o_r[:, None] * s_r + o_i[None, :] * s_i


@triton.jit
def _operand_tile(p, a, b, i0, s_0, s_1, s_r, s_i, m_i, PRESENT: tl.constexpr, BCAST_R: tl.constexpr,
                  BCAST_I: tl.constexpr, WIDE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
                  VEC: tl.constexpr):
    """A program's base pointer and in-tile offsets of the mask or the scale, and, for one
    broadcast along r (the same row for every r), that row read once. (p, 0, 0) if absent."""
    p_t = p
    t = 0
    row = 0
    if PRESENT:
        p_t = p + a * s_0 + b * s_1 + i0 * s_i
        t = _tile_offsets(s_r, s_i, BCAST_R, BCAST_I, WIDE, BLOCK_R, BLOCK_I, VEC)
        if BCAST_R:
            row = tl.load(p_t + t, mask=m_i[None, :], other=0)
    return p_t, t, row


@triton.jit
def _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, r0, o_r, m_i, R, sx_r, sm_r, ss_r,
               HAS_MASK: tl.constexpr, M_BCAST_R: tl.constexpr, M_BCAST_I: tl.constexpr, PRED_X: tl.constexpr,
               HAS_SCALE: tl.constexpr, S_BCAST_R: tl.constexpr, S_BCAST_I: tl.constexpr,
               M_EVICT: tl.constexpr, X_EVICT: tl.constexpr):
    """(x, keep, scale) of the tile at rows r0.. as loaded: keep is mask != 0 (0 without a mask),
    scale 0.0 without one. Rows past R load nothing."""
    m_r = (r0 + o_r) < R
    msk = m_r[:, None] & m_i[None, :]
    keep = 0
    if HAS_MASK:
        if M_BCAST_R:
            keep = keep_i
        elif M_BCAST_I:
            keep = tl.load(p_mt + r0 * sm_r + t_m, mask=m_r[:, None], other=0, eviction_policy=M_EVICT) != 0
        else:
            keep = tl.load(p_mt + r0 * sm_r + t_m, mask=msk, other=0, eviction_policy=M_EVICT) != 0
    # X_EVICT "evict_first" where x is streamed past a mask that several programs share
    if PRED_X:
        # the mask is constant along the fast axis: predicate the (still vectorized) x load, so
        # masked-off rows of x are never read
        b_x = tl.load(p_xt + r0 * sx_r + t_x, mask=msk & keep, other=0.0, eviction_policy=X_EVICT)
    else:
        b_x = tl.load(p_xt + r0 * sx_r + t_x, mask=msk, other=0.0, eviction_policy=X_EVICT)
    b_sc = 0.0
    if HAS_SCALE:
        if S_BCAST_R:
            b_sc = sc_i
        elif S_BCAST_I:
            b_sc = tl.load(p_st + r0 * ss_r + t_s, mask=m_r[:, None], other=0.0)
        else:
            b_sc = tl.load(p_st + r0 * ss_r + t_s, mask=msk, other=0.0)
    return b_x, keep, b_sc


@triton.jit
def _add_tile(acc, b_x, keep, b_sc, HAS_MASK: tl.constexpr, HAS_SCALE: tl.constexpr):
    v = b_x.to(acc.dtype)
    if HAS_SCALE:
        v = v * b_sc.to(acc.dtype)
    if HAS_MASK:
        v = tl.where(keep, v, 0.0)  # a select: NaN/inf under the mask never reaches y
    return acc + v


@triton.jit
def _mask_reduce_forward_kernel(
    p_x, p_m, p_s, p_y,
    R, O1, I, n_iblk, n_outer, r_rot,
    sx_r, sx_0, sx_1, sx_i,
    sm_r, sm_0, sm_1, sm_i,
    ss_r, ss_0, ss_1, ss_i,
    HAS_MASK: tl.constexpr, HAS_SCALE: tl.constexpr, ACC_F64: tl.constexpr,
    M_BCAST_R: tl.constexpr, M_BCAST_I: tl.constexpr, S_BCAST_R: tl.constexpr, S_BCAST_I: tl.constexpr,
    PRED_X: tl.constexpr, WIDE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
    VEC: tl.constexpr, M_EVICT: tl.constexpr, X_EVICT: tl.constexpr, PIPELINE: tl.constexpr, UNROLL: tl.constexpr,
    OUTER_FIRST: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    if OUTER_FIRST:
        # consecutive programs: the same column block of every outer index, so the programs that
        # read one stored mask tile run at the same time and all but the first find it in L2
        outer = pid % n_outer
        blk_i = pid // n_outer
    else:
        blk_i = pid % n_iblk
        outer = pid // n_iblk
    a = outer // O1
    b = outer % O1
    i0 = blk_i * BLOCK_I
    o_r = tl.arange(0, BLOCK_R)
    m_i = (i0 + tl.arange(0, BLOCK_I)) < I
    # scalar int64 bases; per-tile offsets stay 32-bit (host sets WIDE when they could not)
    p_xt = p_x + a * sx_0 + b * sx_1 + i0 * sx_i
    t_x = _tile_offsets(sx_r, sx_i, False, False, WIDE, BLOCK_R, BLOCK_I, VEC)
    p_mt, t_m, keep_i = _operand_tile(p_m, a, b, i0, sm_0, sm_1, sm_r, sm_i, m_i, HAS_MASK, M_BCAST_R, M_BCAST_I,
                                      WIDE, BLOCK_R, BLOCK_I, VEC)
    keep_i = keep_i != 0
    p_st, t_s, sc_i = _operand_tile(p_s, a, b, i0, ss_0, ss_1, ss_r, ss_i, m_i, HAS_SCALE, S_BCAST_R, S_BCAST_I,
                                    WIDE, BLOCK_R, BLOCK_I, VEC)
    if ACC_F64:
        acc = tl.zeros([BLOCK_R, BLOCK_I], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_I], dtype=tl.float32)
    if PIPELINE:
        # software pipelining: the loads of trip k+1 are issued before the adds of trip k.
        # Trips visit the row tiles from tile k0 = outer * r_rot (mod their count) on, wrapping
        # around: r_rot > 0 staggers programs of different outer indices across rows.
        n_rt = tl.cdiv(R, BLOCK_R)
        k0 = (outer * r_rot) % n_rt
        xn, kn, sn = _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, k0 * BLOCK_R, o_r, m_i, R,
                                sx_r, sm_r, ss_r, HAS_MASK, M_BCAST_R, M_BCAST_I, PRED_X, HAS_SCALE,
                                S_BCAST_R, S_BCAST_I, M_EVICT, X_EVICT)
        for k in range(0, n_rt):
            xc = xn
            kc = kn
            sc = sn
            # the next trip's rows; past the last trip, rows from R on (nothing is loaded)
            r_next = tl.where(k + 1 < n_rt, ((k0 + k + 1) % n_rt) * BLOCK_R, R)
            xn, kn, sn = _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, r_next, o_r, m_i, R,
                                    sx_r, sm_r, ss_r, HAS_MASK, M_BCAST_R, M_BCAST_I, PRED_X,
                                    HAS_SCALE, S_BCAST_R, S_BCAST_I, M_EVICT, X_EVICT)
            acc = _add_tile(acc, xc, kc, sc, HAS_MASK, HAS_SCALE)
    else:
        # a short reduce dim: UNROLL tiles per trip, every load written before the first add
        for r00 in range(0, R, BLOCK_R * UNROLL):
            x0, q0, s0 = _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, r00, o_r, m_i, R,
                                    sx_r, sm_r, ss_r, HAS_MASK, M_BCAST_R, M_BCAST_I, PRED_X,
                                    HAS_SCALE, S_BCAST_R, S_BCAST_I, M_EVICT, X_EVICT)
            if UNROLL >= 2:
                x1, q1, s1 = _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, r00 + BLOCK_R, o_r, m_i, R,
                                        sx_r, sm_r, ss_r, HAS_MASK, M_BCAST_R, M_BCAST_I, PRED_X,
                                        HAS_SCALE, S_BCAST_R, S_BCAST_I, M_EVICT, X_EVICT)
            if UNROLL >= 4:
                x2, q2, s2 = _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, r00 + 2 * BLOCK_R, o_r, m_i,
                                        R, sx_r, sm_r, ss_r, HAS_MASK, M_BCAST_R, M_BCAST_I, PRED_X,
                                        HAS_SCALE, S_BCAST_R, S_BCAST_I, M_EVICT, X_EVICT)
                x3, q3, s3 = _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, r00 + 3 * BLOCK_R, o_r, m_i,
                                        R, sx_r, sm_r, ss_r, HAS_MASK, M_BCAST_R, M_BCAST_I, PRED_X,
                                        HAS_SCALE, S_BCAST_R, S_BCAST_I, M_EVICT, X_EVICT)
            acc = _add_tile(acc, x0, q0, s0, HAS_MASK, HAS_SCALE)
            if UNROLL >= 2:
                acc = _add_tile(acc, x1, q1, s1, HAS_MASK, HAS_SCALE)
            if UNROLL >= 4:
                acc = _add_tile(acc, x2, q2, s2, HAS_MASK, HAS_SCALE)
                acc = _add_tile(acc, x3, q3, s3, HAS_MASK, HAS_SCALE)
    y = tl.sum(acc, axis=0)
    tl.store(p_y + outer * I + i0 + tl.arange(0, BLOCK_I), y.to(p_y.dtype.element_ty), mask=m_i)


# row tiles by which the pipelined loop's start moves from one outer index to the next (0: all
# programs walk the rows in the same order); set by benchmarks/mask_reduce_tiles.py
R_ROTATE_TILES = 0
# L2 eviction hints where a mask is shared across programs (x evict_first, mask evict_last)
EVICT_HINTS = True
# program order where the mask is shared across outer (batch) indices: those indices fastest
OUTER_FIRST = True


def pick_blocks(r: int, i: int, n_outer: int, r_contiguous: bool, x_bytes: int = 2,
                n_sm: int = 132) -> tuple[int, int, int, int, bool, int]:
    """(BLOCK_R, BLOCK_I, num_warps, VEC, PIPELINE, UNROLL), VEC = 16 bytes of x; a tile holds
    VEC * 32 * num_warps * rows elements, `rows` 16-byte x vectors per thread.

    - reduce dim not contiguous, plenty of outputs (MoE combine, [T, k, H] -> [T, H]): one
      1 KB row run per tile (2 warps along i), UNROLL row tiles loaded per trip: few registers,
      many small programs, and no reduction across threads at all. On the (8192, 4, 8192)
      full-mask case, 1 / 2 / 4 KB rows measured 0.948 / 0.927 / 0.892 of the floor.
    - few outputs and a long reduce dim ([B, M, N] -> [B, N] with small B): narrower column
      strips (not below 128 bytes per row) until there are programs for every SM, four rows per
      thread (128 x 64 tiles on (8, 4096, 4096): 0.56 of the floor against 0.43 with two rows,
      medians of interleaved rounds), a software-pipelined loop; one cross-warp reduction at
      the very end. (Splitting
      the reduce dim instead, with fp32 partials, measured no faster here: 0.72 against 0.81
      of the floor on (8, 4096, 4096), and it needs a workspace.)
    - reduce dim contiguous (token losses, [B, L] -> [B]): the tile's fast axis is r, pipelined.
    Measured on an H200: benchmarks/mask_reduce_tiles.py, docs/BENCHMARKS.md.
    """
    np2 = triton.next_power_of_2
    vec = max(1, 16 // x_bytes)
    cap = vec * 32 * 8  # one 8-warp tile row
    r2 = np2(max(r, 1))
    i2 = np2(max(i, 1))
    if r_contiguous:
        rows, pipeline, unroll = 2, True, 1
        block_r = min(r2, cap)
        block_i = max(1, min(i2, cap * rows // block_r))
    else:
        min_i = max(1, 128 // x_bytes)
        block_i = min(i2, 2 * vec * 32)
        while block_i > min_i and n_outer * triton.cdiv(i, block_i) < 8 * n_sm:
            block_i //= 2
        if n_outer * triton.cdiv(i, block_i) >= 8 * n_sm:
            rows, pipeline, unroll = 1, False, min(4, r2)
            block_r = 1
        else:
            rows, pipeline, unroll = 4, True, 1
            block_r = max(1, min(r2, cap * rows // block_i))
    warps = max(1, min(8, block_r * block_i // (vec * 32 * rows)))
    return block_r, block_i, warps, vec, pipeline, unroll
