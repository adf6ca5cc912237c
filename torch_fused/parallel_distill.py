"""Vocabulary-parallel distillation: ``torch_fused.distill`` and ``torch_fused.linear_distill`` on
DTensors sharded over the vocabulary (as torch_fused/parallel.py does it for the log-prob ops).

Inputs. From logits: the student's and the teacher's logits, both DTensors ``Shard(-1)`` on the
same mesh and mesh dim (the same layout). From heads: both weights DTensors ``Shard(0)`` of
[V, H] on the same mesh (biases, if any, placed like their weights), the hidden states plain
tensors (the same on every rank) or ``Replicate()`` DTensors. Each rank holds both models'
columns of the same vocabulary slice. A top-k teacher needs only the student's head sharded:
the student's log-probs at the k ids come from the vocabulary-parallel log-prob ops (one
all-gather of [rows, 2 (+1) + k]); the divergence over the k ids (+ tail) is O(rows k) local work.

Forward, full teacher. Every rank runs the single-device passes over its slice; which rows'
statistics they need decides the number of collectives (all O(rows); the logits never move):

- beta 0 or 1 (a plain KL): ONE all-gather. Each rank runs the whole single-device forward on its
  slice as if it were the vocabulary: per model (m_r, log2 s_r), the student's entropy H_r and the
  slice's divergence D_r = KL(t_r || s_r) (beta 0) between the two models' distributions
  renormalized over the slice. With u_r, w_r the student's and the teacher's probability of slice
  r (from the merged sums, as the log-prob merge forms them), the chain rule of the KL divergence
  gives the rows' value:

      KL(t || s) = sum_r w_r D_r + sum_r w_r ln(w_r / u_r)      (beta 1: u and w swapped)

  (a slice the weighting side gives no probability adds nothing; one the other side gives none
  while this side does makes the value +inf, as on one device).
- 0 < beta < 1 (the generalized JSD): TWO collectives. The mixture log((1 - beta) p_s + beta p_t)
  needs both models' whole-row normalizers before any of its terms, so no rescaling of per-slice
  sums can stand in for it: an all-gather of the slices' statistics [rows, 4 (+1)], then the
  divergence pass over each slice with the whole rows' statistics and an all-reduce of its
  [rows, 2] parts (the divergence and the backward's aux, KL(s || m)). From heads this pass
  recomputes the slice's GEMMs (the statistics and the divergence are two chunk loops).

The merged statistics are the whole rows' (max, log2 sum) in the kernels' convention (the
merge is ops.logprobs.merge_row_stats, as for the log-prob ops), so the backward is local: the
single-device backward of the slice with these statistics writes the slice's d logits (no
collective); from heads it makes d weight and d bias of the slice's rows, and the ranks' partial
d hidden [N, H] (fp32) are summed by ONE all-reduce, rounded once to the hidden dtype.

Reductions ("sum", "token-mean") are applied to the merged per-token divergence; from heads the
backward then recomputes the slice's GEMMs (the single-device reduced mode's gradients in the
forward need the whole rows' statistics before the slice's gradient pass, i.e. a third pass).
Outputs are ``Replicate()`` DTensors; gradients are placed as their inputs.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor

from ._library import acc_dtype, check, exact_shift, kernel_temperature, traced_constants
from .meta import distill as meta
from .meta.distill import DistillOptions
from .meta.logprobs import row_shape
from .ops import distill as D
from .ops import linear_logprobs as LL
from .ops import logprobs as lp_ops
from . import parallel as P


# ---------------------------------------------------------------------------------------------
# Local pieces (no process group)
# ---------------------------------------------------------------------------------------------
def _exact(rows: torch.Tensor, other: torch.Tensor, cs: float, ct: float) -> bool:
    """Whether the slices' statistics are relative to the exact shifts m c (the reference path,
    float64, the interpreter, a large scale) or to round(m c) (the GPU kernels): ops/distill.py
    sends float64 to the reference and gives the kernels one EXACT_SHIFT for both models."""
    triton = P._triton_path(rows) and torch.float64 not in (rows.dtype, other.dtype)
    return not triton or exact_shift(cs) or exact_shift(ct)


def _empty_slice_parts(n: int, cols: int, dt, device) -> torch.Tensor:
    """The partials (m_s, log2 s_s, m_t, log2 s_t, ...) of an empty slice: s = 0 for both models,
    so it weighs nothing in the merge; every other column 0."""
    p = torch.zeros(n, cols, dtype=dt, device=device)
    p[:, 1].fill_(float("-inf"))
    p[:, 3].fill_(float("-inf"))
    return p


def slice_parts(stats, ent, div, n: int, dt) -> torch.Tensor:
    """[n, 4 (+1 entropy) (+1 divergence)] partials of a slice from its single-device outputs."""
    cols = [stats.reshape(n, meta.STATS)[:, :4]]
    if ent is not None:
        cols.append(ent.reshape(n, 1))
    if div is not None:
        cols.append(div.reshape(n, 1))
    return torch.cat([c.to(dt) for c in cols], 1)


def merge_distill_partials(parts: torch.Tensor, cs: float, ct: float, exact: bool, has_ent: bool, mode: int | None):
    """The world's partials [W, n, 4 (+1) (+1)] (rank order) -> (stats [n, 4] of the whole rows,
    student entropy [n] or None, divergence [n] or None). ``mode`` 0 or 1: the last column is the
    slice's KL (beta 0 / 1) and the rows' KL is formed by the chain rule (module docstring);
    None: statistics only. The same arithmetic on every rank."""
    ninf = float("-inf")
    ln2 = traced_constants()[1]
    m_s, l_s, m_t, l_t = parts[..., 0], parts[..., 1], parts[..., 2], parts[..., 3]
    s_s, s_t = torch.exp2(l_s), torch.exp2(l_t)
    if has_ent:  # t = s (log2 s - H / ln 2) per slice, as parallel.merge_partials
        t_s = (s_s * (l_s - parts[..., 4] * (1.0 / ln2))).masked_fill(l_s == ninf, 0.0)
    else:
        t_s = torch.zeros_like(s_s)
    big_s, sum_s, tsum, _, da_s = lp_ops.merge_row_stats(m_s, s_s, t_s, cs, exact, 0)
    big_t, sum_t, _, _, da_t = lp_ops.merge_row_stats(m_t, s_t, torch.zeros_like(s_t), ct, exact, 0)
    l2_s, l2_t = sum_s.log2(), sum_t.log2()
    stats = torch.stack([big_s, l2_s, big_t, l2_t], 1)
    ent = ((l2_s - tsum / sum_s) * ln2).masked_fill_(l2_s == ninf, float("nan")) if has_ent else None
    div = None
    if mode is not None:
        d_r = parts[..., -1]
        rel_u = l_s + da_s - l2_s  # log2 of slice r's student probability u_r [W, n] (-inf: none)
        rel_w = l_t + da_t - l2_t  # and the teacher's, w_r
        lp, lq = (rel_w, rel_u) if mode == 0 else (rel_u, rel_w)
        term = torch.exp2(lp) * (d_r + (lp - lq) * ln2)
        term = torch.where(lq == ninf, float("inf"), term)  # the other side has no probability there
        term = torch.where(lp == ninf, 0.0, term)  # this side has none: no part of its KL
        div = term.sum(0)
    return stats, ent, div


def _keep(labels, n, ignore_index, device):
    return torch.ones(n, dtype=torch.bool, device=device) if labels is None else \
        labels.reshape(n) != ignore_index


def _finish_world(parts_world, n, cs, ct, exact, has_ent, mode, labels, opts, dt, device):
    """(div [n] or None, ent [n] or None, stats [n, 5]) from the gathered partials."""
    st4, ent, div = merge_distill_partials(parts_world, cs, ct, exact, has_ent, mode)
    stats = torch.zeros(n, meta.STATS, dtype=dt, device=device)
    stats[:, :4] = st4
    if div is not None:
        div = torch.where(_keep(labels, n, opts.ignore_index, device), div, torch.zeros_like(div))
        if mode == 1:  # the backward's aux: the rows' KL(s || t)
            stats[:, 4] = div
    return div, ent, stats


# ---------------------------------------------------------------------------------------------
# The forward over the world (both forms)
# ---------------------------------------------------------------------------------------------
def _world_forward(local_full, local_pass, empty, rows, other, n, layout, opts, cs, ct, labels):
    """(div [n], ent [n] or None, stats [n, 5]) of the whole rows. ``local_full()``: the
    single-device forward of the slice -> (div, ent, stats); ``local_pass(stats)``: the slice
    ops (stats None: the statistics pass; else the divergence pass); ``empty``: this rank's
    slice has no columns."""
    dt = acc_dtype(rows.dtype)
    dev = rows.device
    has_ent = opts.compute_entropy
    exact = _exact(rows, other, cs, ct)
    mode = opts.mode
    if mode in (0, 1):
        cols = 5 + int(has_ent)
        if empty:
            parts = _empty_slice_parts(n, cols, dt, dev)
        else:
            div_r, ent_r, st_r = local_full()
            parts = slice_parts(st_r, ent_r if has_ent else None, div_r, n, dt)
        world = P._all_gather(parts, layout) if parts.numel() else parts.new_empty(layout.world, *parts.shape)
        return _finish_world(world, n, cs, ct, exact, has_ent, mode, labels, opts, dt, dev)
    # the generalized JSD: the whole rows' statistics first, then the divergence over the slices
    cols = 4 + int(has_ent)
    if empty:
        parts = _empty_slice_parts(n, cols, dt, dev)
    else:
        _, ent_r, st_r = local_pass(None)
        parts = slice_parts(st_r, ent_r if has_ent else None, None, n, dt)
    world = P._all_gather(parts, layout) if parts.numel() else parts.new_empty(layout.world, *parts.shape)
    _, ent, stats = _finish_world(world, n, cs, ct, exact, has_ent, None, labels, opts, dt, dev)
    if empty:
        sums = torch.zeros(n, 2, dtype=dt, device=dev)
    else:
        div_r, _, st_out = local_pass(stats)
        sums = torch.stack([div_r.reshape(n).to(dt), st_out.reshape(n, meta.STATS)[:, 4].to(dt)], 1)
    sums = P._all_reduce_sum(sums, layout) if sums.numel() else sums
    stats[:, 4] = sums[:, 1]
    return sums[:, 0], ent, stats


def _scales(opts, student_scale=1.0, student_cap=None, teacher_scale=1.0, teacher_cap=None):
    """(c_s, c_t) as ops/distill.py forms them (_make_head): log2(e) / T_eff per model."""
    def c(scale, cap):
        t = kernel_temperature(opts.temperature)
        return traced_constants()[0] / (t if cap is not None else kernel_temperature(t / scale))
    return c(student_scale, student_cap), c(teacher_scale, teacher_cap)


class _VocabParallelDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, xt, labels, layout, opts):
        lead = row_shape(xs, opts.shift)
        n = math.prod(lead)
        cs, ct = _scales(opts)
        div, ent, stats = _world_forward(
            lambda: torch.ops.fused._distill_forward(xs, xt, labels, *opts.values()),
            lambda st: torch.ops.fused._distill_slice_forward(xs, xt, labels, None if st is None else
                                                              st.reshape(*lead, meta.STATS), *opts.values()),
            xs.shape[-1] == 0, xs, xt, n, layout, opts, cs, ct, labels)
        ctx.set_materialize_grads(False)
        ctx.args = (layout, opts)
        ctx.save_for_backward(xs, xt, labels, stats.reshape(*lead, meta.STATS))
        dt = acc_dtype(xs.dtype)
        ent = ent.reshape(lead) if ent is not None else torch.empty(0, dtype=dt, device=xs.device)
        ctx.mark_non_differentiable(ent)
        return div.reshape(lead), ent

    @staticmethod
    def backward(ctx, g_div, _g_ent):
        xs, xt, labels, stats = ctx.saved_tensors
        layout, opts = ctx.args
        rest = (None,) * (len(ctx.needs_input_grad) - 1)
        if g_div is None or not ctx.needs_input_grad[0]:
            return (None,) + rest
        if xs.shape[-1] == 0:
            return (torch.zeros_like(xs),) + rest
        # the single-device backward of the slice, with the whole rows' statistics: no collective
        return (torch.ops.fused._distill_backward(g_div.contiguous(), xs, xt, labels, stats, *opts.values()),) + rest


class _VocabParallelLinearDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sh, sw, sb, th, tw, tb, labels, layout, opts):
        lead = row_shape(sh, opts.shift)
        n = math.prod(lead)
        cs, ct = _scales(opts, opts.student_logit_scale, opts.student_softcap, opts.teacher_logit_scale,
                         opts.teacher_softcap)
        div, ent, stats = _world_forward(
            lambda: torch.ops.fused._linear_distill_forward(sh, sw, sb, th, tw, tb, labels, *opts.values())[:3],
            lambda st: torch.ops.fused._linear_distill_slice_forward(
                sh, sw, sb, th, tw, tb, labels, None if st is None else st.reshape(*lead, meta.STATS),
                *opts.values()),
            sw.shape[0] == 0, sh, th, n, layout, opts, cs, ct, labels)
        ctx.set_materialize_grads(False)
        ctx.args = (layout, opts)
        ctx.save_for_backward(sh, sw, sb, th, tw, tb, labels, stats.reshape(*lead, meta.STATS))
        dt = acc_dtype(sh.dtype)
        ent = ent.reshape(lead) if ent is not None else torch.empty(0, dtype=dt, device=sh.device)
        ctx.mark_non_differentiable(ent)
        return div.reshape(lead), ent

    @staticmethod
    def backward(ctx, g_div, _g_ent):
        sh, sw, sb, th, tw, tb, labels, stats = ctx.saved_tensors
        layout, opts = ctx.args
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = bool(need_b and sb is not None)
        rest = (None,) * (len(ctx.needs_input_grad) - 3)
        if g_div is None or not (need_h or need_w or need_b):
            return (None, None, None) + rest
        n = math.prod(row_shape(sh, opts.shift))
        if sw.shape[0] == 0:  # an empty slice: nothing of its own, but its part (0) of the d hidden sum
            dh = torch.zeros(n if need_h else 0, sh.shape[-1], dtype=acc_dtype(sh.dtype), device=sh.device)
            dw, db = torch.zeros_like(sw), (torch.zeros_like(sb) if sb is not None else None)
        else:
            dh, dw, db = torch.ops.fused._linear_distill_slice_backward(
                g_div.contiguous(), sh, sw, sb, th, tw, tb, labels, stats, *opts.values(), hidden_grad=bool(need_h),
                weight_grad=bool(need_w), bias_grad=need_b)
        if need_h:  # the one collective of the backward: the ranks' partial d hidden, summed in fp32
            dh = LL.hidden_grad_from_rows(P._all_reduce_sum(dh, layout) if dh.numel() else dh, sh, opts.shift)
        return (dh if need_h else None, dw if need_w else None, db if need_b else None) + rest


# ---------------------------------------------------------------------------------------------
# Entry points (torch_fused.distill / linear_distill with DTensor inputs)
# ---------------------------------------------------------------------------------------------
def _placed_like(t, what: str, ref, ref_what: str, optional: bool = False) -> None:
    """t must be a DTensor on ref's mesh with ref's placements (the same vocabulary slices)."""
    if t is None and optional:
        return
    if not isinstance(t, DTensor):
        got = "None" if t is None else f"a plain {type(t).__name__}"
        raise ValueError(f"{what}: expected a DTensor placed as {ref_what}, {P._fmt(ref.placements)} on its mesh "
                         f"(both models' vocabulary split the same way), got {got}")
    if t.device_mesh != ref.device_mesh:
        raise ValueError(f"{what}: expected a DTensor on the mesh of {ref_what} ({ref.device_mesh}), got one on "
                         f"{t.device_mesh}")
    if tuple(t.placements) != tuple(ref.placements):
        raise ValueError(f"{what}: expected the placements of {ref_what}, {P._fmt(ref.placements)} (both models' "
                         f"vocabulary split the same way), got {P._fmt(t.placements)}")


def _out(t, layout):
    return P._replicate(t, layout.mesh)


def _topk(lp_rep, ent_rep, logprobs, valid, labels, opts, tail, layout):
    div, _ = D._topk_finish(lp_rep.to_local(), None, logprobs, valid, labels, opts, tail)
    return _out(div, layout), ent_rep


def distill(student_logits, teacher_logits=None, *, teacher_topk_ids=None, teacher_topk_logprobs=None, beta=0.5,
            temperature=1.0, labels=None, ignore_index=-100, shift=False, reduction="none", return_entropy=False,
            tail="bucket", mesh_dim=None):
    """(divergence, entropy or None) as ``Replicate()`` DTensors from DTensor logits ``Shard(-1)``
    (see the module docstring); the student logits' gradient is ``Shard(-1)``, local."""
    opts = DistillOptions(beta=beta, temperature=temperature, ignore_index=ignore_index,
                          shift=shift, reduction=reduction, compute_entropy=return_entropy)
    meta.check_options(opts)
    if not isinstance(student_logits, DTensor):
        raise ValueError("student_logits: expected a DTensor with placement Shard(-1) (vocabulary-parallel logits) "
                         f"when teacher_logits is one, got a plain {type(student_logits).__name__}")
    layout = P.vocab_layout(student_logits, "student_logits", -1, mesh_dim)
    lab = P._replicated_local(labels, "labels", layout, "student_logits")
    if teacher_topk_ids is not None or teacher_topk_logprobs is not None:
        ids = P._replicated_local(teacher_topk_ids, "teacher_topk_ids", layout, "student_logits")
        lps = P._replicated_local(teacher_topk_logprobs, "teacher_topk_logprobs", layout, "student_logits")
        D._topk_args(teacher_logits is not None, ids, lps, student_logits, "student_logits", opts, tail)
        meta.check_labels(lab, row_shape(student_logits, shift), student_logits.device, "student_logits", shift)
        ids, valid = D._topk_support(ids, lps, lab, opts)
        lp, ent = P.logprobs_entropy(student_logits, ids, temperature=opts.temperature, ignore_index=ignore_index,
                                     shift=shift, mesh_dim=mesh_dim, want_ent=return_entropy)
        return _topk(lp, ent, lps, valid, lab, opts, tail, layout)
    if teacher_logits is None:
        raise ValueError("distill: teacher_logits is required (or teacher_topk_ids and teacher_topk_logprobs for a "
                         "top-k teacher)")
    _placed_like(teacher_logits, "teacher_logits", student_logits, "student_logits")
    meta.check_logits(student_logits, teacher_logits, lab, opts)  # the global shapes, as on one device
    xs = P._local_shard(student_logits)
    with torch.no_grad():  # no gradient flows to the teacher
        xt = teacher_logits.to_local()
    check(xt.shape[-1] == xs.shape[-1], lambda: f"teacher_logits: local shard of {xt.shape[-1]} vocabulary entries, "
                                                f"student_logits' of {xs.shape[-1]}")
    div, ent = _VocabParallelDistill.apply(xs, xt, lab, layout, replace(opts, reduction="none"))
    div = D._reduce(div, lab, opts)
    return _out(div, layout), (_out(ent, layout) if return_entropy else None)


def linear_distill(student_hidden, student_weight, teacher_hidden=None, teacher_weight=None, *, beta=0.5,
                   temperature=1.0, labels=None, ignore_index=-100, shift=False, reduction="none",
                   return_entropy=False, student_bias=None, teacher_bias=None, student_logit_scale=1.0,
                   teacher_logit_scale=1.0, student_softcap=None, teacher_softcap=None, teacher_topk_ids=None,
                   teacher_topk_logprobs=None, tail="bucket", mesh_dim=None):
    """(divergence, entropy or None) as ``Replicate()`` DTensors from DTensor weights ``Shard(0)``
    (see the module docstring); d student weight (bias) ``Shard(0)``, d hidden summed once."""
    opts = DistillOptions(beta, temperature, ignore_index, shift, reduction, return_entropy,
                          student_logit_scale, teacher_logit_scale, student_softcap, teacher_softcap)
    meta.check_options(opts)
    if not isinstance(student_weight, DTensor):
        raise ValueError("student_weight: expected a DTensor with placement Shard(0) (a vocabulary-sharded lm_head) "
                         f"when another input is a DTensor, got a plain {type(student_weight).__name__}")
    layout = P.vocab_layout(student_weight, "student_weight", 0, mesh_dim)
    _placed_like(student_bias, "student_bias", student_weight, "student_weight", optional=True)
    sh = P._replicated_local(student_hidden, "student_hidden", layout, "student_weight")
    lab = P._replicated_local(labels, "labels", layout, "student_weight")
    if teacher_topk_ids is not None or teacher_topk_logprobs is not None:
        ids = P._replicated_local(teacher_topk_ids, "teacher_topk_ids", layout, "student_weight")
        lps = P._replicated_local(teacher_topk_logprobs, "teacher_topk_logprobs", layout, "student_weight")
        D._topk_args(teacher_hidden is not None or teacher_weight is not None or teacher_bias is not None, ids, lps,
                     sh, "student_hidden", opts, tail)
        meta.check_student_head(sh, student_weight, student_bias, lab, opts)
        ids, valid = D._topk_support(ids, lps, lab, opts)
        lp, ent = P.linear_logprobs_and_entropy(
            sh, student_weight, ids, bias=student_bias, mesh_dim=mesh_dim, temperature=opts.temperature,
            ignore_index=ignore_index, shift=shift, logit_scale=student_logit_scale, softcap=student_softcap)
        return _topk(lp, ent if return_entropy else None, lps, valid, lab, opts, tail, layout)
    if teacher_hidden is None or teacher_weight is None:
        raise ValueError("linear_distill: teacher_hidden and teacher_weight are required (or teacher_topk_ids and "
                         "teacher_topk_logprobs for a top-k teacher)")
    _placed_like(teacher_weight, "teacher_weight", student_weight, "student_weight")
    _placed_like(teacher_bias, "teacher_bias", teacher_weight, "teacher_weight", optional=True)
    th = P._replicated_local(teacher_hidden, "teacher_hidden", layout, "student_weight")
    meta.check_head(sh, student_weight, student_bias, th, teacher_weight, teacher_bias, lab, opts)  # global shapes
    sw, sb = P._local_shard(student_weight), P._local_shard(student_bias)
    with torch.no_grad():  # no gradient flows to the teacher
        tw = teacher_weight.to_local()
        tb = None if teacher_bias is None else teacher_bias.to_local()
        th = th.detach()
    div, ent = _VocabParallelLinearDistill.apply(sh, sw, sb, th, tw, tb, lab, layout, replace(opts, reduction="none"))
    div = D._reduce(div, lab, opts)
    return _out(div, layout), (_out(ent, layout) if return_entropy else None)
