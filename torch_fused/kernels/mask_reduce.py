"""Triton kernel of fused::mask_reduce: y = sum over one dim of x * scale where mask != 0.

The launcher hands every operand as (pointer, 4 strides): the reduce dim r, two outer output dims
and the innermost output dim i. Broadcast operands keep stride 0, so a mask expanded over the
hidden size is read from its few stored elements and never materialized. A program owns
BLOCK_I outputs of one output row, walks r in trips of U * BLOCK_R rows, and accumulates into a
[BLOCK_R, BLOCK_I] register accumulator (one reduction over its rows at the end). Where the mask is
constant along the fast (contiguous) axis, as a [T, k, 1] keep-mask is along the hidden size,
the x load is predicated on it and masked-off rows of x cost no memory traffic; a mask that
varies along the fast axis would break the vectorized load into scalar ones, so there x is
loaded whole and the mask applied by a select. Either way a NaN under the mask never reaches y.
Whichever of r or i has stride 1 is specialized by Triton (integer arguments equal to 1 are
compile-time constants) and becomes the fast axis of the tile, so both the MoE combine
(reduce a small middle dim, contiguous hidden size) and token losses (reduce the contiguous
last dim) read coalesced memory with the same code.

What carries the bandwidth (measured on an H200, docs/BENCHMARKS.md):
- Register layout. The fast-axis offsets are marked contiguous in runs of VEC = 16 bytes of x
  only, so x and a narrower mask get the same layout (one 16-byte x vector and one VEC-byte mask
  vector per thread and row). Left alone, the compiler may give a bool mask 16 elements per
  thread and x 8, and convert one layout to the other through shared memory on every trip.
- Bytes in flight. ptxas places each load right before its first use, so a trip's U row
  vectors per thread are one tile load, issued together before any add. Column strips (long
  reduce dims) hide the latency with occupancy: a small accumulator (the U rows are summed in
  registers first) and the mask kept as loaded bytes until its use keep them at ~72 registers,
  every program resident. Software pipelining (the loads of trip k+1 issued before the adds of
  trip k, PIPELINE) remains for the contiguous-r tiles; in the strips it cost more than it gave,
  since every value carried across the loop's back edge is unpacked per element (168-186
  registers with a mask).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl


@triton.jit
def _tile_offsets(s_r, s_i, BCAST_R: tl.constexpr, BCAST_I: tl.constexpr, WIDE: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_I: tl.constexpr, VEC: tl.constexpr):
    """In-tile element offsets of one operand: [ROWS, BLOCK_I], or [1, BLOCK_I] / [ROWS, 1] when
    the operand is broadcast (stride 0) along r / i, so a broadcast mask is loaded once per
    distinct stored element instead of once per lane. int32 unless WIDE. Contiguity is declared
    in runs of VEC only (see the module docstring)."""
    o_r = tl.max_contiguous(tl.arange(0, ROWS), VEC)
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
                  BCAST_I: tl.constexpr, WIDE: tl.constexpr, U: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_I: tl.constexpr, VEC: tl.constexpr):
    """A program's base pointer and in-tile offsets of the mask or the scale, and, for one
    broadcast along r (the same row for every r), that row read once. (p, 0, 0) if absent."""
    p_t = p
    t = 0
    row = 0
    if PRESENT:
        p_t = p + a * s_0 + b * s_1 + i0 * s_i
        t = _tile_offsets(s_r, s_i, BCAST_R, BCAST_I, WIDE, U * BLOCK_R, BLOCK_I, VEC)
        if BCAST_R:
            row = tl.load(p_t + t, mask=m_i, other=0)
    return p_t, t, row


@triton.jit
def _load(p, msk, other, EVEN: tl.constexpr, EVICT: tl.constexpr):
    if EVEN:
        return tl.load(p, eviction_policy=EVICT)
    else:
        return tl.load(p, mask=msk, other=other, eviction_policy=EVICT)


@triton.jit
def _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, r0, o_r, m_i, R, sx_r, sm_r, ss_r,
               HAS_MASK: tl.constexpr, M_BCAST_R: tl.constexpr, M_BCAST_I: tl.constexpr, PRED_X: tl.constexpr,
               HAS_SCALE: tl.constexpr, S_BCAST_R: tl.constexpr, S_BCAST_I: tl.constexpr,
               M_EVICT: tl.constexpr, X_EVICT: tl.constexpr, EVEN: tl.constexpr):
    """(x, mask, scale) of the trip's rows r0 + o_r as loaded: the mask as stored (0 without
    one; compared with 0 where it is used, so a trip in flight holds bytes, not predicates),
    scale 0.0 without one. Rows past R load nothing; EVEN: every row and column is in range."""
    m_r = (r0 + o_r) < R
    msk = m_r & m_i
    mk = 0
    if HAS_MASK:
        if M_BCAST_R:
            mk = keep_i
        elif M_BCAST_I:
            mk = _load(p_mt + r0 * sm_r + t_m, m_r, 0, EVEN, M_EVICT)
        else:
            mk = _load(p_mt + r0 * sm_r + t_m, msk, 0, EVEN, M_EVICT)
    # X_EVICT "evict_first" where x is streamed past a mask that several programs share
    if PRED_X:
        # the mask is constant along the fast axis: predicate the (still vectorized) x load, so
        # masked-off rows of x are never read
        b_x = tl.load(p_xt + r0 * sx_r + t_x, mask=msk & (mk != 0), other=0.0, eviction_policy=X_EVICT)
    else:
        b_x = _load(p_xt + r0 * sx_r + t_x, msk, 0.0, EVEN, X_EVICT)
    b_sc = 0.0
    if HAS_SCALE:
        if S_BCAST_R:
            b_sc = sc_i
        elif S_BCAST_I:
            b_sc = _load(p_st + r0 * ss_r + t_s, m_r, 0.0, EVEN, "")
        else:
            b_sc = _load(p_st + r0 * ss_r + t_s, msk, 0.0, EVEN, "")
    return b_x, mk, b_sc


@triton.jit
def _add_tile(acc, b_x, mk, b_sc, HAS_MASK: tl.constexpr, HAS_SCALE: tl.constexpr):
    """acc ([BLOCK_R, BLOCK_I]) plus the trip's [U * BLOCK_R, BLOCK_I] values summed over rows
    j, j + BLOCK_R, ...: the tile's layout repeats every BLOCK_R rows, so those U rows are one
    thread's registers and the sum over them is a few adds (no data leaves the thread)."""
    v = b_x.to(acc.dtype)
    if HAS_SCALE:
        v = v * b_sc.to(acc.dtype)
    if HAS_MASK:
        v = tl.where(mk != 0, v, 0.0)  # a select: NaN/inf under the mask never reaches y
    if v.shape[0] != acc.shape[0]:
        v = tl.sum(tl.reshape(v, [v.shape[0] // acc.shape[0], acc.shape[0], v.shape[1]]), axis=0)
    return acc + v


@triton.jit
def _mask_reduce_forward_kernel(
    p_x, p_m, p_s, p_y,
    R, O1, I, n_iblk, n_outer,
    sx_r, sx_0, sx_1, sx_i,
    sm_r, sm_0, sm_1, sm_i,
    ss_r, ss_0, ss_1, ss_i,
    HAS_MASK: tl.constexpr, HAS_SCALE: tl.constexpr, ACC_F64: tl.constexpr,
    M_BCAST_R: tl.constexpr, M_BCAST_I: tl.constexpr, S_BCAST_R: tl.constexpr, S_BCAST_I: tl.constexpr,
    PRED_X: tl.constexpr, WIDE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
    VEC: tl.constexpr, M_EVICT: tl.constexpr, X_EVICT: tl.constexpr, PIPELINE: tl.constexpr, U: tl.constexpr,
    OUTER_FIRST: tl.constexpr, EVEN: tl.constexpr,
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
    # a trip's rows [U * BLOCK_R, 1] and columns [1, BLOCK_I]
    o_r = tl.arange(0, U * BLOCK_R)[:, None]
    m_i = ((i0 + tl.arange(0, BLOCK_I)) < I)[None, :]
    # scalar int64 bases; per-tile offsets stay 32-bit (host sets WIDE when they could not)
    p_xt = p_x + a * sx_0 + b * sx_1 + i0 * sx_i
    t_x = _tile_offsets(sx_r, sx_i, False, False, WIDE, U * BLOCK_R, BLOCK_I, VEC)
    p_mt, t_m, keep_i = _operand_tile(p_m, a, b, i0, sm_0, sm_1, sm_r, sm_i, m_i, HAS_MASK, M_BCAST_R, M_BCAST_I,
                                      WIDE, U, BLOCK_R, BLOCK_I, VEC)
    p_st, t_s, sc_i = _operand_tile(p_s, a, b, i0, ss_0, ss_1, ss_r, ss_i, m_i, HAS_SCALE, S_BCAST_R, S_BCAST_I,
                                    WIDE, U, BLOCK_R, BLOCK_I, VEC)
    if ACC_F64:
        acc = tl.zeros([BLOCK_R, BLOCK_I], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_I], dtype=tl.float32)
    TRIP: tl.constexpr = U * BLOCK_R
    if PIPELINE:
        # software pipelining: the loads of trip k+1 are issued before the adds of trip k
        xn, mn, sn = _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, 0, o_r, m_i, R, sx_r, sm_r, ss_r,
                                HAS_MASK, M_BCAST_R, M_BCAST_I, PRED_X, HAS_SCALE, S_BCAST_R, S_BCAST_I,
                                M_EVICT, X_EVICT, EVEN)
        for r0 in range(TRIP, R, TRIP):
            xc = xn
            mc = mn
            sc = sn
            xn, mn, sn = _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, r0, o_r, m_i, R,
                                    sx_r, sm_r, ss_r, HAS_MASK, M_BCAST_R, M_BCAST_I, PRED_X,
                                    HAS_SCALE, S_BCAST_R, S_BCAST_I, M_EVICT, X_EVICT, EVEN)
            acc = _add_tile(acc, xc, mc, sc, HAS_MASK, HAS_SCALE)
        acc = _add_tile(acc, xn, mn, sn, HAS_MASK, HAS_SCALE)
    else:
        for r0 in range(0, R, TRIP):
            xc, mc, sc = _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, r0, o_r, m_i, R,
                                    sx_r, sm_r, ss_r, HAS_MASK, M_BCAST_R, M_BCAST_I, PRED_X,
                                    HAS_SCALE, S_BCAST_R, S_BCAST_I, M_EVICT, X_EVICT, EVEN)
            acc = _add_tile(acc, xc, mc, sc, HAS_MASK, HAS_SCALE)
    y = tl.sum(acc, axis=0)
    tl.store(p_y + outer * I + i0 + tl.arange(0, BLOCK_I), y.to(p_y.dtype.element_ty), mask=(i0 + tl.arange(0, BLOCK_I)) < I)

# L2 eviction hints where a mask is shared across programs (x evict_first, mask evict_last)
EVICT_HINTS = True
# program order where the mask is shared across outer (batch) indices: those indices fastest
OUTER_FIRST = True
# the column-strip tiles: rows per thread and trip, warps, software pipelining
STRIP_U = 8
STRIP_WARPS = 8
STRIP_PIPELINE = False


def _np2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pick_blocks(r: int, i: int, n_outer: int, r_contiguous: bool, x_bytes: int = 2,
                n_sm: int = 132) -> tuple[int, int, int, int, bool, int]:
    """The launch's tiles (see _pick); cached per shape and the STRIP_* knobs' current values."""
    return _pick(r, i, n_outer, r_contiguous, x_bytes, n_sm, STRIP_U, STRIP_WARPS, STRIP_PIPELINE)


@functools.lru_cache(maxsize=4096)
def _pick(r: int, i: int, n_outer: int, r_contiguous: bool, x_bytes: int, n_sm: int, strip_u: int,
          strip_warps: int, strip_pipeline: bool) -> tuple[int, int, int, int, bool, int]:
    """(BLOCK_R, BLOCK_I, num_warps, VEC, PIPELINE, U), VEC = 16 bytes of x. A trip loads a
    [U * BLOCK_R, BLOCK_I] tile, U 16-byte x vectors per thread and column run, whose U rows a
    thread adds in registers; the accumulator is [BLOCK_R, BLOCK_I], one per thread and vector.

    - reduce dim not contiguous, plenty of outputs (MoE combine, [T, k, H] -> [T, H]): one
      1 KB row run per tile (2 warps along i), U = 4 rows per trip: few registers, many small
      programs, and no reduction across threads at all. On the (8192, 4, 8192) full-mask case,
      1 / 2 / 4 KB rows measured 0.948 / 0.927 / 0.892 of the floor.
    - few outputs and a long reduce dim ([B, M, N] -> [B, N] with small B): narrower column
      strips (not below 128 bytes per row) until there are programs for every SM, STRIP_U = 8
      rows per thread and trip, 32 rows of threads (8 warps), no software pipelining; one
      cross-warp reduction at the very end. On (8, 4096, 4096): 0.957-0.961 of the floor, against
      0.932 with 4 rows per thread, 0.953 / 0.874 with 256 / 512-byte rows, 0.905 pipelined
      (device-timed sweep). (Splitting the reduce dim instead, with fp32 partials, measured no
      faster in session 2, and it needs a workspace larger than the output.)
    - reduce dim contiguous (token losses, [B, L] -> [B]): the tile's fast axis is r, pipelined.
    Measured on an H200: benchmarks/mask_reduce_tiles.py, docs/BENCHMARKS.md.
    """
    np2 = _np2  # plain Python: triton.next_power_of_2 and triton.cdiv run through triton's JIT-function call path on the host
    vec = max(1, 16 // x_bytes)
    cap = vec * 32 * 8  # one 8-warp tile row
    r2 = np2(max(r, 1))
    i2 = np2(max(i, 1))
    if r_contiguous:
        u, pipeline = 1, True
        block_r = min(r2, cap)
        block_i = max(1, min(i2, cap * 2 // block_r))
        warps = max(1, min(8, block_r * block_i // (vec * 32 * 2)))
        return block_r, block_i, warps, vec, pipeline, u
    min_i = max(1, 128 // x_bytes)
    block_i = min(i2, 2 * vec * 32)
    while block_i > min_i and n_outer * _cdiv(i, block_i) < 8 * n_sm:
        block_i //= 2
    if n_outer * _cdiv(i, block_i) >= 8 * n_sm:
        u, pipeline, block_r = min(4, r2), False, 1
    else:
        u, pipeline = min(strip_u, r2), strip_pipeline
        # threads along r: all of the program's threads not needed along i, fewer if r is short
        block_r = max(1, min(r2 // u, strip_warps * 32 * vec // block_i))
    warps = max(1, min(strip_warps, block_r * block_i // (vec * 32)))
    return block_r, block_i, warps, vec, pipeline, u
