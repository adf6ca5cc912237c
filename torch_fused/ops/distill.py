"""Distillation: ``fused::distill`` (from logits) and ``fused::linear_distill`` (from hidden states
and heads): the per-token divergence between a student's and a teacher's next-token
distributions (TRL's definitions: beta 0 KL(teacher || student), 1 KL(student || teacher), between
them the generalized JSD), the student's entropy as a by-product, gradients to the student only.

Core ops (meta/distill.py: ``DistillOptions``, the checks and the fakes):

- ``fused::_distill_forward(student, teacher, labels, *options) -> (divergence, entropy, stats)``
  and ``fused::_distill_backward``: rows of both models' logits. Triton: per row, pass 1 over the
  vocabulary tiles makes both models' (max, log2 sum) and the student's entropy sum
  (kernels/distill.py, _distill_stats_kernel); pass 2 the divergence and the backward's per-row
  ``aux`` (_distill_divergence_kernel). The backward is one pass (_distill_grad_kernel) from the
  saved O(rows) statistics: d student logits written once, in their dtype. A reduced loss from
  logits is the per-token core plus a sum (the backward is one pass either way).
- ``fused::_linear_distill_forward`` / ``fused::_linear_distill_backward``: from both models'
  hidden states and heads, never holding either [N, V] logits. Chunks of token rows (the
  ``distill_chunk_bytes`` setting): per chunk both logits GEMMs with fp32 output, the row kernels
  on them; in the backward (or the reduced mode's forward) the d logits of a group of chunks
  (``distill_group_bytes``), in the student weight's dtype, go into d hidden = d z @ W_s (one GEMM
  per group) and d weight += d z^T @ h_s (an fp32 [V, H] accumulator where several groups add
  into it; one GEMM into d weight itself where one group covers every row). Reduction "none":
  the forward saves O(rows) statistics and the backward recomputes both projections; where its
  row groups would need the fp32 d weight accumulator, it runs over vocabulary chunks of every
  row instead (``vocab_plan``: d weight[v0:v1] one GEMM over all rows, no accumulator). "sum" and
  "token-mean": the forward computes the gradients (the loss's weights are known up front), keeps
  them in fp32 (d hidden [N, H], d weight [V, H], d bias [V]), and the backward only scales them by
  the upstream gradient: no GEMM is recomputed.
- A top-k teacher (``teacher_topk_ids``, ``teacher_topk_logprobs``) goes through the log-prob ops
  (``fused::_logprobs_entropy_forward`` from logits, ``fused::_linear_logprobs_entropy_forward``
  from the student's head) with the k ids, then an O(N k) formula (reference.distill_topk). On
  the fused head the k ids stay out of the GEMM epilogues (the ``lm_head_epilogue_ids``
  setting): their logits come from one dot product each, beside the GEMMs.

- Vocabulary slices (the vocabulary-parallel path, torch_fused/parallel_distill.py):
  ``fused::_distill_slice_forward`` / ``fused::_linear_distill_slice_forward`` run one of the two
  forward passes over a slice (the statistics alone; or the divergence and aux parts from the whole
  rows' statistics), ``fused::_linear_distill_slice_backward`` the head's backward with d hidden
  as fp32 rows still to be summed over the slices. A slice's logits backward is
  ``fused::_distill_backward`` itself, given the whole rows' statistics.

The public ops ``fused::distill`` and ``fused::linear_distill`` are ``CompositeImplicitAutograd``
over these, so torch.compile sees through them to the opaque core nodes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from .._library import (LIB, LN2, LOG2E, NAMESPACE, TRITON_DEVICES, acc_dtype, check_value, kernel_temperature,
                        new_output,
                        no_forward_mode, rows_strides, under_forward_settings)
from .. import reference
from ..meta import distill as meta
from ..meta.linear_logprobs import HeadOptions
from ..meta.logprobs import LogprobOptions, row_shape
from ..settings import current as settings
from . import logprobs as lp_ops
from .linear_logprobs import _addmm_f32_, _gemm_operands, _mm_f32

Options = meta.DistillOptions
_OPTS = Options.schema()


# ---------------------------------------------------------------------------------------------
# Row paths: the three row passes over [rows, V] views of both models' logits (one row per
# program on the Triton path, row chunks of torch ops on the reference path)
# ---------------------------------------------------------------------------------------------
def _keep(lab, ignore_index, n, device):
    return torch.ones(n, dtype=torch.bool, device=device) if lab is None else lab != ignore_index


def _stats_reference(xs, xt, lab, ignore_index, stats, ent, cs, ct):
    """stats[:, :4] and the entropy (ent: None where not wanted) of the rows xs, xt [n, V]; ignored
    rows get zero statistics where no entropy is wanted (the kernel skips them)."""
    n = xs.shape[0]
    for a, b in reference._chunks(n, 2 * xs.shape[1]):
        st, h = reference.distill_stats(xs[a:b], xt[a:b], cs, ct, ent is not None)
        if ent is None:
            st = torch.where(_keep(None if lab is None else lab[a:b], ignore_index, b - a, xs.device)[:, None], st,
                             torch.zeros_like(st))
        else:
            ent[a:b] = h.to(ent.dtype)
        stats[a:b, :4] = st.to(stats.dtype)


def _divergence_reference(xs, xt, lab, ignore_index, stats, div, beta, cs, ct, ratio=True):
    """div [n] and stats[:, 4] (aux) of the rows; 0 at ignored rows. float64 arithmetic with plain sums:
    ``ratio`` (the Triton path's mass ratio) is not applied here."""
    n = xs.shape[0]
    for a, b in reference._chunks(n, 2 * xs.shape[1]):
        d, aux = reference.distill_divergence(xs[a:b], xt[a:b], stats[a:b], beta, cs, ct)
        keep = _keep(None if lab is None else lab[a:b], ignore_index, b - a, xs.device)
        div[a:b] = torch.where(keep, d, torch.zeros_like(d)).to(div.dtype)
        stats[a:b, 4] = torch.where(keep, aux, torch.zeros_like(aux)).to(stats.dtype)


def _grad_reference(xs, xt, lab, ignore_index, stats, w, out, beta, cs, ct, k, softcap=None, div=None):
    """out [n, V] = d (w_r D_r) / d x_s (zero rows where ignored); w: [n] or one element for every
    row. ``div``: also the rows' divergence (mode 0, whose gradient needs no aux)."""
    n = xs.shape[0]
    if div is not None:
        _divergence_reference(xs, xt, lab, ignore_index, stats, div, beta, cs, ct)
    w = w.reshape(-1).expand(n) if w.numel() == 1 else w.reshape(n)
    for a, b in reference._chunks(n, 2 * xs.shape[1]):
        d = reference.distill_grad(xs[a:b], xt[a:b], stats[a:b], w[a:b], beta, cs, ct, k, softcap)
        keep = _keep(None if lab is None else lab[a:b], ignore_index, b - a, xs.device)
        out[a:b] = torch.where(keep[:, None], d, torch.zeros_like(d)).to(out.dtype)


def _layout(x):
    """(tensor to launch on, (inner, outer, stride)) of the rows of x [..., V]: x itself where its
    rows collapse to two strided dims with a contiguous V, else a contiguous copy."""
    lay = rows_strides(x) if x.stride(-1) == 1 else None
    if lay is None:
        x = x.contiguous()
        lay = rows_strides(x)
    return x, lay


def _stats_triton(xs, xt, lab, ignore_index, stats, ent, cs, ct):
    from ..kernels import distill as K

    (xs, ls), (xt, lt) = _layout(xs), _layout(xt)
    n, v = stats.shape[0], xs.shape[-1]
    block, warps = K.pick_block(v, "stats")
    segs, seg_len = K.segments(n, v, block, xs.device)
    exact = K.exact(cs, ct)
    part = torch.empty(n, segs, 5, dtype=torch.float32, device=xs.device) if segs > 1 else None
    K._distill_stats_kernel[(n * segs,)](
        xs, xt, lab, stats, ent, part, v, *ls, *lt, cs, ct, ignore_index, segs, seg_len,
        HAS_LABELS=lab is not None, HAS_ENT=ent is not None, SEGMENTED=part is not None, EXACT_SHIFT=exact,
        BLOCK_V=block, EPT_S=16 // xs.element_size(), EPT_T=16 // xt.element_size(), num_warps=warps)
    if part is None:
        return
    # the segments' (m, s, t) merged as the kernels merge tile rows (ops/logprobs.py merge_row_stats)
    m_s, s_s, t_s, _, _ = lp_ops.merge_row_stats(part[..., 0], part[..., 1], part[..., 2], cs, exact, 1)
    m_t, s_t, _, _, _ = lp_ops.merge_row_stats(part[..., 3], part[..., 4], torch.zeros_like(part[..., 4]), ct, exact, 1)
    l_s = torch.log2(s_s)
    st = torch.stack([m_s, l_s, m_t, torch.log2(s_t)], 1)
    if ent is not None:
        ent.copy_((l_s - t_s / s_s) * LN2)
    elif lab is not None:  # ignored rows were skipped: zero statistics, as on one segment
        st = torch.where((lab != ignore_index)[:, None], st, torch.zeros_like(st))
    stats[:, :4] = st


def _partial_sums(n, segs, div, stats, device, parts=2):
    """(div target, its row stride, aux target, its row stride, partial buffers or None): one
    segment writes div [n] and stats[:, 4] itself; several write [parts, n, segs] partials (the
    third, with ``parts=3``, the student's mass of each segment)."""
    if segs == 1:
        return div, 1, stats[:, 4], stats.stride(0), None
    part = torch.empty(parts, n, segs, dtype=torch.float32, device=device)
    return part[0], segs, part[1], segs, part


def _finish_partials(part, div, stats, beta=0.0):
    """The segments' sums added up; with a third part (the student's mass, modes 1 and 2), aux
    taken as the ratio sum p_s u / sum p_s and the divergence's student side with it."""
    if part is None:
        return
    d, a = part[0].sum(1), part[1].sum(1)
    if part.shape[0] == 3:
        mass = part[2].sum(1)
        a_ratio = torch.where(mass > 0, a / torch.where(mass > 0, mass, 1.0), a)
        d = a_ratio if beta == 1.0 else d + (1.0 - beta) * (a_ratio - a)
        a = a_ratio
    div.copy_(d)
    stats[:, 4] = a


def _divergence_triton(xs, xt, lab, ignore_index, stats, div, beta, cs, ct, ratio=True):
    """``ratio`` (modes 1 and 2): aux (and the divergence's student side) as a ratio over the
    student's own mass (kernels/distill.py _distill_divergence_kernel, MASS); False for a
    vocabulary slice, whose parts are plain sums added over the ranks."""
    from ..kernels import distill as K

    (xs, ls), (xt, lt) = _layout(xs), _layout(xt)
    n, v = stats.shape[0], xs.shape[-1]
    block, warps = K.pick_block(v, "div")
    segs, seg_len = K.segments(n, v, block, xs.device)
    lb_s, lb_t = K.mixture_logs(beta)
    mode = K.mode(beta)
    mass = 0 if not ratio or mode == 0 else 1 if segs == 1 else 2
    p_div, div_rs, p_aux, aux_rs, part = _partial_sums(n, segs, div, stats, xs.device, 3 if mass == 2 else 2)
    K._distill_divergence_kernel[(n * segs,)](
        xs, xt, lab, stats, p_div, p_aux, part[2] if mass == 2 else None, v, *ls, *lt, cs, ct, beta, lb_s, lb_t,
        ignore_index, segs, seg_len, div_rs, aux_rs, HAS_LABELS=lab is not None, MODE=mode, MASS=mass,
        EXACT_SHIFT=K.exact(cs, ct), BLOCK_V=block, num_warps=warps)
    _finish_partials(part, div, stats, beta)


def _grad_triton(xs, xt, lab, ignore_index, stats, w, out, beta, cs, ct, k, softcap=None, div=None):
    from ..kernels import distill as K

    (xs, ls), (xt, lt) = _layout(xs), _layout(xt)
    n, v = stats.shape[0], xs.shape[-1]
    lo = rows_strides(out)
    block, warps = K.pick_block(v, "grad")
    segs, seg_len = K.segments(n, v, block, xs.device)
    lb_s, lb_t = K.mixture_logs(beta)
    p_div = p_aux = part = None
    div_rs = aux_rs = 0
    if div is not None:
        p_div, div_rs, p_aux, aux_rs, part = _partial_sums(n, segs, div, stats, xs.device)
    K._distill_grad_kernel[(n * segs,)](
        xs, xt, lab, stats, w, out, p_div, p_aux, v, *ls, *lt, *lo, cs, ct, k, 1.0 if softcap is None else softcap,
        beta, lb_s, lb_t, ignore_index, 0 if w.numel() == 1 else w.stride(0), segs, seg_len, div_rs, aux_rs,
        HAS_LABELS=lab is not None, MODE=K.mode(beta), WITH_DIV=div is not None, HAS_CAP=softcap is not None,
        EXACT_SHIFT=K.exact(cs, ct), BLOCK_V=block, num_warps=warps)
    if div is not None:
        _finish_partials(part, div, stats)


@dataclasses.dataclass(frozen=True)
class Path:
    """The implementation a call runs: the Triton kernels or the PyTorch reference, as the three
    row passes (statistics, divergence, gradient)."""
    triton: bool
    stats: Callable
    divergence: Callable
    grad: Callable


REFERENCE = Path(False, _stats_reference, _divergence_reference, _grad_reference)
TRITON = Path(True, _stats_triton, _divergence_triton, _grad_triton)


def _path(path, *tensors):
    """float64 goes to the reference (a validation dtype: it keeps float64 accuracy)."""
    return REFERENCE if any(t.dtype == torch.float64 for t in tensors) else path


# ---------------------------------------------------------------------------------------------
# From logits
# ---------------------------------------------------------------------------------------------
def _logits_rows(x, shift):
    return x[..., :-1, :] if shift else x


def _labels_rows(labels, n):
    return None if labels is None else labels.reshape(n).contiguous()


def _logits_forward(student, teacher, labels, opts, path):
    meta.check_logits(student, teacher, labels, opts)
    path = _path(path, student, teacher)
    dt = acc_dtype(student.dtype)
    lead = row_shape(student, opts.shift)
    n = math.prod(lead)
    div = new_output(lead, dt, student.device)
    ent = new_output(lead if opts.compute_entropy else (0,), dt, student.device)
    stats = new_output(tuple(lead) + (meta.STATS,), dt, student.device)
    if n == 0:
        return div, ent, stats
    c, xs, xt, lab = _row_operands(student, teacher, labels, opts, n, path)
    st2 = stats.view(n, meta.STATS)
    path.stats(xs, xt, lab, opts.ignore_index, st2, ent.view(n) if opts.compute_entropy else None, c, c)
    path.divergence(xs, xt, lab, opts.ignore_index, st2, div.view(n), opts.beta, c, c)
    return div, ent, stats


def _logits_backward(grad_div, student, teacher, labels, stats, opts, path):
    meta.check_logits(student, teacher, labels, opts)
    path = _path(path, student, teacher)
    lead = row_shape(student, opts.shift)
    n = math.prod(lead)
    dx = new_output(student.shape, student.dtype, student.device)
    if opts.shift:
        dx[..., -1, :] = 0
    if n == 0:
        return dx
    t = kernel_temperature(opts.temperature)
    c = LOG2E / t
    xs, xt, out = _logits_rows(student, opts.shift), _logits_rows(teacher, opts.shift), _logits_rows(dx, opts.shift)
    if not path.triton:
        xs, xt = xs.reshape(n, -1), xt.reshape(n, -1)
        rows_out = torch.empty(n, student.shape[-1], dtype=student.dtype, device=student.device)
    else:
        rows_out = out
    g = grad_div.reshape(n).to(stats.dtype)
    path.grad(xs, xt, _labels_rows(labels, n), opts.ignore_index, stats.reshape(n, meta.STATS).contiguous(), g,
              rows_out, opts.beta, c, c, 1.0 / t)
    if not path.triton:
        out.copy_(rows_out.view(out.shape))
    return dx


@torch.library.custom_op(f"{NAMESPACE}::_distill_forward", mutates_args=(), schema=(
    f"(Tensor student, Tensor teacher, Tensor? labels, {_OPTS}) -> (Tensor, Tensor, Tensor)"))
def distill_forward(student, teacher, labels, *options):
    """(divergence [lead], student entropy [lead] (empty without compute_entropy), stats [lead, 5])."""
    return _logits_forward(student, teacher, labels, Options(*options), REFERENCE)


@torch.library.custom_op(f"{NAMESPACE}::_distill_backward", mutates_args=(), schema=(
    f"(Tensor grad_divergence, Tensor student, Tensor teacher, Tensor? labels, Tensor stats, {_OPTS}) -> Tensor"))
def distill_backward(grad_divergence, student, teacher, labels, stats, *options):
    """d student logits of sum(grad_divergence * divergence), in the student's dtype."""
    return _logits_backward(grad_divergence, student, teacher, labels, stats, Options(*options), REFERENCE)


distill_forward.register_fake(meta.distill_forward_fake)
distill_backward.register_fake(meta.distill_backward_fake)

if TRITON_DEVICES:
    @distill_forward.register_kernel(TRITON_DEVICES)
    def _distill_forward_triton(student, teacher, labels, *options):
        return _logits_forward(student, teacher, labels, Options(*options), TRITON)

    @distill_backward.register_kernel(TRITON_DEVICES)
    def _distill_backward_triton(grad_divergence, student, teacher, labels, stats, *options):
        return _logits_backward(grad_divergence, student, teacher, labels, stats, Options(*options), TRITON)


def _setup_logits(ctx, inputs, output):
    student, teacher, labels, *options = inputs
    _, ent, stats = output
    ctx.mark_non_differentiable(ent, stats)  # the entropy is a by-product (a metric): no gradient
    ctx.set_materialize_grads(False)
    ctx.options = tuple(options)
    ctx.save_for_backward(student, teacher, labels, stats)


def _backward_logits(ctx, g_div, _g_ent, _g_stats):
    student, teacher, labels, stats = ctx.saved_tensors
    rest = (None,) * (len(ctx.needs_input_grad) - 1)
    if g_div is None or not ctx.needs_input_grad[0]:
        return (None,) + rest
    return (torch.ops.fused._distill_backward(g_div, student, teacher, labels, stats, *ctx.options),) + rest


_setup_logits, _backward_logits = under_forward_settings(_setup_logits, _backward_logits)
distill_forward.register_autograd(_backward_logits, setup_context=_setup_logits)


# ---------------------------------------------------------------------------------------------
# From hidden states and heads
# ---------------------------------------------------------------------------------------------
def chunk_plan(device: torch.device, n: int, v: int, dz_bytes: int) -> tuple[int, int]:
    """(rows per logits chunk, rows per d logits group) for n token rows of a vocabulary of v.

    A chunk holds both models' fp32 logits [rows, v] (8 bytes per column pair): the
    ``distill_chunk_bytes`` setting's budget. A group holds the d logits of whole chunks in the
    student weight's GEMM dtype (dz_bytes each): the ``distill_group_bytes`` budget. Where the
    ``distill_max_extra`` setting names the device type (CUDA: 1/8), the chunk pair and the group
    each take at most half that fraction of one [n, v] fp32 logits tensor (at most n / 32 chunk
    rows and n / (4 dz_bytes) group rows at 1/8), and a chunk at least the ``distill_min_rows``
    setting's rows (GEMMs of fewer rows re-read the weights too often; below 32 times that floor
    the floor wins over the fraction)."""
    kind = device.type
    budget = settings.distill_chunk_bytes.get(kind, settings.distill_chunk_bytes["cpu"])
    gbudget = settings.distill_group_bytes.get(kind, settings.distill_group_bytes["cpu"])
    frac = settings.distill_max_extra.get(kind)
    rows = budget // (8 * v)
    group = gbudget // (dz_bytes * v)
    if frac is not None:
        rows = min(rows, int(frac * n * 4 / 2 / 8))
        group = min(group, int(frac * n * 4 / 2 / dz_bytes))
    rows = max(rows, settings.distill_min_rows.get(kind, 1), 1)
    rows = min(rows - rows % 16 if rows > 16 else rows, max(n, 1))
    group = max(rows, group // rows * rows)
    return rows, min(group, max(n, 1))


def vocab_plan(device: torch.device, n: int, v: int, hs: int, dz_bytes: int) -> int | None:
    """Columns per vocabulary chunk of the head's backward from saved statistics (reduction
    "none"), or None: the row chunks of _loop.

    Given the whole rows' statistics, a d logit is a function of its two logits alone, so that
    backward can run over vocabulary chunks of every row: both models' fp32 logits [N, cols], their
    d logits [N, cols] (dz_bytes each), d weight[v0:v1] from one GEMM over all rows straight into
    d weight, d hidden added into its fp32 rows [N, H]. Row chunks need an fp32 [V, H] d weight
    accumulator wherever one d logits group does not cover every row (at V 151936, H 2048: 1.24
    GB); vocabulary chunks need none, but each chunk reads and writes the fp32 d hidden rows.
    A width is given where the row plan would keep the accumulator (its d logits groups do not
    cover every row; the caller asks only for a wanted 16-bit d weight, since an fp32 one
    accumulates in place) and the budgets allow at least the ``distill_vocab_min_cols`` setting's
    columns: the logits pair within ``distill_chunk_bytes``, the d logits within
    ``distill_group_bytes``, and where ``distill_max_extra`` names the device type, all three with
    the fp32 d hidden rows within that fraction of one [N, V] fp32 logits tensor."""
    kind = device.type
    if n == 0 or chunk_plan(device, n, v, dz_bytes)[1] >= n:
        return None
    budget = settings.distill_chunk_bytes.get(kind, settings.distill_chunk_bytes["cpu"])
    gbudget = settings.distill_group_bytes.get(kind, settings.distill_group_bytes["cpu"])
    cols = min(budget // (8 * n), gbudget // (dz_bytes * n))
    frac = settings.distill_max_extra.get(kind)
    if frac is not None:
        cols = min(cols, int((frac * v * 4 - hs * 4) // (8 + dz_bytes)))
    if cols < max(settings.distill_vocab_min_cols.get(kind, 1), 1):
        return None
    return min(cols - cols % 128 if cols > 128 else cols, v)


def _head_rows(hidden, shift):
    """[N, H] rows of the scored positions (contiguous; a copy of the hidden states at most)."""
    if shift:
        hidden = hidden[..., :-1, :]
    return hidden.reshape(-1, hidden.shape[-1]).contiguous()


@dataclasses.dataclass
class _Head:
    """One model's head for the chunk loop: GEMM operands, bias, and how its chunk's fp32 logits
    become the kernels' input: c = log2(e) k, with k = logit_scale / T folded into the
    kernels' scale, or with a softcap z = softcap tanh(scale y / softcap) applied to the chunk
    (then k = 1 / T for the statistics, and the gradient's chain factor is logit_scale / T)."""
    h: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor | None
    scale: float
    softcap: float | None
    c: float
    k: float

    def logits(self, r0, r1, v0=0, v1=None):
        """fp32 logits of rows r0 .. r1 - 1 and vocabulary columns v0 .. v1 - 1 (None: all)."""
        w = self.w[v0:v1]
        z = _mm_f32(self.h[r0:r1], w.t())
        if self.b is not None:
            z += self.b[v0:v1].to(z.dtype)
        if self.softcap is not None:
            z.mul_(self.scale / self.softcap).tanh_().mul_(self.softcap)
        return z


def _make_head(hidden, weight, bias, scale, softcap, temperature, shift, reference_path):
    w, h = _gemm_operands(weight, _head_rows(hidden, shift), reference_path)
    t = kernel_temperature(temperature)
    t_eff = t if softcap is not None else kernel_temperature(t / scale)
    return _Head(h, w, bias, scale, softcap, LOG2E / t_eff, scale / t)


def _dw_gemm(out, dz, h):
    """out = dz^T @ h over every row (fp32 accumulation inside the GEMM), in out's dtype."""
    if out.dtype == dz.dtype:
        torch.mm(dz.t(), h, out=out)
    elif out.dtype in (torch.float32, torch.float64):
        _addmm_f32_(out, dz.t(), h, first=True)
    else:
        out.copy_(_mm_f32(dz.t(), h))


class _Grads:
    """The gradient GEMMs of a chunk loop: the d logits of a group of chunks (rows g0 .. of
    ``dz``, the student weight's GEMM dtype) go into d hidden rows [N, H] (fp32), d weight and d
    bias. d weight: one GEMM into ``dw`` itself where one group covers every row; else an fp32
    accumulator over the groups."""

    def __init__(self, head, n, group, dh_rows, dw_out, db_acc):
        self.head, self.n, self.group = head, n, group
        self.dh, self.dw_out, self.db = dh_rows, dw_out, db_acc
        one = group >= n
        wants_w = dw_out is not None
        self.dw_acc = None
        if wants_w and not one:
            self.dw_acc = (dw_out if dw_out.dtype in (torch.float32, torch.float64)
                           else torch.empty(dw_out.shape, dtype=torch.float32, device=dw_out.device))
        self.dz = torch.empty(min(group, n), head.w.shape[0], dtype=head.w.dtype, device=head.w.device)

    def flush(self, g0, g1):
        dz, h, w = self.dz[:g1 - g0], self.head.h, self.head.w
        if self.dh is not None:
            _addmm_f32_(self.dh[g0:g1], dz, w, first=True)
        if self.dw_out is not None:
            if self.dw_acc is None:  # one group: d weight from one GEMM over every row
                _dw_gemm(self.dw_out, dz, h)
            else:
                _addmm_f32_(self.dw_acc, dz.t(), h[g0:g1], first=g0 == 0)
        if self.db is not None:
            self.db += dz.sum(0, dtype=self.db.dtype)

    def finish(self):
        if self.dw_acc is not None and self.dw_acc is not self.dw_out:
            self.dw_out.copy_(self.dw_acc)


def _loop(path, s, t, lab, opts, n, v, stats, ent, div, grads=None, weights=None, forward=True, stage=None):
    """The chunk loop shared by the forward (statistics, divergence; with ``grads`` the reduced
    mode's gradients too) and the backward (gradients from the saved statistics). ``stage``
    (the vocabulary-parallel forward's slice passes, no ``grads``): "stats" makes only the
    statistics, "divergence" only the divergence from the statistics already in ``stats``."""
    dz_bytes = s.w.element_size()
    rows, group = chunk_plan(s.h.device, n, v, dz_bytes)
    if grads is not None:
        group = grads.group
    ig, beta = opts.ignore_index, opts.beta
    g0 = 0
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        zs, zt = s.logits(r0, r1), t.logits(r0, r1)
        lab_c = None if lab is None else lab[r0:r1]
        st = stats[r0:r1]
        fused_div = False
        if forward:
            if stage != "divergence":
                path.stats(zs, zt, lab_c, ig, st, None if ent is None else ent[r0:r1], s.c, t.c)
            fused_div = grads is not None and opts.mode == 0  # its gradient needs no aux: one pass for both
            if not fused_div and stage != "stats":
                path.divergence(zs, zt, lab_c, ig, st, div[r0:r1], beta, s.c, t.c, ratio=stage is None)
        if grads is not None:
            w = weights if weights.numel() == 1 else weights[r0:r1]
            path.grad(zs, zt, lab_c, ig, st, w, grads.dz[r0 - g0:r1 - g0], beta, s.c, t.c, s.k, s.softcap,
                      div=div[r0:r1] if fused_div else None)
            if r1 - g0 >= group or r1 == n:
                grads.flush(g0, r1)
                g0 = r1
        del zs, zt
    if grads is not None:
        grads.finish()


def _vocab_loop(path, s, t, lab, opts, n, v, cols, stats, weights, dh_rows, dw, db):
    """The backward from saved statistics over vocabulary chunks of every row (vocab_plan):
    per chunk both models' fp32 logits, their d logits, d weight[v0:v1] (one GEMM into dw), d
    hidden rows += d logits @ W_s[v0:v1] (fp32), d bias[v0:v1]."""
    dz = torch.empty(n, cols, dtype=s.w.dtype, device=s.w.device)
    for v0 in range(0, v, cols):
        v1 = min(v, v0 + cols)
        zs, zt = s.logits(0, n, v0, v1), t.logits(0, n, v0, v1)
        d = dz[:, :v1 - v0]
        path.grad(zs, zt, lab, opts.ignore_index, stats, weights, d, opts.beta, s.c, t.c, s.k, s.softcap)
        del zs, zt
        if dh_rows is not None:
            _addmm_f32_(dh_rows, d, s.w[v0:v1], first=v0 == 0)
        if dw is not None:
            _dw_gemm(dw[v0:v1], d, s.h)
        if db is not None:
            db[v0:v1] = d.sum(0, dtype=db.dtype)


def _head_setup(sh, sw, sb, th, tw, tb, opts, path):
    ref = not path.triton
    s = _make_head(sh, sw, sb, opts.student_logit_scale, opts.student_softcap, opts.temperature, opts.shift, ref)
    t = _make_head(th, tw, tb, opts.teacher_logit_scale, opts.teacher_softcap, opts.temperature, opts.shift, ref)
    return s, t


def _grad_buffers(sh, sw, sb, n, dt, want_h, want_w, want_b):
    dh_rows = torch.empty(n, sh.shape[-1], dtype=dt, device=sh.device) if want_h else None
    db = torch.zeros(sw.shape[0], dtype=dt, device=sh.device) if want_b and sb is not None else None
    return dh_rows, db


def _head_forward(sh, sw, sb, th, tw, tb, labels, opts, path, hidden_grad, weight_grad, bias_grad):
    meta.check_head(sh, sw, sb, th, tw, tb, labels, opts)
    path = _path(path, sh, th)
    dt = acc_dtype(sh.dtype)
    dev = sh.device
    lead = row_shape(sh, opts.shift)
    n, v = math.prod(lead), sw.shape[0]
    red = opts.reduced
    want_h, want_w, want_b = red and hidden_grad, red and weight_grad, red and bias_grad and sb is not None
    out = new_output(() if red else lead, dt, dev)
    ent = new_output(lead if opts.compute_entropy else (0,), dt, dev)
    stats = new_output(tuple(lead) + (meta.STATS,), dt, dev)
    dh = new_output(sh.shape if want_h else (0,), dt, dev)
    dw = new_output(sw.shape if want_w else (0,), dt, dev)
    db = new_output(sb.shape if want_b else (0,), dt, dev)
    if n == 0:
        out.zero_()
        dh.zero_()
        dw.zero_()
        db.zero_()
        return out, ent, stats, dh, dw, db
    lab = _labels_rows(labels, n)
    s, t = _head_setup(sh, sw, sb, th, tw, tb, opts, path)
    div = out.view(n) if not red else torch.empty(n, dtype=dt, device=dev)
    st2 = stats.view(n, meta.STATS)
    ent2 = ent.view(n) if opts.compute_entropy else None
    grads = weights = None
    if want_h or want_w or want_b:
        weights = _loss_weight(lab, opts, n, dt, dev)
        dh_rows, db_acc = _grad_buffers(sh, sw, sb, n, dt, want_h, want_w, want_b)
        _, group = chunk_plan(dev, n, v, s.w.element_size())
        grads = _Grads(s, n, group, dh_rows, dw if want_w else None, db_acc)
    _loop(path, s, t, lab, opts, n, v, st2, ent2, div, grads, weights)
    if red:
        out.copy_(div.sum() * _loss_weight(lab, opts, n, dt, dev).reshape(()))
        if want_h:
            _rows_into(dh, grads.dh, opts.shift)
        if want_b:
            db.copy_(grads.db)
    return out, ent, stats, dh, dw, db


def _loss_weight(lab, opts, n, dt, dev):
    """The reduced loss's weight of every kept row, a one-element tensor: 1 for "sum", 1 / max(kept
    rows, 1) for "token-mean" (a device tensor: no sync)."""
    if opts.reduction == "sum":
        return torch.ones(1, dtype=dt, device=dev)
    count = torch.full((1,), n, dtype=dt, device=dev) if lab is None else \
        (lab != opts.ignore_index).sum().to(dt).reshape(1)
    return 1.0 / count.clamp_min(1.0)


def _rows_into(full, rows, shift):
    """full [..., L(+1), H] = the rows [N, H] (zero last position with shift), in full's dtype."""
    if shift:
        full[..., -1, :] = 0
        full[..., :-1, :] = rows.view(full[..., :-1, :].shape)
    else:
        full.copy_(rows.view(full.shape))


def _head_backward(grad_div, sh, sw, sb, th, tw, tb, labels, stats, opts, path, hidden_grad, weight_grad, bias_grad,
                   hidden_rows=False):
    """(d hidden, d weight, d bias); with ``hidden_rows`` d hidden is the scored rows' fp32 (fp64)
    sum [N, H] before its rounding to the hidden dtype (a vocabulary slice's part, still to be
    summed over the slices)."""
    meta.check_head(sh, sw, sb, th, tw, tb, labels, opts)
    path = _path(path, sh, th)
    dev = sh.device
    want_b = bias_grad and sb is not None
    lead = row_shape(sh, opts.shift)
    n, v = math.prod(lead), sw.shape[0]
    acc = acc_dtype(sh.dtype)
    if hidden_rows:
        dh = new_output((n, sh.shape[-1]) if hidden_grad else (0,), acc, dev)
    else:
        dh = new_output(sh.shape if hidden_grad else (0,), sh.dtype, dev)
    dw = new_output(sw.shape if weight_grad else (0,), sw.dtype, dev)
    db = new_output(sb.shape if want_b else (0,), sh.dtype, dev)
    if n == 0 or not (hidden_grad or weight_grad or want_b):
        dh.zero_()
        dw.zero_()
        db.zero_()
        return dh, dw, db
    lab = _labels_rows(labels, n)
    s, t = _head_setup(sh, sw, sb, th, tw, tb, opts, path)
    dh_rows, db_acc = _grad_buffers(sh, sw, sb, n, acc, hidden_grad and not hidden_rows, weight_grad, want_b)
    if hidden_rows and hidden_grad:
        dh_rows = dh
    g = grad_div.reshape(n).to(acc).contiguous()
    st2 = stats.reshape(n, meta.STATS).contiguous()
    # vocabulary chunks where they save the row groups' fp32 [V, H] accumulator: a d weight that
    # is wanted, in a 16-bit dtype (an fp32 / fp64 one accumulates in place)
    cols = (vocab_plan(dev, n, v, s.h.shape[1], s.w.element_size())
            if weight_grad and dw.dtype not in (torch.float32, torch.float64) else None)
    if cols is not None:
        _vocab_loop(path, s, t, lab, opts, n, v, cols, st2, g, dh_rows, dw, db_acc)
    else:
        _, group = chunk_plan(dev, n, v, s.w.element_size())
        grads = _Grads(s, n, group, dh_rows, dw if weight_grad else None, db_acc)
        _loop(path, s, t, lab, opts, n, v, st2, None, None, grads, g, forward=False)
    if hidden_grad and not hidden_rows:
        _rows_into(dh, dh_rows, opts.shift)
    if want_b:
        db.copy_(db_acc)
    return dh, dw, db


_HEAD_TENSORS = ("Tensor student_hidden, Tensor student_weight, Tensor? student_bias, Tensor teacher_hidden, "
                 "Tensor teacher_weight, Tensor? teacher_bias, Tensor? labels")
_FLAGS = "bool hidden_grad=False, bool weight_grad=False, bool bias_grad=False"


@torch.library.custom_op(f"{NAMESPACE}::_linear_distill_forward", mutates_args=(), schema=(
    f"({_HEAD_TENSORS}, {_OPTS}, *, {_FLAGS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def linear_distill_forward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                           labels, *options, hidden_grad=False, weight_grad=False, bias_grad=False):
    """(divergence, entropy, stats, d hidden, d weight, d bias): with reduction "none" the
    per-token divergence [lead] and empty gradients; with "sum" / "token-mean" the 0-dim loss and
    its fp32 gradients for the inputs named by the flags (empty for the others)."""
    return _head_forward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                         labels, Options(*options), REFERENCE, hidden_grad, weight_grad, bias_grad)


@torch.library.custom_op(f"{NAMESPACE}::_linear_distill_backward", mutates_args=(), schema=(
    f"(Tensor grad_divergence, {_HEAD_TENSORS}, Tensor stats, {_OPTS}, *, bool hidden_grad=True, "
    "bool weight_grad=True, bool bias_grad=True) -> (Tensor, Tensor, Tensor)"))
def linear_distill_backward(grad_divergence, student_hidden, student_weight, student_bias, teacher_hidden,
                            teacher_weight, teacher_bias, labels, stats, *options, hidden_grad=True, weight_grad=True,
                            bias_grad=True):
    """(d student hidden, d student weight, d student bias) of sum(grad_divergence * divergence)
    (reduction "none"), each empty where its flag is off."""
    return _head_backward(grad_divergence, student_hidden, student_weight, student_bias, teacher_hidden,
                          teacher_weight, teacher_bias, labels, stats, Options(*options), REFERENCE, hidden_grad,
                          weight_grad, bias_grad)


linear_distill_forward.register_fake(meta.linear_forward_fake)
linear_distill_backward.register_fake(meta.linear_backward_fake)

if TRITON_DEVICES:
    @linear_distill_forward.register_kernel(TRITON_DEVICES)
    def _linear_distill_forward_triton(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                                       teacher_bias, labels, *options, hidden_grad=False, weight_grad=False,
                                       bias_grad=False):
        return _head_forward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                             teacher_bias, labels, Options(*options), TRITON, hidden_grad, weight_grad, bias_grad)

    @linear_distill_backward.register_kernel(TRITON_DEVICES)
    def _linear_distill_backward_triton(grad_divergence, student_hidden, student_weight, student_bias, teacher_hidden,
                                        teacher_weight, teacher_bias, labels, stats, *options, hidden_grad=True,
                                        weight_grad=True, bias_grad=True):
        return _head_backward(grad_divergence, student_hidden, student_weight, student_bias, teacher_hidden,
                              teacher_weight, teacher_bias, labels, stats, Options(*options), TRITON, hidden_grad,
                              weight_grad, bias_grad)


def _setup_head(ctx, inputs, output):
    """(The op's keyword-only flags are not needed here: the backward reads needs_input_grad.)"""
    sh, sw, sb, th, tw, tb, labels, *options = inputs
    _, ent, stats, dh, dw, db = output
    ctx.mark_non_differentiable(ent, stats, dh, dw, db)
    ctx.set_materialize_grads(False)
    ctx.options = tuple(options)
    ctx.reduced = Options(*options).reduced
    if ctx.reduced:  # the gradients, computed in the forward: the backward scales them
        ctx.save_for_backward(sh, sw, sb, dh, dw, db)
    else:
        ctx.save_for_backward(sh, sw, sb, th, tw, tb, labels, stats)


def _scaled(saved, g, like, what):
    """saved * g (fp32), rounded once to like's dtype; a clear error where the forward made none."""
    if saved.numel() == 0 and like.numel() != 0:
        raise RuntimeError(f"linear_distill: {what} needs a gradient, but the reduced forward was called without "
                           f"computing it ({what}_grad=False): call it with the flag set (the public op sets it from "
                           "requires_grad)")
    out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    return torch.mul(saved, g.to(saved.dtype), out=out)


def _backward_head(ctx, g_div, *_unused):
    need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    rest = (None,) * (len(ctx.needs_input_grad) - 3)
    if g_div is None or not (need_h or need_w or need_b):
        return (None, None, None) + rest
    if ctx.reduced:
        sh, sw, sb, dh, dw, db = ctx.saved_tensors
        return (_scaled(dh, g_div, sh, "hidden") if need_h else None,
                _scaled(dw, g_div, sw, "weight") if need_w else None,
                _scaled(db, g_div, sb, "bias") if need_b and sb is not None else None) + rest
    sh, sw, sb, th, tw, tb, labels, stats = ctx.saved_tensors
    dh, dw, db = torch.ops.fused._linear_distill_backward(
        g_div, sh, sw, sb, th, tw, tb, labels, stats, *ctx.options, hidden_grad=bool(need_h),
        weight_grad=bool(need_w), bias_grad=bool(need_b and sb is not None))
    return (dh if need_h else None, dw if need_w else None, db if need_b and sb is not None else None) + rest


_setup_head, _backward_head = under_forward_settings(_setup_head, _backward_head)


def _setup_head_keywords(ctx, inputs, keyword_only_inputs, output):
    _setup_head(ctx, inputs, output)


linear_distill_forward.register_autograd(_backward_head, setup_context=_setup_head_keywords)


# ---------------------------------------------------------------------------------------------
# Vocabulary slices (torch_fused/parallel_distill.py): the passes of a slice of the vocabulary
# ---------------------------------------------------------------------------------------------
# A rank of a vocabulary-parallel call holds both models' logits (or head rows) for a slice of
# the vocabulary. The generalized JSD needs the whole rows' statistics before its divergence
# pass, so its forward runs the two passes apart: "stats" (no ``stats`` argument) makes the
# slice's own (m, log2 s) per model and the student's entropy over the slice; "divergence" (the
# whole rows' ``stats`` given) makes the slice's part of the divergence and of aux (the
# divergence pass over the slice's columns only: summed over the slices, the rows' values). The
# backward of a slice is the single-device backward with the whole rows' statistics, d hidden
# returned as fp32 rows to be summed over the slices.
def _row_operands(student, teacher, labels, opts, n, path):
    """(log2(e) / T, the student's and the teacher's logits rows, the labels' rows) as the row
    passes read them (the reference path: [N, V] views)."""
    c = LOG2E / kernel_temperature(opts.temperature)
    xs, xt = _logits_rows(student, opts.shift), _logits_rows(teacher, opts.shift)
    if not path.triton:
        xs, xt = xs.reshape(n, -1), xt.reshape(n, -1)
    return c, xs, xt, _labels_rows(labels, n)


def _slice_outputs(lead, stats_in, opts, dt, dev):
    stage = "stats" if stats_in is None else "divergence"
    div = new_output(lead if stage == "divergence" else (0,), dt, dev)
    ent = new_output(lead if stage == "stats" and opts.compute_entropy else (0,), dt, dev)
    st = new_output(tuple(lead) + (meta.STATS,), dt, dev)
    return stage, div, ent, st


def _start_slice_stats(st2, stats_in, stage, n):
    if stage == "stats":
        st2[:, 4] = 0
    else:
        st2[:, :4] = stats_in.reshape(n, meta.STATS)[:, :4]


def _logits_slice_forward(student, teacher, labels, stats_in, opts, path):
    meta.check_logits(student, teacher, labels, opts)
    lead = row_shape(student, opts.shift)
    meta.check_slice_stats(stats_in, lead, student)
    path = _path(path, student, teacher)
    dt = acc_dtype(student.dtype)
    n = math.prod(lead)
    stage, div, ent, st = _slice_outputs(lead, stats_in, opts, dt, student.device)
    if n == 0:
        return div, ent, st
    c, xs, xt, lab = _row_operands(student, teacher, labels, opts, n, path)
    st2 = st.view(n, meta.STATS)
    _start_slice_stats(st2, stats_in, stage, n)
    if stage == "stats":
        path.stats(xs, xt, lab, opts.ignore_index, st2, ent.view(n) if opts.compute_entropy else None, c, c)
    else:
        path.divergence(xs, xt, lab, opts.ignore_index, st2, div.view(n), opts.beta, c, c, ratio=False)
    return div, ent, st


def _head_slice_forward(sh, sw, sb, th, tw, tb, labels, stats_in, opts, path):
    meta.check_head(sh, sw, sb, th, tw, tb, labels, opts)
    lead = row_shape(sh, opts.shift)
    meta.check_slice_stats(stats_in, lead, sh)
    check_value(not opts.reduced, lambda: "reduction: the slice ops take reduction='none'")
    path = _path(path, sh, th)
    dt = acc_dtype(sh.dtype)
    n, v = math.prod(lead), sw.shape[0]
    stage, div, ent, st = _slice_outputs(lead, stats_in, opts, dt, sh.device)
    if n == 0:
        return div, ent, st
    lab = _labels_rows(labels, n)
    s, t = _head_setup(sh, sw, sb, th, tw, tb, opts, path)
    st2 = st.view(n, meta.STATS)
    _start_slice_stats(st2, stats_in, stage, n)
    ent2 = ent.view(n) if stage == "stats" and opts.compute_entropy else None
    _loop(path, s, t, lab, opts, n, v, st2, ent2, div.view(n) if stage == "divergence" else None, stage=stage)
    return div, ent, st


@torch.library.custom_op(f"{NAMESPACE}::_distill_slice_forward", mutates_args=(), schema=(
    f"(Tensor student, Tensor teacher, Tensor? labels, Tensor? stats, {_OPTS}) -> (Tensor, Tensor, Tensor)"))
def distill_slice_forward(student, teacher, labels, stats, *options):
    """One pass over a vocabulary slice of both models' logits: without ``stats`` (empty
    divergence, the slice's entropy, the slice's statistics [lead, 5] with aux 0); with the whole
    rows' ``stats`` (the slice's part of the divergence [lead], empty entropy, ``stats`` with
    the slice's part of aux)."""
    return _logits_slice_forward(student, teacher, labels, stats, Options(*options), REFERENCE)


@torch.library.custom_op(f"{NAMESPACE}::_linear_distill_slice_forward", mutates_args=(), schema=(
    f"({_HEAD_TENSORS}, Tensor? stats, {_OPTS}) -> (Tensor, Tensor, Tensor)"))
def linear_distill_slice_forward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                                 teacher_bias, labels, stats, *options):
    """``_distill_slice_forward`` from both heads' rows of a vocabulary slice (the chunk loop,
    the GEMMs of the slice's rows)."""
    return _head_slice_forward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                               teacher_bias, labels, stats, Options(*options), REFERENCE)


@torch.library.custom_op(f"{NAMESPACE}::_linear_distill_slice_backward", mutates_args=(), schema=(
    f"(Tensor grad_divergence, {_HEAD_TENSORS}, Tensor stats, {_OPTS}, *, bool hidden_grad=True, "
    "bool weight_grad=True, bool bias_grad=True) -> (Tensor, Tensor, Tensor)"))
def linear_distill_slice_backward(grad_divergence, student_hidden, student_weight, student_bias, teacher_hidden,
                                  teacher_weight, teacher_bias, labels, stats, *options, hidden_grad=True,
                                  weight_grad=True, bias_grad=True):
    """``_linear_distill_backward`` of a vocabulary slice with the whole rows' ``stats``: d hidden
    as the scored rows' fp32 (fp64) part [N, H], to be summed over the slices."""
    return _head_backward(grad_divergence, student_hidden, student_weight, student_bias, teacher_hidden,
                          teacher_weight, teacher_bias, labels, stats, Options(*options), REFERENCE, hidden_grad,
                          weight_grad, bias_grad, hidden_rows=True)


distill_slice_forward.register_fake(meta.distill_slice_forward_fake)
linear_distill_slice_forward.register_fake(meta.linear_slice_forward_fake)
linear_distill_slice_backward.register_fake(meta.linear_slice_backward_fake)

if TRITON_DEVICES:
    @distill_slice_forward.register_kernel(TRITON_DEVICES)
    def _distill_slice_forward_triton(student, teacher, labels, stats, *options):
        return _logits_slice_forward(student, teacher, labels, stats, Options(*options), TRITON)

    @linear_distill_slice_forward.register_kernel(TRITON_DEVICES)
    def _linear_distill_slice_forward_triton(student_hidden, student_weight, student_bias, teacher_hidden,
                                             teacher_weight, teacher_bias, labels, stats, *options):
        return _head_slice_forward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                                   teacher_bias, labels, stats, Options(*options), TRITON)

    @linear_distill_slice_backward.register_kernel(TRITON_DEVICES)
    def _linear_distill_slice_backward_triton(grad_divergence, student_hidden, student_weight, student_bias,
                                              teacher_hidden, teacher_weight, teacher_bias, labels, stats, *options,
                                              hidden_grad=True, weight_grad=True, bias_grad=True):
        return _head_backward(grad_divergence, student_hidden, student_weight, student_bias, teacher_hidden,
                              teacher_weight, teacher_bias, labels, stats, Options(*options), TRITON, hidden_grad,
                              weight_grad, bias_grad, hidden_rows=True)


# ---------------------------------------------------------------------------------------------
# Public composite ops
# ---------------------------------------------------------------------------------------------
def _reduce(div, labels, opts):
    """The per-token divergence reduced as opts.reduction says (0 at ignored positions already)."""
    if opts.reduction == "none":
        return div
    total = div.sum()
    if opts.reduction == "sum":
        return total
    count = (torch.full((), div.numel(), dtype=div.dtype, device=div.device) if labels is None
             else (labels != opts.ignore_index).sum().to(div.dtype))
    return total / count.clamp_min(1.0)


def _topk_support(ids, logprobs, labels, opts):
    """(ids with every unused slot set to ignore_index, the used slots [..., L, k]): a slot is
    unused where its id is ignore_index, its teacher log-prob is -inf, or its position's label is
    ignore_index."""
    valid = (ids != opts.ignore_index) & (logprobs != float("-inf"))
    if labels is not None:
        valid = valid & (labels != opts.ignore_index)[..., None]
    return torch.where(valid, ids, torch.full_like(ids, opts.ignore_index)), valid


def _topk_finish(lp_s, ent, logprobs, valid, labels, opts, tail):
    div = reference.distill_topk(lp_s, logprobs.detach(), valid, opts.beta, tail)
    if labels is not None:
        div = torch.where(labels != opts.ignore_index, div, torch.zeros_like(div))
    return _reduce(div, labels, opts), ent


def _topk_args(teacher_given, ids, logprobs, rows, rows_name, opts, tail):
    if teacher_given:
        fn = "linear_distill" if rows_name == "student_hidden" else "distill"
        raise ValueError(f"{fn}: pass either the full teacher or teacher_topk_ids and teacher_topk_logprobs, "
                         "not both")
    if opts.teacher_logit_scale != 1.0 or opts.teacher_softcap is not None:
        raise ValueError("teacher_logit_scale, teacher_softcap: a top-k teacher's log-probs are taken as given "
                         "(no teacher head is computed); leave them at 1.0 and None")
    if ids is None or logprobs is None:
        raise ValueError("teacher_topk_ids and teacher_topk_logprobs: pass both (the top-k teacher) or neither")
    meta.check_tail(tail)
    meta.check_topk(rows, rows_name, ids, logprobs, opts.shift)


_DISTILL_KW = ("float beta=0.5, float temperature=1.0, Tensor? labels=None, int ignore_index=-100, bool shift=False, "
               "str reduction=\"none\", bool return_entropy=False")

LIB.define(f"distill(Tensor student_logits, Tensor? teacher_logits=None, *, Tensor? teacher_topk_ids=None, "
           f"Tensor? teacher_topk_logprobs=None, {_DISTILL_KW}, str tail=\"bucket\") -> (Tensor, Tensor)")


def _distill(student_logits, teacher_logits=None, *, teacher_topk_ids=None, teacher_topk_logprobs=None, beta=0.5,
             temperature=1.0, labels=None, ignore_index=-100, shift=False, reduction="none", return_entropy=False,
             tail="bucket"):
    no_forward_mode("distill", student_logits)
    opts = Options(beta=beta, temperature=temperature, ignore_index=ignore_index, shift=shift, reduction=reduction,
                   compute_entropy=return_entropy)
    meta.check_options(opts)
    if teacher_topk_ids is not None or teacher_topk_logprobs is not None:
        _topk_args(teacher_logits is not None, teacher_topk_ids, teacher_topk_logprobs, student_logits,
                   "student_logits", opts, tail)
        meta.check_labels(labels, row_shape(student_logits, shift), student_logits.device, "student_logits", shift)
        ids, valid = _topk_support(teacher_topk_ids, teacher_topk_logprobs, labels, opts)
        lp, ent, _ = torch.ops.fused._logprobs_entropy_forward(
            student_logits, ids, None, *LogprobOptions(temperature, ignore_index, return_entropy, shift).values())
        return _topk_finish(lp, ent, teacher_topk_logprobs, valid, labels, opts, tail)
    meta.check_tail(tail)
    if teacher_logits is None:
        raise ValueError("distill: teacher_logits is required (or teacher_topk_ids and teacher_topk_logprobs for a "
                         "top-k teacher)")
    div, ent, _ = torch.ops.fused._distill_forward(student_logits, teacher_logits, labels, *opts.values())
    return _reduce(div, labels, opts), ent


LIB.impl("distill", _distill, "CompositeImplicitAutograd")

LIB.define(
    "linear_distill(Tensor student_hidden, Tensor student_weight, Tensor? teacher_hidden=None, "
    f"Tensor? teacher_weight=None, *, {_DISTILL_KW}, Tensor? student_bias=None, Tensor? teacher_bias=None, "
    "float student_logit_scale=1.0, float teacher_logit_scale=1.0, float? student_softcap=None, "
    "float? teacher_softcap=None, Tensor? teacher_topk_ids=None, Tensor? teacher_topk_logprobs=None, "
    "str tail=\"bucket\") -> (Tensor, Tensor)")


def _wants_grad(t) -> bool:
    return t is not None and torch.is_grad_enabled() and t.requires_grad


def _linear_distill(student_hidden, student_weight, teacher_hidden=None, teacher_weight=None, *, beta=0.5,
                    temperature=1.0, labels=None, ignore_index=-100, shift=False, reduction="none",
                    return_entropy=False, student_bias=None, teacher_bias=None, student_logit_scale=1.0,
                    teacher_logit_scale=1.0, student_softcap=None, teacher_softcap=None, teacher_topk_ids=None,
                    teacher_topk_logprobs=None, tail="bucket"):
    no_forward_mode("linear_distill", student_hidden, student_weight, student_bias)
    opts = Options(beta, temperature, ignore_index, shift, reduction, return_entropy, student_logit_scale,
                   teacher_logit_scale, student_softcap, teacher_softcap)
    meta.check_options(opts)
    if teacher_topk_ids is not None or teacher_topk_logprobs is not None:
        _topk_args(teacher_hidden is not None or teacher_weight is not None or teacher_bias is not None,
                   teacher_topk_ids, teacher_topk_logprobs, student_hidden, "student_hidden", opts, tail)
        meta.check_student_head(student_hidden, student_weight, student_bias, labels, opts)
        ids, valid = _topk_support(teacher_topk_ids, teacher_topk_logprobs, labels, opts)
        head = HeadOptions(temperature, ignore_index, shift, student_logit_scale, student_softcap)
        lp, ent, _ = torch.ops.fused._linear_logprobs_entropy_forward(student_hidden, student_weight, ids,
                                                                      student_bias, *head.values())
        if not return_entropy:
            ent = ent.new_empty(0)
        return _topk_finish(lp, ent, teacher_topk_logprobs, valid, labels, opts, tail)
    meta.check_tail(tail)
    if teacher_hidden is None or teacher_weight is None:
        raise ValueError("linear_distill: teacher_hidden and teacher_weight are required (or teacher_topk_ids and "
                         "teacher_topk_logprobs for a top-k teacher)")
    out, ent, *_ = torch.ops.fused._linear_distill_forward(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, labels,
        *opts.values(), hidden_grad=_wants_grad(student_hidden), weight_grad=_wants_grad(student_weight),
        bias_grad=_wants_grad(student_bias))
    return out, ent


LIB.impl("linear_distill", _linear_distill, "CompositeImplicitAutograd")
