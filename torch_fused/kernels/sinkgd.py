"""Multi-tensor Triton kernels of fused::sinkgd_step: a few launches per stage for a whole list
of matrices (of one device and param/grad dtype pair), however many parameters there are.

Every SR-Sinkhorn iteration is a diagonal scaling, X = diag(r) G diag(c), so the kernels carry
only the scale vectors r [B, m] and c [B, n] of each matrix, never a full-size temporary.

One iteration reads G once (matrices with n <= max_fused_n, all common LLM weights):

- ``_sinkgd_rows_kernel``: a program owns BM whole rows of one matrix and walks them RB at a
  time. Holding a whole row, it finishes that row's norm of r_i G_ij c_j itself and rescales
  r_i (r_i <- r_i sqrt(n) / max(norm, eps)); with the new r_i in hand it adds the row's
  (r_i G_ij c_j)^2 into a per-program column accumulator, written out at the end as one
  partial per (program, column). No atomics: every partial has its own slot.
- ``_sinkgd_scale_kernel`` (AXIS=1) sums each column's partials in a fixed order and rescales c:
  c <- c sqrt(m) / max(sqrt(sum), eps), clamped at 1e30 (see reference.sinkgd_scales).

So a step is L + 3 passes over the gradient's bytes (L row passes, then the update reads G and W
and writes W) plus the small partials. Wider matrices (n > max_fused_n) take two passes per
iteration: ``_sinkgd_sums_kernel`` (AXIS=0) writes row partials of [BM, BN] tiles (each tile
row's norm, squared scaled where it would overflow) and ``_sinkgd_scale_kernel`` (AXIS=0)
finishes r from them (combined scaled), then ``_sinkgd_sums_kernel`` (AXIS=1) writes the column
partials that the same column scale launch finishes. Every norm is computed so that any finite
gradient gives finite scales, as the one-read row pass does.

- ``_sinkgd_update_kernel``: W <- W - coef_x[b] * r_i c_j G_ij - coef_w * W in fp32, stored in
  W's dtype, optionally with stochastic rounding to bf16.

The spectral step (power iteration on X with the final r and c, warm-started from v) adds per
power iteration one more pass over G and two small launches:

- ``_sinkgd_power_rows_kernel`` (the row pass's programs and tiles): u_i = r_i sum_j G_ij c_j v_j
  from the rows a program holds, then G_ij (r_i u_i) into per-program column partials and
  sum u_i^2 into one |u|^2 partial per program. Wider matrices: ``_sinkgd_power_tiles_kernel``,
  AXIS=0 row partials of (r G) (c v), AXIS=1 u and the column partials (r applied to G first).
- ``_sinkgd_power_cols_kernel``: w_j = c_j sum(partials of j) / max(|u|, eps) = (X^T u)_j with
  u normalized, written into v, and per-block partials of |w|^2.
- ``_sinkgd_power_norm_kernel``: sigma = |w|, v <- w / sigma, and the scale target / max(sigma,
  eps) that the update kernel applies (HAS_SPEC); where sigma = 0, the restart vector and 0.

Sharded rows (optim/sharded.py: each rank holds some rows of a matrix): the column sums need an
all-reduce between the row pass and the column scale. ``_sinkgd_colsum_kernel`` finishes a
rank's sums of its column partials (and |u|^2 partials) into a sums buffer (S_OFF, SU_OFF);
after the all-reduce the column scale and ``_sinkgd_power_cols_kernel`` read those sums
(SUMMED) instead of the partials. MG, EOFF and SALT place the local rows in the whole matrix
for the column scale's m, the spectral target's and the update's random bits.

Vector loads. The row length n and the matrix addresses come from the work table at run time,
so the compiler cannot see that rows start 16-byte aligned and would load G one element at a
time. Where every matrix of a launch has n a multiple of ALIGN (16 bytes' worth of the narrowest
G/W element) and 16-byte aligned G and W, the launcher passes ALIGN and the kernels declare n
and the base pointers with tl.multiple_of, which gives 16-byte loads (else ALIGN = 1: no claim).
The hints sit in the kernel bodies: a value returned from a @triton.jit helper loses them.

Work lists: an int64 table ``meta`` [n_mats, META_COLS] holds each matrix's addresses (its
spectral vector's too), sizes and offsets into the concatenated r / c / partials buffers;
``first`` [n_mats + 1] holds the first program id of each matrix in one launch. A program finds its matrix by binary search over
``first`` and its tile from the remainder. Every launch gets its own (meta, first) pair over
the matrices it covers (ops/sinkgd/plan.py::_Plan builds them once per set of parameters).
"""

from __future__ import annotations


import dataclasses

import triton
import triton.language as tl

from ..settings import current as settings
from .._library import SCALE_MAX as _SCALE_MAX, SQRT_FP32_MAX as _SQRT_FP32_MAX, SR_SEED_STRIDE as _SR_SEED_STRIDE

# meta columns (constexpr globals: readable inside @triton.jit); the launcher writes rows in
# exactly this order (ops/sinkgd/plan.py::_Plan)
G_PTR = tl.constexpr(0)
W_PTR = tl.constexpr(1)
M = tl.constexpr(2)
N = tl.constexpr(3)
R_OFF = tl.constexpr(4)
C_OFF = tl.constexpr(5)
PR_OFF = tl.constexpr(6)
PC_OFF = tl.constexpr(7)
COEF_OFF = tl.constexpr(8)
N_PC = tl.constexpr(9)  # column partials per batch entry (row blocks of the pass that wrote them)
V_PTR = tl.constexpr(10)  # the spectral warm-start vectors [B, n] (fp32; 0 without the spectral step)
U_OFF = tl.constexpr(11)  # |u|^2 partials of the power pass: N_PC per batch entry
WQ_OFF = tl.constexpr(12)  # |w|^2 partials: one per scale_block columns and batch entry
# sharded parameters (optim/sharded.py: a rank's rows of each matrix); a whole matrix has
# MG = M and EOFF = 0; SALT is the matrix's index among the list's matrices of its load class
# (ALIGN), in list order
MG = tl.constexpr(13)  # the whole matrix's row count: the column scale's and the spectral target's m
EOFF = tl.constexpr(14)  # index in the whole parameter of the local block's first element
SALT = tl.constexpr(15)  # the matrix's stochastic-rounding salt (seed = step * SR_SEED_STRIDE + SALT)
S_OFF = tl.constexpr(16)  # the finished column sums [B, n] in the sums buffer (_sinkgd_colsum_kernel)
SU_OFF = tl.constexpr(17)  # and the finished |u|^2 sums [B]
# the column names in order: the one list the launchers build rows from (meta_row)
META_FIELDS = ("G_PTR", "W_PTR", "M", "N", "R_OFF", "C_OFF", "PR_OFF", "PC_OFF", "COEF_OFF", "N_PC", "V_PTR",
               "U_OFF", "WQ_OFF", "MG", "EOFF", "SALT", "S_OFF", "SU_OFF")
META_COLS = tl.constexpr(len(META_FIELDS))
assert [globals()[f].value for f in META_FIELDS] == list(range(len(META_FIELDS))), "meta columns out of order"
# the columns that place a sharded matrix's local block (optim/sharded.py passes them per matrix)
SHARD_FIELDS = ("MG", "EOFF", "SALT", "S_OFF", "SU_OFF")


def meta_row(**cols) -> list:
    """One row of the meta table from its columns by name (every column of META_FIELDS, no other)."""
    if cols.keys() != set(META_FIELDS):
        raise KeyError(f"meta_row: missing {sorted(set(META_FIELDS) - cols.keys())}, "
                       f"unknown {sorted(cols.keys() - set(META_FIELDS))}")
    return [cols[f] for f in META_FIELDS]

SCALE_MAX = tl.constexpr(_SCALE_MAX)  # the clamp of every r and c (see _library.SCALE_MAX)
SQRT_FP32_MAX = tl.constexpr(_SQRT_FP32_MAX)  # about sqrt(fp32 max): a clamp whose square stays finite
SR_SEED_STRIDE = tl.constexpr(_SR_SEED_STRIDE)
SSQ_SCALED = tl.constexpr(1e37)  # a row sum of squares above this (or inf) is recomputed scaled

@dataclasses.dataclass(frozen=True)
class Tiles:
    """The tile constants the launchers (ops/sinkgd/launch.py) and plans (ops/sinkgd/plan.py) read;
    a plan is built from one set and keyed by it. ``tiles()`` is the set in use."""
    max_fused_n: int = 16384  # widest row a _sinkgd_rows_kernel program holds in registers
    row_tile: tuple = (8, 1024, 4)  # two-pass path, row sums: BM, BN, warps
    col_tile: tuple = (128, 64, 4)  # two-pass path, column sums
    upd_tile: tuple = (32, 256, 4)  # [BM, BN] tiles of the update: BN 256 divides the common widths (768, 3072)
    scale_block: int = 32  # _sinkgd_scale_kernel: entries per program (32 or 64: the sinkgd suite times them)
    scale_parts: int = 64  # and partials per trip
    # _sinkgd_rows_kernel tiles (rows_config; the sinkgd_tiles setting replaces them for a sweep):
    # elements per thread and row, the most warps a program gets, rows per program, rows per trip
    rows_elems: int = 32
    rows_max_warps: int = 16
    rows_bm: int = 64
    rows_min_programs: int = 4  # per SM, see rows_bm
    rows_max_partials: int = 1024  # per column of a matrix, see rows_bm
    rows_rb: int = 1
    # The row and power passes' loads are software pipelined by Triton (tl.range num_stages,
    # staged through shared memory: more bytes in flight than registers allow) where rows_pipe
    # stages of a trip fit in rows_pipe_bytes; else (and with rows_pipe = 0) the kernels prefetch
    # one trip in registers.
    rows_pipe: int = 3
    rows_pipe_bytes: int = 64 << 10


SHIPPED_TILES = Tiles()
# The small_tiles setting (the interpreter test run): rows wider than 64 take the two-pass path;
# the one-read row pass gets programs of 4 rows in 1-2 row trips, so small matrices still have
# several programs and trips each (a 70-row matrix gets 8-row programs); several partial trips
# per column with a masked tail; 64-wide two-pass and update tiles, so rows of 65-150 already span
# several tiles and matrices of more than 8 rows have several column partials.
SMALL_TILES = dataclasses.replace(SHIPPED_TILES, max_fused_n=64, rows_elems=1, rows_bm=4, rows_max_partials=16,
                                  scale_parts=4, row_tile=(8, 64, 4), col_tile=(8, 64, 4), upd_tile=(8, 64, 4))


def tiles() -> Tiles:
    """The tiles in use: the sinkgd_tiles setting, else SMALL_TILES under the small_tiles setting,
    else SHIPPED_TILES."""
    return settings.sinkgd_tiles or (SMALL_TILES if settings.small_tiles else SHIPPED_TILES)


def rows_pipe(block_n: int, rb: int, elem_bytes: int, t: Tiles | None = None) -> int:
    """The PIPE constexpr of a row or power pass over [rb, block_n] trips of elem_bytes-wide
    gradient elements (see Tiles.rows_pipe), with the tiles ``t`` (default: tiles())."""
    t = t or tiles()
    return t.rows_pipe if t.rows_pipe * rb * block_n * elem_bytes <= t.rows_pipe_bytes else 0


def rows_config(n: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, RB, BM, num_warps) of _sinkgd_rows_kernel for rows of n
    elements: a trip loads RB rows (rows_rb, fewer for long rows, more for short ones) with
    rows_elems elements per thread and row (more where rows_max_warps caps the warps); a program
    owns BM rows (BM / RB trips; m / BM column partials per column)."""
    t = tiles()
    block_n = max(16, triton.next_power_of_2(n))
    # more rows per trip only where rows_elems per thread still holds (the registers spill else)
    rb = max(1, min(t.rows_rb, t.rows_elems * 32 * t.rows_max_warps // block_n))
    warps = max(1, min(t.rows_max_warps, rb * block_n // (32 * t.rows_elems)))
    rb = max(rb, t.rows_elems * 32 * warps // block_n)
    return block_n, rb, max(rb, t.rows_bm), warps


def rows_bm(total_rows: int, rb: int, n_sm: int, max_m: int) -> int:
    """Rows per program of a row-pass launch over total_rows rows: rows_bm, halved (not below
    16 or RB) until the launch has rows_min_programs programs per SM (a launch of a few long
    rows, a down projection's 4096 x 14336, otherwise runs on half the SMs); then raised to a
    power of two that leaves the tallest matrix (max_m rows) at most rows_max_partials column
    partials per column, so the partials stay O(cols) per matrix."""
    t = tiles()
    bm = max(rb, t.rows_bm)
    while bm > max(16, rb) and total_rows < t.rows_min_programs * n_sm * bm:
        bm //= 2
    return max(bm, triton.next_power_of_2(triton.cdiv(max_m, t.rows_max_partials)))


@triton.jit
def _find_matrix(p_first, n_mats, pid):
    """Largest i with first[i] <= pid (first is ascending, first[0] = 0)."""
    lo = 0
    hi = n_mats
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go_right = tl.load(p_first + mid) <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo, pid - tl.load(p_first + lo)


@triton.jit
def _program_matrix(p_meta, p_first, n_mats):
    """This program's matrix in the launch's work table: (its index, the program's index among
    the matrix's programs, a pointer to its meta row). The kernels load n and the addresses
    from the row themselves: an alignment hint on a value returned from here would be lost."""
    pid = tl.program_id(0).to(tl.int64)
    mat, local = _find_matrix(p_first, n_mats, pid)
    return mat, local, p_meta + mat * META_COLS


@triton.jit
def _tile_coords(local, m, n, BM: tl.constexpr, BN: tl.constexpr):
    """A program's tile of its matrix from its index among the matrix's programs: batch entry
    b and tile coordinates (t_m, t_n) of [BM, BN] tiles."""
    tiles_m = tl.cdiv(m, BM)
    tiles_n = tl.cdiv(n, BN)
    b = local // (tiles_m * tiles_n)
    rem = local % (tiles_m * tiles_n)
    return b, rem // tiles_n, rem % tiles_n


@triton.jit
def _sinkgd_rows_kernel(p_meta, p_first, n_mats, p_gdt, p_r, p_c, p_part, eps,
                        ONES_R: tl.constexpr, ONES_C: tl.constexpr, BLOCK_N: tl.constexpr, RB: tl.constexpr,
                        BM: tl.constexpr, ALIGN: tl.constexpr, EVEN_N: tl.constexpr,
                        PIPE: tl.constexpr):
    """One SR-Sinkhorn row step and the column partials that follow it, for BM whole rows.
    EVEN_N: every row of the launch is BLOCK_N long.
    ONES_R / ONES_C: r / c are still all ones (the first iteration): not read. ALIGN: see
    the module docstring."""
    mat, local, row = _program_matrix(p_meta, p_first, n_mats)
    m = tl.load(row + M)
    n = tl.load(row + N)
    p_g = tl.load(row + G_PTR).to(tl.pointer_type(p_gdt.dtype.element_ty))
    n32 = n.to(tl.int32)
    if ALIGN > 1:  # hints on values defined here: one passed through a helper loses them
        n = tl.multiple_of(n, ALIGN)
        n32 = tl.multiple_of(n32, ALIGN)
        p_g = tl.multiple_of(p_g, 16)
    tiles_m = tl.cdiv(m, BM)
    b = local // tiles_m
    t_m = local % tiles_m
    r0 = t_m * BM
    p_g += (b * m + r0) * n
    p_rb = p_r + tl.load(row + R_OFF) + b * m + r0
    target = tl.sqrt(n.to(tl.float32))
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < n
    p_cb = p_c + tl.load(row + C_OFF) + b * n
    p_pc = p_part + tl.load(row + PC_OFF) + (b * tiles_m + t_m) * n
    if ALIGN > 1:  # C_OFF and PC_OFF are multiples of 4 floats (the plan pads them)
        p_cb = tl.multiple_of(p_cb, 16)
        p_pc = tl.multiple_of(p_pc, 16)
    n_rows = tl.minimum(m - r0, BM).to(tl.int32)
    # every per-row and per-column value is kept 2-D ([RB, 1] / [1, BLOCK_N]) in the tile's own
    # register layout: a 1-D vector would be converted through shared memory on every trip
    o_r = tl.arange(0, RB)[:, None]
    o_n = o_n[None, :]
    m_n = m_n[None, :]
    t_off = o_r * n32 + o_n  # in-trip offsets: BM * n < 2**31
    acc = tl.zeros([RB, BLOCK_N], dtype=tl.float32)
    worst = 0.0  # the largest row sum of squares: past SSQ_SCALED, the rows are redone scaled
    # software pipelined: with PIPE (rows_pipe) by Triton, PIPE - 1 trips' loads staged through
    # shared memory ahead of this one; else the next trip's rows are loaded into registers
    # during this trip's reduction (c is held, not re-read every trip). The trip
    # is issue-bound as much as memory-bound, so per element it does only a convert, y = g c,
    # q = y^2, a sum and one fma: r stays out of the elementwise work, since
    # |r g c| = r |g c| for the row norm and (r_new g c)^2 = r_new^2 q for the column terms.
    # (y = g c is about as small as g: it underflows where the first iteration's g^2 does.)
    m_ld = m_n
    if EVEN_N:
        m_ld = o_r >= 0  # a constant-true [RB, 1] mask: no per-element column test
    if not ONES_C:
        b_c = tl.load(p_cb + o_n, mask=m_ld, other=0.0)
    if PIPE == 0:
        g_next = tl.load(p_g + t_off, mask=(o_r < n_rows) & m_ld, other=0.0)
    for k in tl.range(0, tl.cdiv(n_rows, RB), num_stages=PIPE if PIPE > 0 else None):
        rows = k * RB + o_r
        m_r = rows < n_rows
        if PIPE == 0:
            b_g = g_next
            g_next = tl.load(p_g + (k + 1) * RB * n + t_off, mask=(rows + RB < n_rows) & m_ld, other=0.0)
        else:
            b_g = tl.load(p_g + k * RB * n + t_off, mask=m_r & m_ld, other=0.0)
        y = b_g.to(tl.float32)
        if not ONES_C:
            y = y * b_c
        q = y * y
        ssq = tl.sum(q, axis=1, keep_dims=True)
        big = ssq > SSQ_SCALED  # squares past fp32 (entries past about 1.8e19 / sqrt(n)): redone below
        worst = tl.maximum(worst, tl.max(ssq))
        norm = tl.sqrt(ssq)
        if ONES_R:
            r_old = tl.full([RB, 1], 1.0, tl.float32)
        else:
            r_old = tl.load(p_rb + rows, mask=m_r, other=1.0)
            norm = r_old * norm
        r_new = tl.minimum(r_old * target / tl.maximum(norm, eps), SCALE_MAX)
        # a big row keeps -r_old (r > 0 always): the redo finds it by its sign
        tl.store(p_rb + rows, tl.where(big, -r_old, r_new), mask=m_r)
        r_sq = tl.minimum(r_new, SQRT_FP32_MAX)  # a zero row's r_new = 1e30 meets q = 0: keep r_new^2 finite
        acc += q * (r_sq * r_sq)
    if worst > SSQ_SCALED:
        # Rare: some row's squares overflowed fp32 (or g c itself did: c > 1 on entries near the
        # fp32 maximum). The program's rows again as x = (r_old g) c, X's row before this step
        # (bounded), each scaled by its largest |x| (a): with s = sqrt(sum (x/a)^2) in
        # [1, sqrt(n)], the row norm a s is never formed (it overflows for entries near the fp32
        # maximum): r_new = r_old (target / s) / max(a, eps / s), and the column terms
        # (r_new g c)^2 = (a r_new / r_old)^2 (x/a)^2 stay finite. The big rows finish their r
        # here (the others' r stand: there x is already the new row); the column partials are
        # rebuilt from every row. Out of the pipelined loop above, so the common case pays only
        # the running max of the row sums.
        acc = tl.zeros([RB, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(n_rows, RB)):
            rows = k * RB + o_r
            m_r = rows < n_rows
            r_cur = tl.load(p_rb + rows, mask=m_r, other=1.0)
            big = r_cur < 0  # left by the first loop with -r_old
            r_old = tl.abs(r_cur)
            x = tl.load(p_g + k * RB * n + t_off, mask=m_r & m_ld, other=0.0).to(tl.float32) * r_old
            if not ONES_C:
                x = x * b_c
            a = tl.max(tl.abs(x), axis=1, keep_dims=True)
            live = a > 0
            x = x / tl.where(live, a, 1.0)
            q = x * x
            s = tl.where(live, tl.sqrt(tl.sum(q, axis=1, keep_dims=True)), 1.0)
            r_new = tl.where(big, tl.minimum(r_old * (target / s) / tl.maximum(a, eps / s), SCALE_MAX), r_cur)
            tl.store(p_rb + rows, r_new, mask=m_r)
            r_sq = tl.minimum(tl.where(big, r_new / r_old, 1.0) * a, SQRT_FP32_MAX)
            acc += q * (r_sq * r_sq)
    col = tl.sum(acc, axis=0, keep_dims=True)
    tl.store(p_pc + o_n, col, mask=m_n)


@triton.jit
def _sinkgd_sums_kernel(p_meta, p_first, n_mats, p_gdt, p_r, p_c, p_part,
                        AXIS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        ONES_R: tl.constexpr, ONES_C: tl.constexpr, ALIGN: tl.constexpr):
    """ONES_R / ONES_C: r / c are still all ones (the first iteration): not read."""
    mat, local, row = _program_matrix(p_meta, p_first, n_mats)
    m = tl.load(row + M)
    n = tl.load(row + N)
    p_g = tl.load(row + G_PTR).to(tl.pointer_type(p_gdt.dtype.element_ty))
    n32 = n.to(tl.int32)
    if ALIGN > 1:  # hints on values defined here: one passed through a helper loses them
        n = tl.multiple_of(n, ALIGN)
        n32 = tl.multiple_of(n32, ALIGN)
        p_g = tl.multiple_of(p_g, 16)
    b, t_m, t_n = _tile_coords(local, m, n, BM, BN)
    tiles_m = tl.cdiv(m, BM)
    tiles_n = tl.cdiv(n, BN)
    o_m = t_m * BM + tl.arange(0, BM)
    o_n = t_n * BN + tl.arange(0, BN)
    m_m = o_m < m
    m_n = o_n < n
    t_off = tl.arange(0, BM)[:, None] * n32 + tl.arange(0, BN)[None, :]  # 32-bit: BM * n < 2**31
    b_g = tl.load(p_g + (b * m + t_m * BM) * n + t_n * BN + t_off,
                  mask=m_m[:, None] & m_n[None, :], other=0.0).to(tl.float32)
    b_x = b_g
    if not ONES_R:
        b_r = tl.load(p_r + tl.load(row + R_OFF) + b * m + o_m, mask=m_m, other=0.0)
        b_x = b_x * b_r[:, None]
    if not ONES_C:
        b_c = tl.load(p_c + tl.load(row + C_OFF) + b * n + o_n, mask=m_n, other=0.0)
        b_x = b_x * b_c[None, :]
    b_x2 = b_x * b_x
    if AXIS == 0:  # row norms: partials [B, tiles_n, m]
        # each partial is the tile row's l2 norm / sqrt(BN) (at most its largest |x|: finite
        # for any finite G). Where a square sum passes SSQ_SCALED (entries past about 1.8e19 /
        # sqrt(BN)), the tile's rows are redone in registers, each x scaled by its largest |x|
        # before squaring; _sinkgd_scale_kernel (AXIS=0) combines the partials scaled as well.
        s = tl.sum(b_x2, axis=1)
        nrm = tl.sqrt(s * (1.0 / BN))
        if tl.max(s) > SSQ_SCALED:
            a = tl.max(tl.abs(b_x), axis=1)
            y = b_x / tl.where(a > 0, a, 1.0)[:, None]
            nrm = a * tl.sqrt(tl.sum(y * y, axis=1) * (1.0 / BN))
        tl.store(p_part + tl.load(row + PR_OFF) + (b * tiles_n + t_n) * m + o_m, nrm, mask=m_m)
    else:  # column sums: partials [B, tiles_m, n]
        s = tl.sum(b_x2, axis=0)
        tl.store(p_part + tl.load(row + PC_OFF) + (b * tiles_m + t_m) * n + o_n, s, mask=m_n)


@triton.jit
def _column_block(local, n, BLOCK: tl.constexpr):
    """A program of a per-column launch (BLOCK columns of one batch entry): its batch entry b,
    its block blk of the entry's blocks, the columns o and their mask."""
    blocks = tl.cdiv(n, BLOCK)
    o = (local % blocks) * BLOCK + tl.arange(0, BLOCK)
    return local // blocks, local % blocks, blocks, o, o < n


@triton.jit
def _sum_partials(p_p, p_u, n_parts, length, o, msk, WITH_U: tl.constexpr, BLOCK: tl.constexpr,
                  PARTS: tl.constexpr):
    """For BLOCK entries o (of ``length``): the sum of each entry's n_parts partials (partial k
    at p_p + k * length + o) and, with WITH_U, of the n_parts scalars at p_u; PARTS partials
    per trip (a [PARTS, BLOCK] tile), always in the same order: deterministic."""
    o_k = tl.arange(0, PARTS)
    acc2 = tl.zeros([PARTS, BLOCK], dtype=tl.float32)
    acc_u = tl.zeros([PARTS], dtype=tl.float32)
    for k in range(0, n_parts, PARTS):
        ks = k + o_k
        acc2 += tl.load(p_p + ks[:, None] * length + o[None, :], mask=(ks < n_parts)[:, None] & msk[None, :],
                        other=0.0)
        if WITH_U:
            acc_u += tl.load(p_u + ks, mask=ks < n_parts, other=0.0)
    return tl.sum(acc2, axis=0), tl.sum(acc_u)


@triton.jit
def _sinkgd_scale_kernel(p_meta, p_first, n_mats, p_vec, p_part, eps,
                         AXIS: tl.constexpr, PART_TILE: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
                         ONES: tl.constexpr, SUMMED: tl.constexpr):
    """AXIS=0: r <- r sqrt(n) / max(row norm, eps), from the row norm partials of PART_TILE-wide
    tiles (each a tile row's norm / sqrt(PART_TILE), _sinkgd_sums_kernel), combined scaled: with
    a the largest partial and q = sqrt(PART_TILE sum (p / a)^2), the norm is a q, never formed
    (it overflows for entries near the fp32 maximum): r <- r (sqrt(n) / q) / max(a, eps / q).
    AXIS=1: c <- c sqrt(m) / max(col norm, eps), from the N_PC column partials (sums of squares
    of X's bounded entries) the meta row names. ONES: the vector is still all ones (first
    iteration): written, not read. A program finishes BLOCK entries, reading their partials
    PARTS at a time (a [PARTS, BLOCK] tile per trip: few dependent trips even for a tall
    matrix's hundreds of partials), summed in a fixed order: deterministic. SUMMED (AXIS=1,
    sharded rows): p_part is the sums buffer, one finished (all-reduced) sum per column at
    S_OFF; m is the whole matrix's (MG)."""
    mat, local, row = _program_matrix(p_meta, p_first, n_mats)
    m = tl.load(row + M)
    n = tl.load(row + N)
    if AXIS == 0:
        length = m
        n_parts = tl.cdiv(n, PART_TILE)
        off = tl.load(row + R_OFF)
        poff = tl.load(row + PR_OFF)
        target = tl.sqrt(n.to(tl.float32))
    else:
        length = n
        if SUMMED:
            n_parts = 1
            poff = tl.load(row + S_OFF)
        else:
            n_parts = tl.load(row + N_PC)
            poff = tl.load(row + PC_OFF)
        off = tl.load(row + C_OFF)
        target = tl.sqrt(tl.load(row + MG).to(tl.float32))
    blocks = tl.cdiv(length, BLOCK)
    b = local // blocks
    o = (local % blocks) * BLOCK + tl.arange(0, BLOCK)
    msk = o < length
    p_p = p_part + poff + b * n_parts * length
    if AXIS == 0:
        # the largest partial a of each row, then the sum of (p / a)^2: two loops over the
        # row's cdiv(n, PART_TILE) partials
        o_k = tl.arange(0, PARTS)
        top = tl.zeros([PARTS, BLOCK], dtype=tl.float32)
        for k in range(0, n_parts, PARTS):
            ks = k + o_k
            top = tl.maximum(top, tl.load(p_p + ks[:, None] * length + o[None, :],
                                          mask=(ks < n_parts)[:, None] & msk[None, :], other=0.0))
        a = tl.max(top, axis=0)
        live = a > 0
        a_div = tl.where(live, a, 1.0)[None, :]
        acc2 = tl.zeros([PARTS, BLOCK], dtype=tl.float32)
        for k in range(0, n_parts, PARTS):
            ks = k + o_k
            y = tl.load(p_p + ks[:, None] * length + o[None, :], mask=(ks < n_parts)[:, None] & msk[None, :],
                        other=0.0) / a_div
            acc2 += y * y
        q = tl.where(live, tl.sqrt(tl.sum(acc2, axis=0) * PART_TILE), 1.0)
    else:
        acc, _ = _sum_partials(p_p, p_part, n_parts, length, o, msk, False, BLOCK, PARTS)
        a = tl.sqrt(acc)
        q = 1.0
    p_v = p_vec + off + b * length + o
    if ONES:
        v = (target / q) / tl.maximum(a, eps / q)
    else:
        v = tl.load(p_v, mask=msk, other=0.0)
        v = v * (target / q) / tl.maximum(a, eps / q)
    tl.store(p_v, tl.minimum(v, SCALE_MAX), mask=msk)


@triton.jit
def _sinkgd_power_rows_kernel(p_meta, p_first, n_mats, p_gdt, p_r, p_c, p_part, p_upart,
                              BLOCK_N: tl.constexpr, RB: tl.constexpr, BM: tl.constexpr, ALIGN: tl.constexpr,
                              EVEN_N: tl.constexpr, PIPE: tl.constexpr):
    """One power-iteration pass over BM whole rows of X = diag(r) G diag(c) (X never formed):
    u_i = r_i sum_j G_ij (c_j v_j) from the row it holds, then the row's column terms
    G_ij (r_i u_i) into a per-program column accumulator (one partial per (program, column),
    the row pass's layout: PC_OFF, N_PC) and sum_i u_i^2 of its rows into one |u|^2 partial
    (U_OFF). Same tiles and software pipelining as _sinkgd_rows_kernel; r and c are final.
    Where some row's d_i = sum_j G_ij (c_j v_j) is not finite (entries past about 1e36 for
    long rows: G's scale sits in r, not in c v), the program's rows are redone with r applied
    first, x_ij = r_i G_ij: u_i = sum_j x_ij (c_j v_j) and the column terms x_ij u_i."""
    mat, local, row = _program_matrix(p_meta, p_first, n_mats)
    m = tl.load(row + M)
    n = tl.load(row + N)
    p_g = tl.load(row + G_PTR).to(tl.pointer_type(p_gdt.dtype.element_ty))
    p_v = tl.load(row + V_PTR).to(tl.pointer_type(tl.float32))
    n32 = n.to(tl.int32)
    if ALIGN > 1:  # hints on values defined here: one passed through a helper loses them
        n = tl.multiple_of(n, ALIGN)
        n32 = tl.multiple_of(n32, ALIGN)
        p_g = tl.multiple_of(p_g, 16)
        p_v = tl.multiple_of(p_v, 16)
    tiles_m = tl.cdiv(m, BM)
    b = local // tiles_m
    t_m = local % tiles_m
    r0 = t_m * BM
    p_g += (b * m + r0) * n
    p_rb = p_r + tl.load(row + R_OFF) + b * m + r0
    p_cb = p_c + tl.load(row + C_OFF) + b * n
    p_vb = p_v + b * n
    p_pc = p_part + tl.load(row + PC_OFF) + (b * tiles_m + t_m) * n
    if ALIGN > 1:  # C_OFF and PC_OFF are multiples of 4 floats (the plan pads them)
        p_cb = tl.multiple_of(p_cb, 16)
        p_vb = tl.multiple_of(p_vb, 16)
        p_pc = tl.multiple_of(p_pc, 16)
    n_rows = tl.minimum(m - r0, BM).to(tl.int32)
    o_r = tl.arange(0, RB)[:, None]
    o_n = tl.arange(0, BLOCK_N)[None, :]
    m_n = o_n < n
    t_off = o_r * n32 + o_n  # in-trip offsets: BM * n < 2**31
    m_ld = m_n
    if EVEN_N:
        m_ld = o_r >= 0  # a constant-true [RB, 1] mask: no per-element column test
    cv = tl.load(p_cb + o_n, mask=m_ld, other=0.0) * tl.load(p_vb + o_n, mask=m_ld, other=0.0)
    acc = tl.zeros([RB, BLOCK_N], dtype=tl.float32)
    usq = tl.zeros([RB, 1], dtype=tl.float32)
    over = 0.0  # 1 where some row's d overflowed: the rows are redone below
    if PIPE == 0:
        g_next = tl.load(p_g + t_off, mask=(o_r < n_rows) & m_ld, other=0.0)
    for k in tl.range(0, tl.cdiv(n_rows, RB), num_stages=PIPE if PIPE > 0 else None):
        rows = k * RB + o_r
        m_r = rows < n_rows
        if PIPE == 0:
            b_g = g_next
            g_next = tl.load(p_g + (k + 1) * RB * n + t_off, mask=(rows + RB < n_rows) & m_ld, other=0.0)
        else:
            b_g = tl.load(p_g + k * RB * n + t_off, mask=m_r & m_ld, other=0.0)
        g = b_g.to(tl.float32)
        d = tl.sum(g * cv, axis=1, keep_dims=True)
        over = tl.maximum(over, tl.max(tl.where(tl.abs(d) < float("inf"), 0.0, 1.0)))  # inf or NaN
        r = tl.load(p_rb + rows, mask=m_r, other=0.0)
        u = r * d  # (X v)_i; r_i (r_i d_i) would overflow for a huge r_i, r_i u_i does not
        usq += u * u
        acc += g * (r * u)
    if over > 0.0:
        # Rare: G's entries so large that a row's sum overflowed fp32 (r is tiny there). The
        # program's rows again with r applied first: x = r G is X's row before c, bounded.
        # Out of the pipelined loop above: the common case pays one max per trip.
        acc = tl.zeros([RB, BLOCK_N], dtype=tl.float32)
        usq = tl.zeros([RB, 1], dtype=tl.float32)
        for k in range(0, tl.cdiv(n_rows, RB)):
            rows = k * RB + o_r
            m_r = rows < n_rows
            x = (tl.load(p_g + k * RB * n + t_off, mask=m_r & m_ld, other=0.0).to(tl.float32)
                 * tl.load(p_rb + rows, mask=m_r, other=0.0))
            u = tl.sum(x * cv, axis=1, keep_dims=True)
            usq += u * u
            acc += x * u
    tl.store(p_pc + o_n, tl.sum(acc, axis=0, keep_dims=True), mask=m_n)
    tl.store(p_upart + tl.load(row + U_OFF) + b * tiles_m + t_m, tl.sum(usq))


@triton.jit
def _sinkgd_power_tiles_kernel(p_meta, p_first, n_mats, p_gdt, p_r, p_c, p_part, p_cpart, p_upart,
                               AXIS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PART_TILE: tl.constexpr,
                               ALIGN: tl.constexpr):
    """The power pass of rows wider than max_fused_n, over [BM, BN] tiles in two launches, on
    x_ij = r_i G_ij (r applied first: finite sums for any finite G). AXIS=0: row partials
    sum_j x_ij (c_j v_j) of PART_TILE-wide tiles (p_part, the two-pass path's row partial
    layout). AXIS=1: each program sums its rows' partials in a fixed order into u_i, writes the
    tile's column terms x_ij u_i as column partials (p_cpart: PC_OFF, N_PC) and, for its first
    column tile, its rows' |u|^2 partial (U_OFF)."""
    mat, local, row = _program_matrix(p_meta, p_first, n_mats)
    m = tl.load(row + M)
    n = tl.load(row + N)
    p_g = tl.load(row + G_PTR).to(tl.pointer_type(p_gdt.dtype.element_ty))
    n32 = n.to(tl.int32)
    if ALIGN > 1:  # hints on values defined here: one passed through a helper loses them
        n = tl.multiple_of(n, ALIGN)
        n32 = tl.multiple_of(n32, ALIGN)
        p_g = tl.multiple_of(p_g, 16)
    b, t_m, t_n = _tile_coords(local, m, n, BM, BN)
    tiles_m = tl.cdiv(m, BM)
    o_m = t_m * BM + tl.arange(0, BM)
    o_n = t_n * BN + tl.arange(0, BN)
    m_m = o_m < m
    m_n = o_n < n
    t_off = tl.arange(0, BM)[:, None] * n32 + tl.arange(0, BN)[None, :]  # 32-bit: BM * n < 2**31
    b_g = tl.load(p_g + (b * m + t_m * BM) * n + t_n * BN + t_off,
                  mask=m_m[:, None] & m_n[None, :], other=0.0).to(tl.float32)
    p_pr = p_part + tl.load(row + PR_OFF)
    # x = r G, X's rows before c: bounded where G's entries are near the fp32 maximum (r tiny),
    # so the sums below stay finite (G (c v) itself overflows there)
    b_x = b_g * tl.load(p_r + tl.load(row + R_OFF) + b * m + o_m, mask=m_m, other=0.0)[:, None]
    if AXIS == 0:
        p_v = tl.load(row + V_PTR).to(tl.pointer_type(tl.float32))
        cv = (tl.load(p_c + tl.load(row + C_OFF) + b * n + o_n, mask=m_n, other=0.0)
              * tl.load(p_v + b * n + o_n, mask=m_n, other=0.0))
        s = tl.sum(b_x * cv[None, :], axis=1)
        tl.store(p_pr + (b * tl.cdiv(n, BN) + t_n) * m + o_m, s, mask=m_m)
    else:
        n_pr = tl.cdiv(n, PART_TILE)
        u = tl.zeros([BM], dtype=tl.float32)
        for k in range(0, n_pr):
            u += tl.load(p_pr + (b * n_pr + k) * m + o_m, mask=m_m, other=0.0)
        col = tl.sum(b_x * u[:, None], axis=0)
        tl.store(p_cpart + tl.load(row + PC_OFF) + (b * tiles_m + t_m) * n + o_n, col, mask=m_n)
        tl.store(p_upart + tl.load(row + U_OFF) + b * tiles_m + t_m, tl.sum(u * u), mask=t_n == 0)


@triton.jit
def _sinkgd_colsum_kernel(p_meta, p_first, n_mats, p_part, p_upart, p_sums,
                          WITH_U: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr):
    """Sharded rows (optim/sharded.py): a rank's column sums, finished over its N_PC column
    partials in a fixed order, into the sums buffer at S_OFF [B, n] (and with WITH_U, the
    block-0 program's |u|^2 sum of the N_PC |u|^2 partials at SU_OFF [B]), for the all-reduce
    that the column scale (SUMMED) or _sinkgd_power_cols_kernel (SUMMED) then reads. A rank
    with no rows of a matrix (N_PC = 0) writes zeros."""
    mat, local, row = _program_matrix(p_meta, p_first, n_mats)
    n = tl.load(row + N)
    n_parts = tl.load(row + N_PC)
    b, blk, blocks, o, msk = _column_block(local, n, BLOCK)
    p_p = p_part + tl.load(row + PC_OFF) + b * n_parts * n
    p_u = p_upart + tl.load(row + U_OFF) + b * n_parts
    s, su = _sum_partials(p_p, p_u, n_parts, n, o, msk, WITH_U, BLOCK, PARTS)
    tl.store(p_sums + tl.load(row + S_OFF) + b * n + o, s, mask=msk)
    if WITH_U:
        tl.store(p_sums + tl.load(row + SU_OFF) + b, su, mask=blk == 0)


@triton.jit
def _sinkgd_power_cols_kernel(p_meta, p_first, n_mats, p_c, p_part, p_upart, p_wpart, eps,
                              BLOCK: tl.constexpr, PARTS: tl.constexpr, SUMMED: tl.constexpr):
    """w_j = c_j sum(column partials of j) / max(|u|, eps) for BLOCK columns of one batch entry
    (|u|^2 from the N_PC |u|^2 partials), written into the warm-start vector v, plus the
    block's sum of w_j^2 (WQ_OFF). Every sum in a fixed order: deterministic. SUMMED (sharded
    rows): p_part and p_upart are the sums buffer, one finished sum per column at S_OFF and
    one |u|^2 at SU_OFF."""
    mat, local, row = _program_matrix(p_meta, p_first, n_mats)
    n = tl.load(row + N)
    b, blk, blocks, o, msk = _column_block(local, n, BLOCK)
    if SUMMED:
        n_parts = 1
        p_p = p_part + tl.load(row + S_OFF) + b * n
        p_u = p_upart + tl.load(row + SU_OFF) + b
    else:
        n_parts = tl.load(row + N_PC)
        p_p = p_part + tl.load(row + PC_OFF) + b * n_parts * n
        p_u = p_upart + tl.load(row + U_OFF) + b * n_parts
    s, su = _sum_partials(p_p, p_u, n_parts, n, o, msk, True, BLOCK, PARTS)
    u_norm = tl.maximum(tl.sqrt(su), eps)
    c = tl.load(p_c + tl.load(row + C_OFF) + b * n + o, mask=msk, other=0.0)
    w = c * s / u_norm
    p_v = tl.load(row + V_PTR).to(tl.pointer_type(tl.float32))
    tl.store(p_v + b * n + o, w, mask=msk)
    tl.store(p_wpart + tl.load(row + WQ_OFF) + b * blocks + blk, tl.sum(tl.where(msk, w * w, 0.0)))


@triton.jit
def _sinkgd_power_norm_kernel(p_meta, p_first, n_mats, p_wpart, p_spec, eps,
                              MUON: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr):
    """sigma = |w| from the |w|^2 partials of one batch entry (fixed order), v <- w / sigma for
    BLOCK columns, and (the entry's first block) the spectral scale target / max(sigma, eps) into
    spec[COEF_OFF + b]; target = 1, or sqrt(m / n) with MUON (m: the whole matrix's, MG). Where
    sigma = 0 (X v = 0: a zero gradient), v <- the restart vector cos(0.5 + 2.399963 j) and the
    scale is 0, as reference.spectral_vector_and_scale."""
    mat, local, row = _program_matrix(p_meta, p_first, n_mats)
    m = tl.load(row + MG)
    n = tl.load(row + N)
    b, blk, blocks, o, msk = _column_block(local, n, BLOCK)
    o_k = tl.arange(0, PARTS)
    acc = tl.zeros([PARTS], dtype=tl.float32)
    p_w = p_wpart + tl.load(row + WQ_OFF) + b * blocks
    for k in range(0, blocks, PARTS):
        ks = k + o_k
        acc += tl.load(p_w + ks, mask=ks < blocks, other=0.0)
    s = tl.sqrt(tl.sum(acc))
    live = s > 0.0
    p_v = tl.load(row + V_PTR).to(tl.pointer_type(tl.float32)) + b * n + o
    restart = tl.cos(0.5 + 2.399963 * o.to(tl.float32))
    tl.store(p_v, tl.where(live, tl.load(p_v, mask=msk, other=0.0) / tl.where(live, s, 1.0), restart), mask=msk)
    if MUON:
        target = tl.sqrt(m.to(tl.float32) / n.to(tl.float32))
    else:
        target = 1.0
    scale = tl.where(live, target / tl.maximum(s, eps), 0.0)
    tl.store(p_spec + tl.load(row + COEF_OFF) + b, scale, mask=blk == 0)


@triton.jit
def _sinkgd_update_kernel(p_meta, p_first, n_mats, p_gdt, p_wdt, p_r, p_c, p_lr, p_fac, p_spec, wd, p_seed,
                          STOCHASTIC: tl.constexpr, HAS_SPEC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          ALIGN: tl.constexpr):
    """coef_x = lr * fac[COEF_OFF + b] (* spec[COEF_OFF + b], the spectral scale), coef_w =
    lr * fac[COEF_OFF + b] * wd: lr is a device scalar, fac the cached lr factors (one per
    batch entry: the matrix's factor repeated)."""
    mat, local, row = _program_matrix(p_meta, p_first, n_mats)
    m = tl.load(row + M)
    n = tl.load(row + N)
    p_g = tl.load(row + G_PTR).to(tl.pointer_type(p_gdt.dtype.element_ty))
    p_w = tl.load(row + W_PTR).to(tl.pointer_type(p_wdt.dtype.element_ty))
    n32 = n.to(tl.int32)
    if ALIGN > 1:  # hints on values defined here: one passed through a helper loses them
        n = tl.multiple_of(n, ALIGN)
        n32 = tl.multiple_of(n32, ALIGN)
        p_g = tl.multiple_of(p_g, 16)
        p_w = tl.multiple_of(p_w, 16)
    b, t_m, t_n = _tile_coords(local, m, n, BM, BN)
    o_m = t_m * BM + tl.arange(0, BM)
    o_n = t_n * BN + tl.arange(0, BN)
    m_m = o_m < m
    m_n = o_n < n
    msk = m_m[:, None] & m_n[None, :]
    base = (b * m + t_m * BM) * n + t_n * BN  # the tile's first element (scalar)
    t_off = tl.arange(0, BM)[:, None] * n32 + tl.arange(0, BN)[None, :]  # 32-bit: BM * n < 2**31
    p_g += base
    p_w += base
    b_g = tl.load(p_g + t_off, mask=msk, other=0.0).to(tl.float32)
    b_w = tl.load(p_w + t_off, mask=msk, other=0.0).to(tl.float32)
    b_r = tl.load(p_r + tl.load(row + R_OFF) + b * m + o_m, mask=m_m, other=0.0)
    p_cb = p_c + tl.load(row + C_OFF) + b * n
    if ALIGN > 1:  # C_OFF is a multiple of 4 floats (the plan pads it)
        p_cb = tl.multiple_of(p_cb, 16)
    b_c = tl.load(p_cb + o_n, mask=m_n, other=0.0)
    lr = tl.load(p_lr).to(tl.float32)
    i_coef = tl.load(row + COEF_OFF) + b
    coef_x = lr * tl.load(p_fac + i_coef)
    if HAS_SPEC:
        coef_x = coef_x * tl.load(p_spec + i_coef)
    coef_w = lr * tl.load(p_fac + i_coef) * wd  # the matrix's lr factor (every entry of it holds it)
    new = b_w - coef_x * (b_g * b_r[:, None] * b_c[None, :]) - coef_w * b_w
    if STOCHASTIC:
        # bf16 stochastic rounding: add 16 random bits below bf16's mantissa, then truncate.
        # seed: the optimizer's step counter (a device scalar: no sync, no recompile), salted by
        # the matrix's index (SALT). Non-finite values are left to round to nearest.
        # the noise of an element is keyed by its index e in the whole parameter: a row shard
        # (MG > m rows, EOFF) draws the bits its elements get in the unsharded step. One
        # Philox call (counter e >> 3) gives four 32-bit words, the bits of eight elements:
        # element e takes word (e >> 1) & 3, its low half for even e, its high half for odd
        # (optim/sharded.py::sr_noise, the same bits in PyTorch).
        seed = tl.load(p_seed).to(tl.int32) * SR_SEED_STRIDE + tl.load(row + SALT).to(tl.int32)
        g_base = base + b * (tl.load(row + MG) - m) * n + tl.load(row + EOFF)
        if ALIGN % 8 == 0 and BN % 8 == 0:
            # n is a multiple of 8, so every row of the tile starts a group of eight: one call
            # per group, its words spread over the group's elements
            grp = (g_base // 8 + tl.arange(0, BM)[:, None] * (n32 // 8)
                   + tl.arange(0, BN // 8)[None, :]).to(tl.uint32)
            w0, w1, w2, w3 = tl.randint4x(seed, grp)
            words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BM, BN // 8, 4])
            noise = tl.reshape(tl.join(words & 0xFFFF, words >> 16), [BM, BN]).to(tl.uint32)
        else:
            e = g_base + t_off
            w0, w1, w2, w3 = tl.randint4x(seed, (e >> 3).to(tl.uint32))
            sel = (e >> 1) & 3
            word = tl.where(sel == 0, w0, tl.where(sel == 1, w1, tl.where(sel == 2, w2, w3)))
            noise = tl.where((e & 1) == 0, word & 0xFFFF, word >> 16).to(tl.uint32)
        bits = new.to(tl.uint32, bitcast=True)
        rounded = ((bits + noise) & 0xFFFF0000).to(tl.float32, bitcast=True)
        fin = (new == new) & (tl.abs(new) < float("inf"))
        new = tl.where(fin, rounded, new)
    tl.store(p_w + t_off, new.to(p_wdt.dtype.element_ty), mask=msk)


def compile_cases():
    """(name, kernel, signature, constexprs, warps) for tests/test_kernels_compile.py."""
    t = tiles()
    rows = {"p_meta": "*i64", "p_first": "*i64", "n_mats": "i32", "p_gdt": "*bf16", "p_r": "*fp32",
            "p_c": "*fp32", "p_part": "*fp32", "eps": "fp32"}
    for n in (768, 4096, 14336):
        block_n, rb, bm, w = rows_config(n)
        for ones in (False, True):
            yield (f"sinkgd_rows n={n} ones={ones}", _sinkgd_rows_kernel, rows,
                   {"ONES_R": ones, "ONES_C": ones, "BLOCK_N": block_n, "RB": rb, "BM": bm, "ALIGN": 8,
                    "EVEN_N": n == block_n, "PIPE": rows_pipe(block_n, rb, 2)}, w)
    sums = dict(rows)
    del sums["eps"]
    for axis, (bm, bn, w) in ((0, t.row_tile), (1, t.col_tile)):
        for ones in (False, True):
            yield (f"sinkgd_sums axis={axis} ones={ones}", _sinkgd_sums_kernel, sums,
                   {"AXIS": axis, "BM": bm, "BN": bn, "ONES_R": ones and axis == 0, "ONES_C": ones,
                    "ALIGN": 8 if ones else 1}, w)
    scale = {"p_meta": "*i64", "p_first": "*i64", "n_mats": "i32", "p_vec": "*fp32", "p_part": "*fp32",
             "eps": "fp32"}
    for axis in (0, 1):
        for ones in (False, True):
            yield (f"sinkgd_scale axis={axis} ones={ones}", _sinkgd_scale_kernel, scale,
                   {"AXIS": axis, "PART_TILE": t.row_tile[1], "BLOCK": t.scale_block, "PARTS": t.scale_parts,
                    "ONES": ones, "SUMMED": False}, 4)
    yield ("sinkgd_scale axis=1 summed", _sinkgd_scale_kernel, scale,
           {"AXIS": 1, "PART_TILE": t.row_tile[1], "BLOCK": t.scale_block, "PARTS": t.scale_parts, "ONES": False,
            "SUMMED": True}, 4)
    for with_u in (False, True):
        yield (f"sinkgd_colsum with_u={with_u}", _sinkgd_colsum_kernel,
               {"p_meta": "*i64", "p_first": "*i64", "n_mats": "i32", "p_part": "*fp32", "p_upart": "*fp32",
                "p_sums": "*fp32"}, {"WITH_U": with_u, "BLOCK": t.scale_block, "PARTS": t.scale_parts}, 4)
    for n in (4096, 14336):
        block_n, rb, bm, w = rows_config(n)
        yield (f"sinkgd_power_rows n={n}", _sinkgd_power_rows_kernel, dict(sums, p_upart="*fp32"),
               {"BLOCK_N": block_n, "RB": rb, "BM": bm, "ALIGN": 8, "EVEN_N": True, "PIPE": rows_pipe(block_n, rb, 2)}, w)
    power_tiles = dict(sums, p_cpart="*fp32", p_upart="*fp32")
    for axis, (bm, bn, w) in ((0, t.row_tile), (1, t.col_tile)):
        yield (f"sinkgd_power_tiles axis={axis}", _sinkgd_power_tiles_kernel, power_tiles,
               {"AXIS": axis, "BM": bm, "BN": bn, "PART_TILE": t.row_tile[1], "ALIGN": 8}, w)
    for summed in (False, True):
        yield (f"sinkgd_power_cols summed={summed}", _sinkgd_power_cols_kernel,
               {"p_meta": "*i64", "p_first": "*i64", "n_mats": "i32", "p_c": "*fp32", "p_part": "*fp32",
                "p_upart": "*fp32", "p_wpart": "*fp32", "eps": "fp32"},
               {"BLOCK": t.scale_block, "PARTS": t.scale_parts, "SUMMED": summed}, 4)
    for muon in (False, True):
        yield (f"sinkgd_power_norm muon={muon}", _sinkgd_power_norm_kernel,
               {"p_meta": "*i64", "p_first": "*i64", "n_mats": "i32", "p_wpart": "*fp32", "p_spec": "*fp32",
                "eps": "fp32"}, {"MUON": muon, "BLOCK": t.scale_block, "PARTS": t.scale_parts}, 4)
    upd = {"p_meta": "*i64", "p_first": "*i64", "n_mats": "i32", "p_gdt": "*fp16", "p_wdt": "*bf16",
           "p_r": "*fp32", "p_c": "*fp32", "p_lr": "*fp32", "p_fac": "*fp32", "p_spec": "*fp32",
           "wd": "fp32", "p_seed": "*fp32"}
    for sr, align in ((False, 8), (True, 1), (True, 8)):  # SR: per-element and per-group noise
        yield (f"sinkgd_update sr={sr} align={align}", _sinkgd_update_kernel, upd,
               {"STOCHASTIC": sr, "HAS_SPEC": sr, "BM": t.upd_tile[0], "BN": t.upd_tile[1], "ALIGN": align},
               t.upd_tile[2])
