"""Triton kernel of fused::mask_reduce: y = sum over one dim of x * scale where mask != 0.

The launcher hands every operand as (pointer, 4 strides): the reduce dim r, two outer output dims
and the innermost output dim i. Broadcast operands keep stride 0, so a mask expanded over the
hidden size is read from its few stored elements and never materialized. A program owns a
[BLOCK_R, BLOCK_I] tile of one output row block, walks r, and accumulates into a tile-shaped
register accumulator (one cross-lane reduction at the end). x is loaded only where the mask
keeps it, so masked-off rows of x cost no memory traffic, and a NaN there never reaches y.
Whichever of r or i has stride 1 is specialized by Triton (integer arguments equal to 1 are
compile-time constants) and becomes the fast axis of the tile, so both the MoE combine
(reduce a small middle dim, contiguous hidden size) and token losses (reduce the contiguous
last dim) read coalesced memory with the same code.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mask_reduce_forward_kernel(
    p_x, p_m, p_s, p_y,
    R, O1, I, n_iblk,
    sx_r, sx_0, sx_1, sx_i,
    sm_r, sm_0, sm_1, sm_i,
    ss_r, ss_0, ss_1, ss_i,
    HAS_MASK: tl.constexpr, HAS_SCALE: tl.constexpr, ACC_F64: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    blk_i = pid % n_iblk
    outer = pid // n_iblk
    a = outer // O1
    b = outer % O1
    o_i = (blk_i * BLOCK_I + tl.arange(0, BLOCK_I)).to(tl.int64)
    m_i = o_i < I
    o_rb = tl.arange(0, BLOCK_R).to(tl.int64)
    p_xt = p_x + a * sx_0 + b * sx_1 + o_i[None, :] * sx_i
    if HAS_MASK:
        p_mt = p_m + a * sm_0 + b * sm_1 + o_i[None, :] * sm_i
    if HAS_SCALE:
        p_st = p_s + a * ss_0 + b * ss_1 + o_i[None, :] * ss_i
    if ACC_F64:
        acc = tl.zeros([BLOCK_R, BLOCK_I], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_I], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        o_r = r0 + o_rb
        msk = (o_r < R)[:, None] & m_i[None, :]
        if HAS_MASK:
            keep = tl.load(p_mt + o_r[:, None] * sm_r, mask=msk, other=0)
            msk = msk & (keep != 0)
        b_x = tl.load(p_xt + o_r[:, None] * sx_r, mask=msk, other=0.0).to(acc.dtype)
        if HAS_SCALE:
            b_x = b_x * tl.load(p_st + o_r[:, None] * ss_r, mask=msk, other=0.0).to(acc.dtype)
        acc += b_x
    y = tl.sum(acc, axis=0)
    tl.store(p_y + outer * I + o_i, y.to(p_y.dtype.element_ty), mask=m_i)


def pick_blocks(r: int, i: int, n_outer: int, r_contiguous: bool) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_I, num_warps). Tiles of ~4096 elements; the contiguous axis gets the width.
    When the reduce dim is not contiguous, BLOCK_I shrinks (not below 32) until there are
    enough programs (>= 2048) to keep every SM streaming: there is one program per output tile."""
    np2 = triton.next_power_of_2
    if r_contiguous:
        block_r = min(np2(max(r, 1)), 1024)
        block_i = max(1, min(np2(max(i, 1)), 4096 // block_r))
    else:
        block_i = min(np2(max(i, 1)), 1024)
        while block_i > 32 and n_outer * triton.cdiv(i, block_i) < 2048:
            block_i //= 2
        block_r = max(1, min(np2(max(r, 1)), 4096 // block_i))
    warps = 4 if block_r * block_i >= 2048 else (2 if block_r * block_i >= 512 else 1)
    return block_r, block_i, warps
