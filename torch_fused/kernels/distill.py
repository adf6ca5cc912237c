"""Triton kernels of the distillation ops (ops/distill.py): three row passes over both models'
logits, one program per row.

Conventions and numerics as kernels/logprobs.py: ``p_`` pointers, ``b_`` blocks, int64 row
offsets; base 2 with c = log2(e) k per model (k = logit_scale / T); a row's statistics are its max
m and log2 s with s = sum 2^d, d = x c - m c (one fma against the rounded shift on the GPU, exact
in the interpreter), so log2 p = d - log2 s. A row may start anywhere (two (size, stride) pairs
for its leading dims), so strided logits run without a copy; the two models' rows may have
different dtypes and layouts.

1. _distill_stats_kernel: both models' (m, log2 s) and the student's entropy, one streaming pass
   over each row (the log-prob forward's _row_statistics).
2. _distill_divergence_kernel: the divergence (nats) and the backward's per-row ``aux``
   (KL(s || t) for beta 1, KL(s || m) for the JSD), from the statistics: one pass over both rows.
3. _distill_grad_kernel: d (w_r D_r) / d x_s, written once in the output's dtype (w_r: the
   upstream gradient of the row, or the reduced loss's weight); with WITH_DIV (beta 0, whose
   gradient p_s - p_t needs no aux) also the divergence, so the reduced head's forward makes both
   in one pass; with HAS_CAP the rows hold softcapped logits x = c tanh(.) and the chain factor
   1 - (x / c)^2 is applied.

A row whose label is ignore_index is skipped by passes 2 and 3 (zero divergence, zero gradient
row) and by pass 1 where no entropy is wanted (zero statistics). Masked lanes load -inf: zero
probability, which contributes 0 to every sum (terms are guarded by p > 0, never 0 * inf).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .._library import exact_shift, n_sm
from ..settings import current as settings
from .logprobs import LN2, _row_base, _row_statistics, _shifted


def mode(beta: float) -> int:
    """0: KL(teacher || student), 1: KL(student || teacher), 2: the generalized JSD."""
    return 0 if beta == 0.0 else 1 if beta == 1.0 else 2


def mixture_logs(beta: float) -> tuple[float, float]:
    """(log2(1 - beta), log2(beta)): the mixture's weights in base 2 (JSD only)."""
    if mode(beta) != 2:
        return 0.0, 0.0
    return math.log2(1.0 - beta), math.log2(beta)


def exact(cs: float, ct: float) -> bool:
    """EXACT_SHIFT for both models' rows (one flag: a pass forms each shift the same way)."""
    return exact_shift(cs) or exact_shift(ct)


# (BLOCK_V, num_warps) per pass: the statistics pass takes the log-prob forward's [NR, EPT] tiles;
# the divergence and gradient passes 1-D blocks of 8 columns a thread
_CONFIGS = {"stats": (1024, 2), "div": (1024, 4), "grad": (1024, 4)}


def pick_block(v: int, kind: str) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for rows of v columns; the small_tiles setting (the interpreter run)
    takes blocks of 16 so that small rows still run full blocks and a masked tail."""
    if settings.small_tiles:
        return 16, 1
    block, warps = _CONFIGS[kind]
    block = min(block, triton.next_power_of_2(max(v, 16)))
    return block, min(warps, max(1, block // 256))


@triton.jit
def _distill_stats_kernel(
    p_s, p_t, p_lab, p_stats, p_ent, p_part,
    V, s_inner, s_outer, s_stride, t_inner, t_outer, t_stride,
    c_s, c_t, ignore_index, segs, seg_len,
    HAS_LABELS: tl.constexpr, HAS_ENT: tl.constexpr, SEGMENTED: tl.constexpr, EXACT_SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr, EPT_S: tl.constexpr, EPT_T: tl.constexpr,
):
    """stats[row] = (m_s, log2 s_s, m_t, log2 s_t, .) and the student's entropy
    (log2 s - sum 2^d d / s) ln2. SEGMENTED: program pid takes columns seg * seg_len .. of row
    pid // segs (seg = pid % segs) and stores that segment's (m_s, s_s, t_s, m_t, s_t) at
    part[pid], which the host merges (ops/distill.py)."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // segs
    c0 = (pid % segs) * seg_len
    v_seg = tl.minimum(V - c0, seg_len).to(tl.int32)
    c_s = tl.cast(c_s, tl.float32)
    c_t = tl.cast(c_t, tl.float32)
    live = True
    if HAS_LABELS:
        if not HAS_ENT:  # the entropy is made for every row; without it ignored rows are skipped
            live = tl.load(p_lab + row) != ignore_index
    if live:
        m_s, s_s, t_s = _row_statistics(_row_base(p_s, row, s_inner, s_outer, s_stride) + c0, v_seg, c_s, 0.0,
                                        HAS_ENT, EXACT_SHIFT, False, BLOCK_V, EPT_S)
        m_t, s_t, _ = _row_statistics(_row_base(p_t, row, t_inner, t_outer, t_stride) + c0, v_seg, c_t, 0.0, False,
                                      EXACT_SHIFT, False, BLOCK_V, EPT_T)
        if SEGMENTED:
            tl.store(p_part + pid * 5, m_s)
            tl.store(p_part + pid * 5 + 1, s_s)
            tl.store(p_part + pid * 5 + 2, t_s)
            tl.store(p_part + pid * 5 + 3, m_t)
            tl.store(p_part + pid * 5 + 4, s_t)
        else:
            l_s = tl.log2(s_s)
            tl.store(p_stats + row * 5, m_s)
            tl.store(p_stats + row * 5 + 1, l_s)
            tl.store(p_stats + row * 5 + 2, m_t)
            tl.store(p_stats + row * 5 + 3, tl.log2(s_t))
            if HAS_ENT:
                tl.store(p_ent + row, (l_s - t_s / s_s) * LN2)
    else:
        if SEGMENTED:
            for j in tl.static_range(5):
                tl.store(p_part + pid * 5 + j, 0.0)
        else:
            for j in tl.static_range(4):
                tl.store(p_stats + row * 5 + j, 0.0)


@triton.jit
def _log2_probs(p_srow, p_trow, o, mask, m_s, l_s, m_t, l_t, c_s, c_t, EXACT_SHIFT: tl.constexpr):
    """(x_s, log2 p_s, log2 p_t) of one block of both rows (-inf at masked lanes)."""
    b_xs = tl.load(p_srow + o, mask=mask, other=float("-inf")).to(tl.float32)
    b_xt = tl.load(p_trow + o, mask=mask, other=float("-inf")).to(tl.float32)
    b_a = _shifted(b_xs, m_s, c_s, EXACT_SHIFT) - l_s
    b_b = _shifted(b_xt, m_t, c_t, EXACT_SHIFT) - l_t
    return b_xs, b_a, b_b


@triton.jit
def _log2_sum2(u, w):
    """log2(2^u + 2^w), the larger exponent taken out: no overflow, -inf where both are -inf."""
    hi = tl.maximum(u, w)
    lo = tl.minimum(u, w)
    return tl.where(hi == float("-inf"), float("-inf"), hi + tl.log2(1.0 + tl.exp2(lo - hi)))


@triton.jit
def _log2_ratios(b_a, b_b, lb_s, lb_t):
    """(log2(p_s / m), log2(p_t / m)) for the mixture m = (1 - beta) p_s + beta p_t (lb_s =
    log2(1 - beta), lb_t = log2 beta), from the difference delta = log2 p_t - log2 p_s alone:
    log2(p_s / m) = -log2((1 - beta) + beta 2^delta), log2(p_t / m) = -log2((1 - beta) 2^-delta + beta).
    Formed as log2 p - log2 m, both of size up to |log2 p| ~ 40, the difference would carry their
    rounding (~4e-6), which the JSD gradient p_s (ln(p_s / m) - KL(s || m)) magnifies where the two
    terms nearly cancel (disjoint supports: both near ln 2); from delta it is within a few ulps of 1.
    Lanes where p_s or p_t is 0 give +-inf or NaN, which every caller masks by p > 0."""
    b_dl = b_b - b_a
    return -_log2_sum2(lb_s, lb_t + b_dl), -_log2_sum2(lb_s - b_dl, lb_t)


@triton.jit
def _nan_lanes(b_a, b_b):
    """1 where either model's log2-probability is NaN (a NaN logit, or a row of -inf logits whose
    shift is -inf), else 0: the sums below mask their terms by p > 0, which would drop a NaN."""
    return tl.where((b_a != b_a) | (b_b != b_b), 1.0, 0.0)


@triton.jit
def _load_stats(p_stats, row):
    m_s = tl.load(p_stats + row * 5).to(tl.float32)
    l_s = tl.load(p_stats + row * 5 + 1).to(tl.float32)
    m_t = tl.load(p_stats + row * 5 + 2).to(tl.float32)
    l_t = tl.load(p_stats + row * 5 + 3).to(tl.float32)
    return m_s, l_s, m_t, l_t


@triton.jit
def _distill_divergence_kernel(
    p_s, p_t, p_lab, p_stats, p_div, p_aux, p_mass,
    V, s_inner, s_outer, s_stride, t_inner, t_outer, t_stride,
    c_s, c_t, beta, lb_s, lb_t, ignore_index, segs, seg_len, div_rs, aux_rs,
    HAS_LABELS: tl.constexpr, MODE: tl.constexpr, MASS: tl.constexpr, EXACT_SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The divergence (nats) of columns seg * seg_len .. of row pid // segs at
    p_div[row * div_rs + seg], and its aux at p_aux[row * aux_rs + seg] (mode 1: the divergence;
    mode 2: KL(s || m); mode 0: 0): with one segment the row's own (the host points p_aux at the
    statistics' fifth column), else partial sums the host adds up.

    MASS (modes 1 and 2) takes the student's side as a ratio sum p_s u / sum p_s over the row:
    the p_s = 2^(d - log2 s) of these passes sum to 1 only up to the rounding of log2 s and of
    each 2^, and the backward's p_s (u - aux) magnifies a relative error e of the mass into e aux /
    (u - aux) where u and aux nearly cancel (a JSD over nearly disjoint supports: both near ln 2);
    with aux a ratio over the same p_s the row's gradient sums to 0 and that term is gone.
    MASS 1: one segment, the division here; MASS 2: the segment's sum p_s at p_mass[row * aux_rs
    + seg] and aux, div left as sums, which the host divides (ops/distill.py _finish_partials);
    MASS 0: plain sums (vocabulary slices, whose mass is a sum over ranks)."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // segs
    seg = pid % segs
    c0 = seg * seg_len
    v_seg = tl.minimum(V - c0, seg_len).to(tl.int32)
    c_s = tl.cast(c_s, tl.float32)
    c_t = tl.cast(c_t, tl.float32)
    beta = tl.cast(beta, tl.float32)
    lb_s = tl.cast(lb_s, tl.float32)
    lb_t = tl.cast(lb_t, tl.float32)
    live = True
    if HAS_LABELS:
        live = tl.load(p_lab + row) != ignore_index
    div = 0.0
    aux = 0.0
    if live:
        m_s, l_s, m_t, l_t = _load_stats(p_stats, row)
        p_srow = _row_base(p_s, row, s_inner, s_outer, s_stride) + c0
        p_trow = _row_base(p_t, row, t_inner, t_outer, t_stride) + c0
        o_v = tl.arange(0, BLOCK_V)
        acc_d = tl.zeros([BLOCK_V], dtype=tl.float32)
        acc_a = tl.zeros([BLOCK_V], dtype=tl.float32)
        acc_p = tl.zeros([BLOCK_V], dtype=tl.float32)
        acc_nan = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, v_seg, BLOCK_V):
            o = start + o_v
            _, b_a, b_b = _log2_probs(p_srow, p_trow, o, o < v_seg, m_s, l_s, m_t, l_t, c_s, c_t, EXACT_SHIFT)
            b_pa = tl.exp2(b_a)
            b_pb = tl.exp2(b_b)
            acc_nan += _nan_lanes(b_a, b_b)
            if MASS != 0:
                acc_p += b_pa
            if MODE == 0:
                acc_d += tl.where(b_pb > 0.0, b_pb * (b_b - b_a), 0.0)
            elif MODE == 1:
                acc_d += tl.where(b_pa > 0.0, b_pa * (b_a - b_b), 0.0)
            else:
                b_rs, b_rt = _log2_ratios(b_a, b_b, lb_s, lb_t)
                acc_a += tl.where(b_pa > 0.0, b_pa * b_rs, 0.0)
                acc_d += tl.where(b_pb > 0.0, b_pb * b_rt, 0.0)
        mass = 1.0
        if MASS != 0:
            mass = tl.sum(acc_p, axis=0)
        if MODE == 0:
            div = tl.sum(acc_d, axis=0) * LN2
        elif MODE == 1:
            aux = tl.sum(acc_d, axis=0) * LN2
            if MASS == 1:
                aux = aux / tl.where(mass > 0.0, mass, 1.0)
            div = aux
        else:
            aux = tl.sum(acc_a, axis=0) * LN2
            if MASS == 1:
                aux = aux / tl.where(mass > 0.0, mass, 1.0)
            div = beta * (tl.sum(acc_d, axis=0) * LN2) + (1.0 - beta) * aux
        if tl.sum(acc_nan, axis=0) > 0.0:  # a NaN logit (or a row of -inf): the row's results are NaN
            div = float("nan")
            aux = float("nan")
        if MASS == 2:
            tl.store(p_mass + row * aux_rs + seg, mass)
    elif MASS == 2:
        tl.store(p_mass + row * aux_rs + seg, 0.0)
    tl.store(p_div + row * div_rs + seg, div)
    tl.store(p_aux + row * aux_rs + seg, aux)


@triton.jit
def _distill_grad_kernel(
    p_s, p_t, p_lab, p_stats, p_w, p_dx, p_div, p_aux,
    V, s_inner, s_outer, s_stride, t_inner, t_outer, t_stride, d_inner, d_outer, d_stride,
    c_s, c_t, k, cap, beta, lb_s, lb_t, ignore_index, w_stride, segs, seg_len, div_rs, aux_rs,
    HAS_LABELS: tl.constexpr, MODE: tl.constexpr, WITH_DIV: tl.constexpr, HAS_CAP: tl.constexpr,
    EXACT_SHIFT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """dx[row] = w k dD/dz (k = logit_scale / T; times 1 - (x / cap)^2 with HAS_CAP), in dx's
    dtype, for columns seg * seg_len .. of row pid // segs. With WITH_DIV (mode 0): also the
    segment's divergence and a zero aux, stored as the divergence kernel stores them."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // segs
    seg = pid % segs
    c0 = seg * seg_len
    v_seg = tl.minimum(V - c0, seg_len).to(tl.int32)
    c_s = tl.cast(c_s, tl.float32)
    c_t = tl.cast(c_t, tl.float32)
    k = tl.cast(k, tl.float32)
    cap = tl.cast(cap, tl.float32)
    beta = tl.cast(beta, tl.float32)
    lb_s = tl.cast(lb_s, tl.float32)
    lb_t = tl.cast(lb_t, tl.float32)
    p_drow = _row_base(p_dx, row, d_inner, d_outer, d_stride) + c0
    o_v = tl.arange(0, BLOCK_V)
    live = True
    if HAS_LABELS:
        live = tl.load(p_lab + row) != ignore_index
    div = 0.0
    if live:
        m_s, l_s, m_t, l_t = _load_stats(p_stats, row)
        aux = tl.load(p_stats + row * 5 + 4).to(tl.float32)
        wk = tl.load(p_w + row * w_stride).to(tl.float32) * k
        p_srow = _row_base(p_s, row, s_inner, s_outer, s_stride) + c0
        p_trow = _row_base(p_t, row, t_inner, t_outer, t_stride) + c0
        acc_d = tl.zeros([BLOCK_V], dtype=tl.float32)
        acc_nan = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, v_seg, BLOCK_V):
            o = start + o_v
            mask = o < v_seg
            b_xs, b_a, b_b = _log2_probs(p_srow, p_trow, o, mask, m_s, l_s, m_t, l_t, c_s, c_t, EXACT_SHIFT)
            b_pa = tl.exp2(b_a)
            if MODE == 0:
                b_pb = tl.exp2(b_b)
                b_dz = b_pa - b_pb
                if WITH_DIV:
                    acc_d += tl.where(b_pb > 0.0, b_pb * (b_b - b_a), 0.0)
                    acc_nan += _nan_lanes(b_a, b_b)
            elif MODE == 1:
                b_dz = tl.where(b_pa > 0.0, b_pa * ((b_a - b_b) * LN2 - aux), 0.0)
            else:
                b_rs, _ = _log2_ratios(b_a, b_b, lb_s, lb_t)
                b_dz = (1.0 - beta) * tl.where(b_pa > 0.0, b_pa * (b_rs * LN2 - aux), 0.0)
            if MODE != 0:  # a NaN row (its aux NaN, the divergence kernel's flag): NaN, not masked to 0
                b_dz = tl.where(aux != aux, float("nan"), b_dz)
            b_dx = b_dz * wk
            if HAS_CAP:
                b_th = b_xs / cap
                b_dx = b_dx * (1.0 - b_th * b_th)
            tl.store(p_drow + o, b_dx.to(p_drow.dtype.element_ty), mask=mask)
        if WITH_DIV:
            div = tl.sum(acc_d, axis=0) * LN2
            if tl.sum(acc_nan, axis=0) > 0.0:
                div = float("nan")
    else:
        b_z = tl.zeros([BLOCK_V], dtype=p_drow.dtype.element_ty)
        for start in range(0, v_seg, BLOCK_V):
            tl.store(p_drow + start + o_v, b_z, mask=start + o_v < v_seg)
    if WITH_DIV:
        tl.store(p_div + row * div_rs + seg, div)
        tl.store(p_aux + row * aux_rs + seg, 0.0)


def segments(n: int, v: int, block: int, device) -> tuple[int, int]:
    """(segs, seg_len) of a launch over n rows of v columns: one program per row where n rows
    fill the device (about 16 programs per multiprocessor), else each row split into up to v /
    the distill_segment setting's columns (0: never split), seg_len a multiple of block. The
    head's chunks of a few hundred rows of a 150k vocabulary would otherwise leave most of the
    device idle in these streaming passes."""
    seg_min = settings.distill_segment
    if seg_min <= 0 or v <= seg_min or n <= 0:
        return 1, max(v, 1)
    segs = min(triton.cdiv(16 * n_sm(device), n), triton.cdiv(v, seg_min))
    if segs <= 1:
        return 1, max(v, 1)
    seg_len = triton.cdiv(triton.cdiv(v, segs), block) * block
    return triton.cdiv(v, seg_len), seg_len


def compile_cases():
    """(name, kernel, signature, constexprs, warps) for tests/test_kernels_compile.py: every
    constexpr branch the launchers in ops/distill.py take."""
    lay = {"V": "i32", "s_inner": "i32", "s_outer": "i64", "s_stride": "i64", "t_inner": "i32", "t_outer": "i64",
           "t_stride": "i64"}
    seg = {"segs": "i32", "seg_len": "i32"}
    stats = dict({"p_s": "*bf16", "p_t": "*fp32", "p_lab": "*i64", "p_stats": "*fp32", "p_ent": "*fp32",
                  "p_part": "*fp32"}, **lay, c_s="fp32", c_t="fp32", ignore_index="i32", **seg)
    for labels, ent, segmented in [(True, True, False), (True, False, False), (False, True, True), (True, False, True)]:
        yield (f"distill_stats labels={labels} ent={ent} segmented={segmented}", _distill_stats_kernel, stats,
               {"HAS_LABELS": labels, "HAS_ENT": ent, "SEGMENTED": segmented, "EXACT_SHIFT": False, "BLOCK_V": 1024,
                "EPT_S": 8, "EPT_T": 4}, 2)
    div = dict({"p_s": "*fp32", "p_t": "*fp32", "p_lab": "*i64", "p_stats": "*fp32", "p_div": "*fp32",
                "p_aux": "*fp32", "p_mass": "*fp32"}, **lay, c_s="fp32", c_t="fp32", beta="fp32", lb_s="fp32", lb_t="fp32",
               ignore_index="i32", **seg, div_rs="i32", aux_rs="i32")
    for m, mass in ((0, 0), (1, 1), (2, 1), (2, 2), (1, 0)):
        yield (f"distill_divergence mode={m} mass={mass}", _distill_divergence_kernel, div,
               {"HAS_LABELS": True, "MODE": m, "MASS": mass, "EXACT_SHIFT": False, "BLOCK_V": 1024}, 4)
    grad = dict({"p_s": "*fp32", "p_t": "*fp32", "p_lab": "*i64", "p_stats": "*fp32", "p_w": "*fp32",
                 "p_dx": "*bf16", "p_div": "*fp32", "p_aux": "*fp32"}, **lay, d_inner="i32", d_outer="i64",
                d_stride="i64", c_s="fp32", c_t="fp32", k="fp32", cap="fp32", beta="fp32", lb_s="fp32", lb_t="fp32",
                ignore_index="i32", w_stride="i32", **seg, div_rs="i32", aux_rs="i32")
    for m, with_div, cap, labels in [(0, True, False, True), (0, False, True, False), (1, False, False, True),
                                     (2, False, True, True)]:
        yield (f"distill_grad mode={m} div={with_div} cap={cap} labels={labels}", _distill_grad_kernel, grad,
               {"HAS_LABELS": labels, "MODE": m, "WITH_DIV": with_div, "HAS_CAP": cap, "EXACT_SHIFT": False,
                "BLOCK_V": 1024}, 4)
    # the logits path: bf16 rows in, bf16 d logits out
    yield ("distill_grad bf16 logits", _distill_grad_kernel, dict(grad, p_s="*bf16", p_t="*bf16"),
           {"HAS_LABELS": False, "MODE": 2, "WITH_DIV": False, "HAS_CAP": False, "EXACT_SHIFT": False,
            "BLOCK_V": 1024}, 4)
