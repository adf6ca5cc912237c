"""Triton kernels of fused::sinkgd_step.

Every SR-Sinkhorn iteration is a diagonal scaling, X = diag(r) G diag(c), so the kernels carry
only the scale vectors r [B, m] and c [B, n], never a full-size temporary:

- ``_sinkgd_sums_kernel`` reads one [BM, BN] tile of G and writes the tile's partial sums of
  (r_i c_j G_ij)^2 along one axis into a small partials buffer (AXIS=0: row sums, one partial
  per column tile; AXIS=1: column sums, one partial per row tile). No atomics: every partial
  has its own slot, so results are bitwise reproducible.
- ``_sinkgd_scale_kernel`` sums a vector's partials in a fixed order and rescales it:
  v <- v * target / max(sqrt(sum), eps), clamped at 1e30 (see reference.sinkgd_scales).
- ``_sinkgd_update_kernel``: W <- W - coef_x[b] * r_i c_j G_ij - coef_w * W in fp32, stored in
  W's dtype, optionally with stochastic rounding to bf16.

An iteration is a row pass and a column pass over G (each needs the other's finished result, so
they cannot share a read), then the update reads G and W and writes W: 2L + 3 passes in all.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sinkgd_sums_kernel(
    p_g, p_r, p_c, p_part, m, n, s_gb, s_gm,
    AXIS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    o_m = pid_m * BM + tl.arange(0, BM)
    o_n = pid_n * BN + tl.arange(0, BN)
    m_m = o_m < m
    m_n = o_n < n
    p_tile = p_g + b * s_gb + o_m.to(tl.int64)[:, None] * s_gm + o_n[None, :]
    b_g = tl.load(p_tile, mask=m_m[:, None] & m_n[None, :], other=0.0).to(tl.float32)
    b_r = tl.load(p_r + b * m + o_m, mask=m_m, other=0.0)
    b_c = tl.load(p_c + b * n + o_n, mask=m_n, other=0.0)
    b_x = b_g * b_r[:, None] * b_c[None, :]
    b_x2 = b_x * b_x
    if AXIS == 0:  # row sums: partials [B, n_tiles_n, m]
        s = tl.sum(b_x2, axis=1)
        tl.store(p_part + (b * tl.num_programs(1) + pid_n) * m + o_m, s, mask=m_m)
    else:  # column sums: partials [B, n_tiles_m, n]
        s = tl.sum(b_x2, axis=0)
        tl.store(p_part + (b * tl.num_programs(0) + pid_m) * n + o_n, s, mask=m_n)


@triton.jit
def _sinkgd_scale_kernel(p_part, p_vec, length, n_parts, target, eps, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    o = pid * BLOCK + tl.arange(0, BLOCK)
    msk = o < length
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, n_parts):  # fixed order: deterministic
        acc += tl.load(p_part + (b * n_parts + k) * length + o, mask=msk, other=0.0)
    v = tl.load(p_vec + b * length + o, mask=msk, other=0.0)
    v = v * target / tl.maximum(tl.sqrt(acc), eps)
    tl.store(p_vec + b * length + o, tl.minimum(v, 1e30), mask=msk)


@triton.jit
def _sinkgd_update_kernel(
    p_w, p_g, p_r, p_c, p_coef_x, p_coef_w, m, n, s_gb, s_gm, s_wb, s_wm, p_seed, salt,
    STOCHASTIC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    o_m = pid_m * BM + tl.arange(0, BM)
    o_n = pid_n * BN + tl.arange(0, BN)
    m_m = o_m < m
    m_n = o_n < n
    msk = m_m[:, None] & m_n[None, :]
    o_m64 = o_m.to(tl.int64)
    p_gt = p_g + b * s_gb + o_m64[:, None] * s_gm + o_n[None, :]
    p_wt = p_w + b * s_wb + o_m64[:, None] * s_wm + o_n[None, :]
    b_g = tl.load(p_gt, mask=msk, other=0.0).to(tl.float32)
    b_w = tl.load(p_wt, mask=msk, other=0.0).to(tl.float32)
    b_r = tl.load(p_r + b * m + o_m, mask=m_m, other=0.0)
    b_c = tl.load(p_c + b * n + o_n, mask=m_n, other=0.0)
    coef_x = tl.load(p_coef_x + b)
    coef_w = tl.load(p_coef_w)
    new = b_w - coef_x * (b_g * b_r[:, None] * b_c[None, :]) - coef_w * b_w
    if STOCHASTIC:
        # bf16 stochastic rounding: add 16 random bits below bf16's mantissa, then truncate.
        # Non-finite values are left to round to nearest.
        # seed: the optimizer's step counter (a device scalar: no sync, no recompile), salted by
        # the parameter's index in the list
        seed = tl.load(p_seed).to(tl.int32) * 1000003 + salt
        offs = (b * m + o_m64)[:, None] * n + o_n[None, :]
        noise = (tl.randint(seed, offs.to(tl.uint32)) & 0xFFFF).to(tl.uint32)
        bits = new.to(tl.uint32, bitcast=True)
        rounded = ((bits + noise) & 0xFFFF0000).to(tl.float32, bitcast=True)
        fin = (new == new) & (tl.abs(new) < float("inf"))
        new = tl.where(fin, rounded, new)
    tl.store(p_wt, new.to(p_w.dtype.element_ty), mask=msk)


# tiles: the row pass reads wide tiles (few column partials per row), the column pass tall ones
ROW_TILE = (8, 1024, 4)  # BM, BN, warps
COL_TILE = (128, 64, 4)
UPD_TILE = (16, 256, 4)
SCALE_BLOCK = 1024


def compile_cases():
    """(name, kernel, signature, constexprs, warps) for tests/test_kernels_compile.py."""
    sums = {"p_g": "*bf16", "p_r": "*fp32", "p_c": "*fp32", "p_part": "*fp32", "m": "i32", "n": "i32",
            "s_gb": "i64", "s_gm": "i32"}
    for axis, (bm, bn, w) in ((0, ROW_TILE), (1, COL_TILE)):
        yield (f"sinkgd_sums axis={axis}", _sinkgd_sums_kernel, sums, {"AXIS": axis, "BM": bm, "BN": bn}, w)
    scale = {"p_part": "*fp32", "p_vec": "*fp32", "length": "i32", "n_parts": "i32", "target": "fp32", "eps": "fp32"}
    yield ("sinkgd_scale", _sinkgd_scale_kernel, scale, {"BLOCK": SCALE_BLOCK}, 4)
    upd = {"p_w": "*bf16", "p_g": "*bf16", "p_r": "*fp32", "p_c": "*fp32", "p_coef_x": "*fp32", "p_coef_w": "*fp32",
           "m": "i32", "n": "i32", "s_gb": "i64", "s_gm": "i32", "s_wb": "i64", "s_wm": "i32", "p_seed": "*fp32",
           "salt": "i32"}
    for sr in (False, True):
        yield (f"sinkgd_update sr={sr}", _sinkgd_update_kernel, upd,
               {"STOCHASTIC": sr, "BM": UPD_TILE[0], "BN": UPD_TILE[1]}, UPD_TILE[2])
