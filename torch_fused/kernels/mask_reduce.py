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

What carries the bandwidth:
- Register layout. The fast-axis offsets are marked contiguous in runs of VEC = 16 bytes of x
  only, so x and a narrower mask get the same layout (one 16-byte x vector and one VEC-byte mask
  vector per thread and row). Left alone, the compiler may give a bool mask 16 elements per
  thread and x 8, and convert one layout to the other through shared memory on every trip.
- Bytes in flight. ptxas places each load right before its first use, so a trip's U row
  vectors per thread are one tile load, issued together before any add. Column strips (long
  reduce dims) hide the latency with many rows in flight per thread (U = 16 16-byte vectors)
  in small programs (4 warps): a small accumulator (the U rows are summed in registers first)
  and the mask kept as loaded bytes until its use leave room for the loads. Strips under a row
  mask, whose x loads are about half off, are wider (256-byte rows, U = 8, 8 warps) to keep the
  bytes in flight. Software pipelining by hand (the loads of trip k+1 issued before the adds of
  trip k, PIPELINE) remains for the contiguous-r tiles; in the strips every value carried across
  the loop's back edge is unpacked per element, and those registers cost more than it gives.
- Listed rows. A row mask over a long reduce dim is turned into lists of the kept row ids
  (_row_ids_kernel) and only those rows are walked (COMPACT), so every load of a trip is live.
  Each trip's x loads wait for its ids; the row tiles hide that with U listed rows per thread,
  the strips with Triton's own loop pipeliner (tl.range num_stages: the ids and then the x rows
  they name copied into shared memory by cp.async, stages ahead of the adds), which loads
  that depend on loads in the same loop need.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from ..settings import current as settings
from .._library import INTERPRET, NOMINAL_SMS, cdiv

# Programmatic dependent launch (Hopper and later): the reduce over listed rows is launched while
# the listing runs and waits for it in-kernel (gdc_wait), so its launch and set-up overlap the
# listing. HAS_PDL: this Triton has the instructions and the launch option.
try:
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and not INTERPRET
except ImportError:  # pragma: no cover - an older Triton
    HAS_PDL = False
if not HAS_PDL:
    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


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
def _load_mask_rows(p_mt, t_m, r0, o_r, R, sm_r, M_EVICT: tl.constexpr):
    """The mask of the trip's rows r0 + o_r of a mask broadcast along i ([rows, 1]), 0 past R."""
    return tl.load(p_mt + tl.cast(r0, tl.int64) * sm_r + t_m, mask=(r0 + o_r) < R, other=0,
                   eviction_policy=M_EVICT)


@triton.jit
def _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, r0, o_r, m_i, R, sx_r, sm_r, ss_r, mk_given,
               HAS_MASK: tl.constexpr, M_BCAST_R: tl.constexpr, M_BCAST_I: tl.constexpr, PRED_X: tl.constexpr,
               HAS_SCALE: tl.constexpr, S_BCAST_R: tl.constexpr, S_BCAST_I: tl.constexpr,
               M_EVICT: tl.constexpr, X_EVICT: tl.constexpr, EVEN: tl.constexpr, MK_GIVEN: tl.constexpr):
    """(x, mask, scale) of the trip's rows r0 + o_r as loaded: the mask as stored (0 without
    one; compared with 0 where it is used, so a trip in flight holds bytes, not predicates),
    scale 0.0 without one. Rows past R load nothing; EVEN: every row and column is in range.
    MK_GIVEN: the mask is ``mk_given``, loaded a trip ahead (MASK_AHEAD)."""
    m_r = (r0 + o_r) < R
    msk = m_r & m_i
    # the trip's first row in int64: r0 * stride passes 2**31 in a slice of over 2**31 elements
    # reduced over a dim other than the innermost (WIDE covers only the offsets within a trip)
    r0 = tl.cast(r0, tl.int64)
    mk = 0
    if MK_GIVEN:
        mk = mk_given
    elif HAS_MASK:
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
def _add_listed_rows(acc, p_xt, t_xi, p_ids, cnt, o_r, m_i, sx_r, sc_i, HAS_SCALE: tl.constexpr,
                     X_EVICT: tl.constexpr, TRIP: tl.constexpr, NUM_STAGES: tl.constexpr):
    """acc plus the x rows of the cnt ids at p_ids, TRIP ids a trip. NUM_STAGES > 1: through
    Triton's loop pipeliner (the ids of later trips and the x rows they name copied into shared
    memory, cp.async, NUM_STAGES - 1 trips ahead of the adds); else each trip's ids loaded a trip
    ahead of the x loads that wait for them."""
    if NUM_STAGES > 1:
        for j0 in tl.range(0, cnt, TRIP, num_stages=NUM_STAGES):
            m_r = (j0 + o_r) < cnt
            ids = tl.load(p_ids + j0 + o_r, mask=m_r, other=0)
            b_x = tl.load(p_xt + ids.to(tl.int64) * sx_r + t_xi, mask=m_r & m_i, other=0.0, eviction_policy=X_EVICT)
            acc = _add_tile(acc, b_x, m_r, sc_i, True, HAS_SCALE)
    else:
        ids_next = tl.load(p_ids + o_r, mask=o_r < cnt, other=0)
        for j0 in range(0, cnt, TRIP):
            ids = ids_next
            m_r = (j0 + o_r) < cnt
            ids_next = tl.load(p_ids + j0 + TRIP + o_r, mask=(j0 + TRIP + o_r) < cnt, other=0)
            b_x = tl.load(p_xt + ids.to(tl.int64) * sx_r + t_xi, mask=m_r & m_i, other=0.0, eviction_policy=X_EVICT)
            # the rows past the list count as masked (an inf scale times their 0 stays out)
            acc = _add_tile(acc, b_x, m_r, sc_i, True, HAS_SCALE)
    return acc


@triton.jit
def _mask_reduce_forward_kernel(
    p_x, p_m, p_s, p_y, p_rid, p_cnt,
    R, O1, I, n_iblk, n_outer,
    sx_r, sx_0, sx_1, sx_i,
    sm_r, sm_0, sm_1, sm_i,
    ss_r, ss_0, ss_1, ss_i,
    lst_0, lst_1,  # COMPACT: the row-id list of outer index (a, b) is a * lst_0 + b * lst_1
    HAS_MASK: tl.constexpr, HAS_SCALE: tl.constexpr, ACC_F64: tl.constexpr,
    M_BCAST_R: tl.constexpr, M_BCAST_I: tl.constexpr, S_BCAST_R: tl.constexpr, S_BCAST_I: tl.constexpr,
    PRED_X: tl.constexpr, WIDE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
    VEC: tl.constexpr, M_EVICT: tl.constexpr, X_EVICT: tl.constexpr, PIPELINE: tl.constexpr, U: tl.constexpr,
    OUTER_FIRST: tl.constexpr, EVEN: tl.constexpr, MASK_AHEAD: tl.constexpr, COMPACT: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
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
    if COMPACT:
        # a row mask ([rows, 1]) whose kept rows _row_ids_kernel listed: only they are walked
        lst = a * lst_0 + b * lst_1
        t_xi = _tile_offsets(sx_r, sx_i, True, False, WIDE, TRIP, BLOCK_I, VEC)  # [1, BLOCK_I]
        if PDL:
            gdc_wait()  # the listing launch done, its lists visible
        acc = _add_listed_rows(acc, p_xt, t_xi, p_rid + lst * R, tl.load(p_cnt + lst), o_r, m_i, sx_r, sc_i,
                               HAS_SCALE, X_EVICT, TRIP, NUM_STAGES)
    elif PIPELINE:
        # software pipelining: the loads of trip k+1 are issued before the adds of trip k
        xn, mn, sn = _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, 0, o_r, m_i, R, sx_r, sm_r, ss_r,
                                0, HAS_MASK, M_BCAST_R, M_BCAST_I, PRED_X, HAS_SCALE, S_BCAST_R, S_BCAST_I,
                                M_EVICT, X_EVICT, EVEN, False)
        for r0 in range(TRIP, R, TRIP):
            xc = xn
            mc = mn
            sc = sn
            xn, mn, sn = _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, r0, o_r, m_i, R,
                                    sx_r, sm_r, ss_r, 0, HAS_MASK, M_BCAST_R, M_BCAST_I, PRED_X,
                                    HAS_SCALE, S_BCAST_R, S_BCAST_I, M_EVICT, X_EVICT, EVEN, False)
            acc = _add_tile(acc, xc, mc, sc, HAS_MASK, HAS_SCALE)
        acc = _add_tile(acc, xn, mn, sn, HAS_MASK, HAS_SCALE)
    elif MASK_AHEAD:
        # a row mask ([rows, 1], the x load predicated on it): each trip's mask is loaded a trip
        # ahead, so the x loads, which wait for it, do not also wait for its own round trip
        mk_next = _load_mask_rows(p_mt, t_m, 0, o_r, R, sm_r, M_EVICT)
        for r0 in range(0, R, TRIP):
            mk = mk_next
            mk_next = _load_mask_rows(p_mt, t_m, r0 + TRIP, o_r, R, sm_r, M_EVICT)
            xc, mc, sc = _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, r0, o_r, m_i, R,
                                    sx_r, sm_r, ss_r, mk, HAS_MASK, M_BCAST_R, M_BCAST_I, PRED_X,
                                    HAS_SCALE, S_BCAST_R, S_BCAST_I, M_EVICT, X_EVICT, EVEN, True)
            acc = _add_tile(acc, xc, mc, sc, HAS_MASK, HAS_SCALE)
    else:
        for r0 in range(0, R, TRIP):
            xc, mc, sc = _load_tile(p_xt, t_x, p_mt, t_m, keep_i, p_st, t_s, sc_i, r0, o_r, m_i, R,
                                    sx_r, sm_r, ss_r, 0, HAS_MASK, M_BCAST_R, M_BCAST_I, PRED_X,
                                    HAS_SCALE, S_BCAST_R, S_BCAST_I, M_EVICT, X_EVICT, EVEN, False)
            acc = _add_tile(acc, xc, mc, sc, HAS_MASK, HAS_SCALE)
    y = tl.sum(acc, axis=0)
    o_y = i0 + tl.arange(0, BLOCK_I)
    tl.store(p_y + outer * I + o_y, y.to(p_y.dtype.element_ty), mask=o_y < I)


@triton.jit
def _row_ids_kernel(p_m, p_rid, p_cnt, R, N1, sm_r, sm_0, sm_1, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """COMPACT's lists: for each outer index of a row mask (one program per distinct stored one,
    (a, b) = divmod(program, N1)), the ids of the rows r it keeps (mask != 0), in order, at
    p_rid[program, :], and their count at p_cnt[program]. PDL: the reduce launched after it may
    start at once (it waits for the lists in-kernel)."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0).to(tl.int64)
    p = p_m + (pid // N1) * sm_0 + (pid % N1) * sm_1
    n = 0
    for r0 in range(0, R, BLOCK):
        o = r0 + tl.arange(0, BLOCK)
        keep = (tl.load(p + o.to(tl.int64) * sm_r, mask=o < R, other=0) != 0).to(tl.int32)
        pos = n + tl.cumsum(keep, 0) - keep  # the kept rows' places in the list
        tl.store(p_rid + pid * R + pos, o, mask=keep != 0)
        n += tl.sum(keep, 0)
    tl.store(p_cnt + pid, n)


ROW_IDS_BLOCK = 4096  # the most rows of one block of _row_ids_kernel


def row_ids_block(r: int) -> int:
    """_row_ids_kernel's block for lists of r rows: the whole list in one block up to
    ROW_IDS_BLOCK rows (each further block waits for the one before it), several blocks per list
    under the small_tiles setting."""
    return 4 if settings.small_tiles else min(ROW_IDS_BLOCK, max(128, _np2(r)))


def row_id_lists(o0: int, o1: int, sm) -> tuple[int, int, int, int]:
    """(lists along outer dim 0, lists along outer dim 1, lst_0, lst_1) of COMPACT over x
    [o0, o1, r, i] with mask strides sm = (r, 0, 1, i): one row-id list per distinct stored
    mask row set (a mask broadcast over an outer dim shares its lists), list (a, b) at
    a * lst_0 + b * lst_1."""
    n0 = o0 if sm[1] != 0 else 1
    n1 = o1 if sm[2] != 0 else 1
    return n0, n1, n1 if n0 > 1 else 0, 1 if n1 > 1 else 0


# The shipped tile choices, what each sets and why beside it. python -m torch_fused.bench --sweep
# --only mask_reduce times the strip tiles against the other points of its grid (bf16 x, bool mask;
# the fraction of the memory floor per point); the measurements behind each choice:
# docs/BENCHMARKS.md, "mask_reduce".
TILES = {
    # many outputs ([T, k, H] -> [T, H]): bytes of one row run per tile (wider runs leave fewer programs)
    "row_bytes": 1024,
    # many outputs: rows per thread and trip; few registers, so many small programs stay resident
    "row_u": 4,
    # strips narrow until there are this many programs per SM (few outputs, long reduce dim)
    "programs_per_sm": 8,
    # strips: narrowest row (one 128-byte line per row of threads)
    "strip_min_bytes": 128,
    # strips: rows per thread and trip (the bytes in flight per thread)
    "strip_u": 16,
    # strips: warps (32 rows of threads with 128-byte rows)
    "strip_warps": 4,
    # contiguous reduce dim ([B, L] -> [B]): the widest tile, one 8-warp row of 16-byte vectors
    "contig_warps": 8,
    # a row mask ([B, M, 1]: x predicated on it) loaded a trip ahead of the x loads, in row tiles
    # (one row of threads along r; MASK_AHEAD)
    "mask_ahead": True,
    # a row mask with this many rows or more (row tiles, and strips with compact_strips): its kept
    # rows listed first (_row_ids_kernel) and only they walked (COMPACT), so dropped rows cost no trips
    "compact_min_rows": 64,
    # COMPACT row tiles: listed rows per thread and trip (every one a live load), so that a
    # program's trip holds about this many bytes of x, up to compact_u_max rows
    "compact_trip_bytes": 8192,
    "compact_u_max": 32,
    # COMPACT row tiles: Triton's loop pipeliner stages (1: the ids loaded a trip ahead by hand)
    "compact_row_stages": 1,
    # many outputs and a row mask ([T, k, 1]): the x load is predicated, so about half of a
    # trip's loads are off; wider runs per thread keep the bytes in flight
    "row_mask_bytes": 4096,
    "row_mask_warps": 1,
    # strips with a row mask ([B, M, 1] over a long reduce dim: x predicated on it, about half of
    # the loads off): wider rows, fewer rows per thread, more warps than the other strips
    "row_mask_strip_min_bytes": 256,
    "row_mask_strip_u": 8,
    "row_mask_strip_warps": 8,
    # those strips' mask loaded a trip ahead of the x loads it predicates (MASK_AHEAD), as in the
    # row tiles: off, since the early mask loads did not pay in the strips (docs/BENCHMARKS.md); the
    # strips of a row mask over compact_min_rows rows or more list them instead
    "row_mask_strip_ahead": False,
    # a row mask with compact_min_rows rows or more in strips: its kept rows listed too, and
    # walked in trips of compact_strip_rows listed rows (one per row of threads, U = 1) on
    # compact_strip_warps warps, through Triton's loop pipeliner with compact_strip_stages stages
    # (the ids and the x rows they name copied into shared memory that many trips ahead, minus one)
    "compact_strips": True,
    "compact_strip_rows": 32,
    "compact_strip_warps": 4,
    "compact_strip_stages": 4,
}
_SHIPPED_KEY = tuple(sorted(TILES.items()))
# Software pipelining (PIPELINE) is on for the contiguous-r tiles only: in the strips every value
# carried across the loop's back edge is unpacked per element, which costs more registers than the
# early loads gain.


def _np2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def pick_blocks(r: int, i: int, n_outer: int, r_contiguous: bool, x_bytes: int = 2,
                n_sm: int = NOMINAL_SMS, row_mask: bool = False) -> tuple[int, int, int, int, bool, int]:
    """The tiles of _pick_blocks from TILES, or from the mask_reduce_tiles setting; under the
    small_tiles setting [2, 2, 4] trips (U = 2 rows of 2 per thread), the pipelined loop for even
    reduce lengths and the plain one for odd ones."""
    if settings.small_tiles:
        return 2, 4, 1, 2, r % 2 == 0, 2
    return _pick_blocks(r, i, n_outer, r_contiguous, x_bytes, n_sm, tiles_key(), row_mask)


def _tiles() -> dict:
    tiles = settings.mask_reduce_tiles
    if tiles is None:
        return TILES
    _check_tiles(tiles)
    return tiles


def _check_tiles(tiles) -> None:
    """The mask_reduce_tiles setting replaces TILES whole: the same entries, no fewer, no others."""
    if not isinstance(tiles, dict) or set(tiles) != set(TILES):
        got = set(tiles) if isinstance(tiles, dict) else set()
        raise ValueError(f"mask_reduce_tiles: expected a dict with the entries of kernels/mask_reduce.py TILES "
                         f"(e.g. {{**TILES, 'strip_u': 8}}); missing {sorted(set(TILES) - got)}, "
                         f"unknown {sorted(got - set(TILES))}")


def tiles_key() -> tuple:
    """The tiles in force (the mask_reduce_tiles setting, or TILES) as a hashable key."""
    tiles = _tiles()
    return _SHIPPED_KEY if tiles is TILES else tuple(sorted(tiles.items()))


@functools.lru_cache(maxsize=4096)
def _pick_blocks(r: int, i: int, n_outer: int, r_contiguous: bool, x_bytes: int, n_sm: int,
                 tiles: tuple, row_mask: bool = False) -> tuple[int, int, int, int, bool, int]:
    """(BLOCK_R, BLOCK_I, num_warps, VEC, PIPELINE, U), VEC = 16 bytes of x. A trip loads a
    [U * BLOCK_R, BLOCK_I] tile, U 16-byte x vectors per thread and column run, whose U rows a
    thread adds in registers; the accumulator is [BLOCK_R, BLOCK_I], one per thread and vector.

    - reduce dim not contiguous, plenty of outputs (MoE combine, [T, k, H] -> [T, H]): one
      row run per tile (2 warps along i), U rows per trip, no reduction across threads at all.
    - few outputs and a long reduce dim ([B, M, N] -> [B, N] with small B): narrower column
      strips until there are programs for every SM, all of the program's threads not needed
      along i placed along r, no software pipelining; one cross-warp reduction at the very end.
      (The reduce dim is not split instead, with fp32 partials: that needs a workspace larger
      than the output and does not lift the strips, docs/BENCHMARKS.md.)
    - reduce dim contiguous (token losses, [B, L] -> [B]): the tile's fast axis is r, pipelined.
    - ``row_mask``: x predicated on a row mask walked row by row (not COMPACT); in row tiles,
      wider runs on fewer warps (``row_mask_bytes``, ``row_mask_warps``), since about half of
      each thread's loads are off; in strips, the ``row_mask_strip_*`` tiles.
    The numbers are in ``tiles`` (TILES as sorted items).
    """
    t = dict(tiles)
    vec = max(1, 16 // x_bytes)
    cap = vec * 32 * t["contig_warps"]
    r2 = _np2(max(r, 1))
    i2 = _np2(max(i, 1))
    if r_contiguous:
        block_r = min(r2, cap)
        block_i = max(1, min(i2, cap * 2 // block_r))
        warps = max(1, min(t["contig_warps"], block_r * block_i // (vec * 32 * 2)))
        return block_r, block_i, warps, vec, True, 1
    # the strip tiles: a row mask's own (row_mask_strip_*)
    strip = {k: t["row_mask_" + k] if row_mask else t[k] for k in ("strip_min_bytes", "strip_u", "strip_warps")}
    min_i = max(1, t["strip_min_bytes"] // x_bytes)
    block_i = min(i2, (t["row_mask_bytes"] if row_mask else t["row_bytes"]) // x_bytes)
    enough = t["programs_per_sm"] * n_sm
    while block_i > min_i and n_outer * cdiv(i, block_i) < enough:
        block_i //= 2
    max_warps = strip["strip_warps"]
    if n_outer * cdiv(i, block_i) >= enough:
        u, block_r = min(t["row_u"], r2), 1
        if row_mask:
            max_warps = t["row_mask_warps"]
    else:
        # a row mask's strips are at least row_mask_strip_min_bytes wide (the choice between row
        # tiles and strips above is the same for every mask)
        block_i = min(i2, max(block_i, strip["strip_min_bytes"] // x_bytes))
        u = min(strip["strip_u"], r2)
        # threads along r: all of the program's threads not needed along i, fewer if r is short
        block_r = max(1, min(r2 // u, strip["strip_warps"] * 32 * vec // block_i))
    warps = max(1, min(max_warps, block_r * block_i // (vec * 32)))
    return block_r, block_i, warps, vec, False, u


def launch_config(r: int, o0: int, o1: int, i: int, sx, sm, ss, x_bytes: int, acc_f64: bool,
                  n_sm: int) -> tuple[int, dict, int]:
    """(n_iblk, constexprs, num_warps) of one launch over x [o0, o1, r, i] with reduce dim r;
    sx / sm / ss are the (r, 0, 1, i) strides of x, the mask and the scale (None if absent).
    The grid is o0 * o1 * n_iblk programs."""
    has_mask, has_scale = sm is not None, ss is not None
    sm = sm or (0, 0, 0, 0)
    ss = ss or (0, 0, 0, 0)
    r_contig = sx[0] == 1 and sx[3] != 1
    # predicate x on the mask only where the mask is constant along x's fast axis
    pred_x = has_mask and ((sm[0] == 0) if r_contig else (sm[3] == 0))
    # a mask broadcast over an output dim is read by several programs of one column block
    m_outer = has_mask and ((sm[1] == 0 and o0 > 1) or (sm[2] == 0 and o1 > 1))
    # a mask several programs read: L2 hints keep it (evict_last) and stream x past it (evict_first)
    m_shared = has_mask and (m_outer or (sm[3] == 0 and i > 1))
    row_mask = pred_x and not r_contig
    block_r, block_i, warps, vec, pipeline, u = pick_blocks(r, i, o0 * o1, r_contig, x_bytes, n_sm, row_mask=row_mask)
    # a row mask over a long reduce dim: its kept rows listed first and only they walked (the
    # scale, if any, the same for every row). Row tiles (one row of threads along r) take U listed
    # rows per thread and trip from the bytes of a trip (compact_trip_bytes), every load of a trip
    # live, the ids loaded a trip ahead by hand as shipped (compact_row_stages); strips (few
    # outputs) walk the list through Triton's loop pipeliner, one listed row per row of threads.
    # Measurements by shape, density, U and stages: docs/BENCHMARKS.md, "mask_reduce".
    # (the interpreter's small tiles: every row mask of 6 rows or more, to run the branch)
    t = _tiles()
    strips = block_r > 1 and not settings.small_tiles
    compact = (row_mask and (not strips or t["compact_strips"]) and (not has_scale or ss[0] == 0)
               and r >= (6 if settings.small_tiles else t["compact_min_rows"]))
    stages = 1
    if compact and strips:
        # the strip's width as chosen above; listed rows one per row of threads, pipelined
        block_r, u, stages = t["compact_strip_rows"], 1, t["compact_strip_stages"]
        warps = max(1, min(t["compact_strip_warps"], block_r * block_i // (vec * 32)))
    elif compact:
        block_r, block_i, warps, vec, pipeline, u = pick_blocks(r, i, o0 * o1, r_contig, x_bytes, n_sm)
        if settings.small_tiles:
            stages = 2 if r % 2 == 0 else 1  # both loops of COMPACT in the interpreter's tests
        else:
            u = min(t["compact_u_max"], _np2(max(1, t["compact_trip_bytes"] // (block_i * x_bytes))), _np2(r))
            stages = t["compact_row_stages"]
    # in-tile offsets fit 32 bits unless a tile spans more than 2**31 elements of some operand
    span = max(abs(st[0]) * block_r * u + abs(st[3]) * block_i for st in (sx, sm, ss))
    constexprs = dict(
        HAS_MASK=has_mask, HAS_SCALE=has_scale, ACC_F64=acc_f64,
        M_BCAST_R=sm[0] == 0, M_BCAST_I=sm[3] == 0, S_BCAST_R=ss[0] == 0, S_BCAST_I=ss[3] == 0,
        PRED_X=pred_x, WIDE=span >= 2**31, BLOCK_R=block_r, BLOCK_I=block_i, VEC=vec,
        M_EVICT="evict_last" if m_shared else "", X_EVICT="evict_first" if m_shared else "",
        PIPELINE=pipeline, U=u,
        # always where it applies: the programs that read one stored mask tile run together (L2 hits)
        OUTER_FIRST=m_outer,
        EVEN=r % (block_r * u) == 0 and i % block_i == 0,
        # row tiles: the mask_ahead tile; strips: the row_mask_strip_ahead tile
        MASK_AHEAD=pred_x and not r_contig and sm[0] != 0 and not pipeline and not compact
        and (t["mask_ahead"] if block_r == 1 else t["row_mask_strip_ahead"]),
        COMPACT=compact, NUM_STAGES=stages,
        # row tiles over listed rows launched while the listing runs (ops/mask_reduce.py turns this
        # off where the device or Triton lacks it); the strips, with about two programs per SM,
        # launch after it, as they run slower beside the listing (docs/BENCHMARKS.md)
        PDL=compact and not strips,
    )
    return cdiv(i, block_i), constexprs, warps


# (name, x dtype, x shape, reduce dim, x strides, mask strides, scale strides) of the launches
# the benchmarks and the usual callers make, on a NOMINAL_SMS device; strides of the broadcast views
_COMPILE_LAUNCHES = [
    ("moe [T,k,1] mask, [T,k] weights", "bf16", (65536, 4, 8192), 1, (32768, 8192, 1), (4, 1, 0), (4, 1, 0)),
    ("full mask", "bf16", (8192, 4, 8192), 1, (32768, 8192, 1), (32768, 8192, 1), None),
    ("[1,M,N] mask strips", "bf16", (8, 4096, 4096), 1, (4096 * 4096, 4096, 1), (0, 4096, 1), None),
    ("no mask strips", "fp16", (8, 4096, 4096), 1, (4096 * 4096, 4096, 1), None, None),
    ("[B,M,1] mask strips", "bf16", (8, 4096, 4096), 1, (4096 * 4096, 4096, 1), (4096, 1, 0), None),
    ("[B,L,1] pooling mask, row tiles over listed rows", "bf16", (64, 512, 4096), 1, (512 * 4096, 4096, 1),
     (512, 1, 0), None),
    ("token loss [B,L] mask", "fp32", (64, 4096), 1, (4096, 1), (4096, 1), None),
    ("token loss [B,L] mask, [1,L] scale", "bf16", (64, 4096), 1, (4096, 1), (4096, 1), (0, 1)),
    ("token loss [B,1] mask float64", "fp64", (64, 4096), 1, (4096, 1), (1, 0), None),
    ("moe, reduce stride 2**29 (int64 tile offsets)", "bf16", (4, 4, 8192), 1, (2**31, 2**29, 1), (4, 1, 0), None),
]
_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}


def compile_cases():
    """(name, kernel, signature, constexprs, num_warps) of the launches in _COMPILE_LAUNCHES, with
    the constexprs launch_config gives them (for tests/test_kernels_compile.py). Integer
    arguments equal to 1 are constexprs, as Triton specializes them at launch."""
    for name, dt, shape, d, sx, sm, ss in _COMPILE_LAUNCHES:
        def four(st):  # (r, 0, 1, i) strides, in the order ops/mask_reduce.py passes them
            if st is None:
                return None
            st = list(st)
            r = st.pop(d)
            return (r, *([0] * (3 - len(st)) + st))

        osz = list(shape[:d]) + list(shape[d + 1:])
        o0, o1, i = [1] * (3 - len(osz)) + osz
        x4, m4, s4 = four(sx), four(sm), four(ss)
        n_iblk, cx, warps = launch_config(shape[d], o0, o1, i, x4, m4, s4, _BYTES[dt], dt == "fp64", NOMINAL_SMS)
        sig = {"p_x": f"*{dt}", "p_m": "*u8", "p_s": "*fp32", "p_y": f"*{dt}"}
        lists = row_id_lists(o0, o1, m4) if cx["COMPACT"] else (1, 1, 0, 0)
        if cx["COMPACT"]:
            sig.update(p_rid="*i32", p_cnt="*i32")
            cx["PDL"] = cx["PDL"] and HAS_PDL  # as ops/mask_reduce.py launches it on Hopper
        else:
            cx.update(p_rid=None, p_cnt=None)
        args = [("R", shape[d]), ("O1", o1), ("I", i), ("n_iblk", n_iblk), ("n_outer", o0 * o1)]
        for pre, st in (("sx", x4), ("sm", m4), ("ss", s4)):
            args += [(f"{pre}_{suf}", v) for suf, v in zip(("r", "0", "1", "i"), st or (0, 0, 0, 0))]
        args += [("lst_0", lists[2]), ("lst_1", lists[3])]
        for k, v in args:
            if v == 1:
                cx[k] = 1
            else:
                sig[k] = "i64" if abs(v) >= 2**31 else "i32"
        yield (f"mask_reduce {name}", _mask_reduce_forward_kernel, sig, cx, warps)
    yield ("mask_reduce row ids", _row_ids_kernel,
           {"p_m": "*u8", "p_rid": "*i32", "p_cnt": "*i32", "R": "i32", "N1": "i32", "sm_r": "i32", "sm_0": "i32",
            "sm_1": "i32"}, {"BLOCK": ROW_IDS_BLOCK, "PDL": HAS_PDL}, 4)
