"""Triton kernel of fused::mask_reduce: y = sum over one dim of x * scale where mask != 0.

The launcher hands every operand as (pointer, 4 strides): the reduce dim r, two outer output dims
and the innermost output dim i. Broadcast operands keep stride 0, so a mask expanded over the
hidden size is read from its few stored elements and never materialized. A program owns a
[BLOCK_R, BLOCK_I] tile of one output row block, walks r, and accumulates into a tile-shaped
register accumulator (one cross-lane reduction at the end). Where the mask is constant along
the fast (contiguous) axis, as a [T, k, 1] keep-mask is along the hidden size, the x load is
predicated on it and masked-off rows of x cost no memory traffic; a mask that varies along the
fast axis would break the vectorized load into scalar ones, so there x is loaded whole and the
mask applied by a select. Either way a NaN under the mask never reaches y.
Whichever of r or i has stride 1 is specialized by Triton (integer arguments equal to 1 are
compile-time constants) and becomes the fast axis of the tile, so both the MoE combine
(reduce a small middle dim, contiguous hidden size) and token losses (reduce the contiguous
last dim) read coalesced memory with the same code.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_offsets(s_r, s_i, BCAST_R: tl.constexpr, BCAST_I: tl.constexpr, WIDE: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """In-tile element offsets of one operand: [BLOCK_R, BLOCK_I], or [1, BLOCK_I] / [BLOCK_R, 1]
    when the operand is broadcast (stride 0) along r / i, so a broadcast mask is loaded once per
    distinct stored element instead of once per lane. int32 unless WIDE."""
    o_r = tl.arange(0, BLOCK_R)
    o_i = tl.arange(0, BLOCK_I)
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
def _mask_reduce_forward_kernel(
    p_x, p_m, p_s, p_y,
    R, O1, I, n_iblk,
    sx_r, sx_0, sx_1, sx_i,
    sm_r, sm_0, sm_1, sm_i,
    ss_r, ss_0, ss_1, ss_i,
    HAS_MASK: tl.constexpr, HAS_SCALE: tl.constexpr, ACC_F64: tl.constexpr,
    M_BCAST_R: tl.constexpr, M_BCAST_I: tl.constexpr, S_BCAST_R: tl.constexpr, S_BCAST_I: tl.constexpr,
    PRED_X: tl.constexpr, WIDE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
    UNROLL: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    blk_i = pid % n_iblk
    outer = pid // n_iblk
    a = outer // O1
    b = outer % O1
    i0 = blk_i * BLOCK_I
    o_r = tl.arange(0, BLOCK_R)
    m_i = (i0 + tl.arange(0, BLOCK_I)) < I
    # scalar int64 bases; per-tile offsets stay 32-bit (host sets WIDE when they could not)
    p_xt = p_x + a * sx_0 + b * sx_1 + i0 * sx_i
    t_x = _tile_offsets(sx_r, sx_i, False, False, WIDE, BLOCK_R, BLOCK_I)
    if HAS_MASK:
        p_mt = p_m + a * sm_0 + b * sm_1 + i0 * sm_i
        t_m = _tile_offsets(sm_r, sm_i, M_BCAST_R, M_BCAST_I, WIDE, BLOCK_R, BLOCK_I)
        if M_BCAST_R:  # the same mask row for every r: read it once
            keep_i = tl.load(p_mt + t_m, mask=m_i[None, :], other=0) != 0
    if HAS_SCALE:
        p_st = p_s + a * ss_0 + b * ss_1 + i0 * ss_i
        t_s = _tile_offsets(ss_r, ss_i, S_BCAST_R, S_BCAST_I, WIDE, BLOCK_R, BLOCK_I)
        if S_BCAST_R:
            sc_i = tl.load(p_st + t_s, mask=m_i[None, :], other=0.0)
    if ACC_F64:
        acc = tl.zeros([BLOCK_R, BLOCK_I], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_I], dtype=tl.float32)
    # UNROLL independent [BLOCK_R, BLOCK_I] sub-tiles per trip: their loads are all issued before
    # the first add, which keeps UNROLL times more bytes in flight per program
    for r00 in range(0, R, BLOCK_R * UNROLL):
        for u in tl.static_range(UNROLL):
            r0 = r00 + u * BLOCK_R
            m_r = (r0 + o_r) < R
            msk = m_r[:, None] & m_i[None, :]
            if HAS_MASK:
                if M_BCAST_R:
                    keep = keep_i
                elif M_BCAST_I:
                    keep = tl.load(p_mt + r0 * sm_r + t_m, mask=m_r[:, None], other=0) != 0
                else:
                    keep = tl.load(p_mt + r0 * sm_r + t_m, mask=msk, other=0) != 0
            if HAS_MASK and PRED_X:
                # the mask is constant along the fast axis: predicate the (still vectorized) x
                # load, so masked-off rows of x are never read
                msk = msk & keep
            b_x = tl.load(p_xt + r0 * sx_r + t_x, mask=msk, other=0.0).to(acc.dtype)
            if HAS_SCALE:
                if S_BCAST_R:
                    b_sc = sc_i
                elif S_BCAST_I:
                    b_sc = tl.load(p_st + r0 * ss_r + t_s, mask=m_r[:, None], other=0.0)
                else:
                    b_sc = tl.load(p_st + r0 * ss_r + t_s, mask=msk, other=0.0)
                b_x = b_x * b_sc.to(acc.dtype)
            if HAS_MASK:
                b_x = tl.where(keep, b_x, 0.0)  # a select: NaN/inf under the mask never reaches y
            acc += b_x
    y = tl.sum(acc, axis=0)
    tl.store(p_y + outer * I + i0 + tl.arange(0, BLOCK_I), y.to(p_y.dtype.element_ty), mask=m_i)


def pick_blocks(r: int, i: int, n_outer: int, r_contiguous: bool, x_bytes: int = 2,
                n_sm: int = 132) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_I, num_warps, UNROLL).

    Every thread holds exactly one 16-byte vector of x per sub-tile (8 bf16, 4 fp32 elements):
    a narrower mask (bool) then gets the same register layout as x, so the select needs no
    layout conversion through shared memory inside the loop (with more elements per thread the
    compiler gives the 1-byte mask 16 per thread and x 8, and converts between them).
    - reduce dim not contiguous, enough outputs (MoE combine, [T, k, H] -> [T, H]): one row per
      sub-tile (BLOCK_R = 1), a wide BLOCK_I, UNROLL rows loaded together; no cross-thread
      reduction at all.
    - few outputs and a long reduce dim ([B, M, N] -> [B, N] with small B): narrow column
      strips (not below 128 bytes per row) and tall tiles, enough programs to fill the GPU;
      one cross-warp reduction at the very end.
    - reduce dim contiguous (token losses, [B, L] -> [B]): the tile's fast axis is r.
    """
    np2 = triton.next_power_of_2
    vec = max(1, 16 // x_bytes)
    r2 = np2(max(r, 1))
    if r_contiguous:
        block_r = min(r2, vec * 32 * 8)
        block_i = max(1, min(np2(max(i, 1)), vec * 32 * 8 // block_r))
    else:
        min_i = max(1, 128 // x_bytes)
        block_i = min(np2(max(i, 1)), vec * 32 * 8)
        while block_i > min_i and n_outer * triton.cdiv(i, block_i) < 8 * n_sm:
            block_i //= 2
        block_r = 1 if n_outer * triton.cdiv(i, block_i) >= 8 * n_sm else min(r2, max(1, vec * 32 * 8 // block_i))
    warps = max(1, min(8, block_r * block_i // (vec * 32)))
    unroll = max(1, min(4, r2 // block_r))
    return block_r, block_i, warps, unroll
