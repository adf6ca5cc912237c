"""``fused::_sampler_threshold``: the sampler's support (top_k, top_p, min_p) of the rows a
log-prob op scores, as one threshold per row and a support list (meta/sampler.py), for the
public log-prob ops' composite (ops/logprobs.py ``_restricted_core``), which passes both to the
core ops.

The CPU implementation is the plain-PyTorch rule (reference.sampler_threshold, which sorts);
the Triton one (kernels/sampler.py) finds the same thresholds without a sort or a copy of the
logits, in about one pass over each row for min-p and top-k and two for top-p. The thresholds
are constants of the step: the op has no autograd formula and its caller passes detached inputs.
"""

from __future__ import annotations

import math

import torch

from .._library import LOG2E, NAMESPACE, TRITON_DEVICES, exact_shift, kernel_temperature, n_sm, new_output
from .. import reference
from ..meta import sampler as meta
from ..settings import current as settings


@torch.library.custom_op(f"{NAMESPACE}::_sampler_threshold", mutates_args=(), schema=(
    "(Tensor logits, Tensor? temperature_t, float temperature, bool shift, int? top_k, float? top_p, float? min_p) "
    "-> (Tensor, Tensor)"))
def sampler_threshold(logits, temperature_t, temperature, shift, top_k, top_p, min_p):
    """(threshold, support list) of the rows (with ``shift`` the positions 0..L-1 of
    [..., L+1, V]); the default implementation (the reference) lists no row."""
    opts = meta.sampler_options(temperature, shift, top_k, top_p, min_p)
    meta.check_options(logits, None, temperature_t, opts)
    return reference.sampler_threshold(logits, temperature_t, opts), _unlisted(logits, shift)


sampler_threshold.register_fake(meta.sampler_threshold_fake)


def _unlisted(logits, shift):
    return torch.full(meta.support_shape(logits, shift), -1, dtype=torch.int32, device=logits.device)


def _threshold_triton(logits, temperature_t, temperature, shift, top_k, top_p, min_p):
    """The op's Triton implementation: the fast route for the options given (min-p / top-k by a
    running filter, top-p alone by a sampled band), then the exact kernel for the rows it left."""
    return threshold_launches(logits, temperature_t, temperature, shift, top_k, top_p, min_p)


def threshold_launches(logits, temperature_t, temperature, shift, top_k, top_p, min_p, finish=True):
    """_threshold_triton's launches. ``finish=False`` (tests, benchmarks): (tau, support, finish)
    after the fast route's launch alone (rows it left to the exact kernel hold the count -2 and
    no tau), where ``finish()`` launches the exact kernel over the same tensors."""
    opts = meta.sampler_options(temperature, shift, top_k, top_p, min_p)
    meta.check_options(logits, None, temperature_t, opts)
    if logits.dtype == torch.float64 or not settings.sampler_kernels:
        # a validation dtype (the reference keeps fp64 thresholds), or the kernels switched off:
        # the reference's thresholds (torch ops on the device; no row listed)
        return _done(finish, reference.sampler_threshold(logits, temperature_t, opts), _unlisted(logits, shift))
    from ..kernels import sampler as K
    from .logprobs import _row_layout

    x = logits[..., :-1, :] if shift else logits
    v = x.shape[-1]
    rows = x.numel() // v
    tau = new_output(meta.row_shape(logits, shift), torch.float32, logits.device)
    support = _unlisted(logits, shift)
    if rows == 0:
        return _done(finish, tau, support)
    has_minp = min_p is not None and min_p > 0.0
    has_topk = top_k is not None and top_k < v
    has_topp = top_p is not None and top_p < 1.0
    if not (has_minp or has_topk or has_topp):  # nothing left out: every id kept
        return _done(finish, tau.fill_(float("-inf")), support)
    (inner, s_outer, s_inner), copy = _row_layout(x)
    if copy:
        x = x.contiguous()
    t_ptr = temperature_t is not None
    t = kernel_temperature(temperature)
    min_p_arg = (math.log(min_p) if t_ptr else t * math.log(min_p)) if has_minp else 0.0
    cfg = K.config(x.element_size(), v, settings.small_tiles)
    lo_bit = K.lo_bit(x.dtype)
    exact = exact_shift(None if t_ptr else LOG2E / t)
    k_arg = top_k if has_topk else 0
    p_arg = top_p if has_topp else 1.0
    # a top_k past half the filter's list (or past its lanes) would overflow the list on most rows
    every_row = settings.sampler_exact or (has_topk and top_k > min(cfg.cap // 2, cfg.block))
    if not every_row:
        if has_minp or has_topk:
            _filter_launches(K, cfg, x, tau, support, temperature_t, rows, v, (inner, s_outer, s_inner), t,
                             min_p_arg, k_arg, p_arg, has_minp, has_topk, has_topp, t_ptr, exact, lo_bit)
        else:
            nprog = min(rows, cfg.programs if cfg.programs else n_sm(logits.device) * K.PROGRAMS_PER_SM)
            cap = cfg.cap_p
            val = torch.empty((nprog, cap), dtype=torch.float32, device=logits.device)
            append = settings.sampler_top_p_append
            pos = torch.empty((nprog, 2 * cap if append else cap), dtype=torch.int32, device=logits.device)
            # every stride_s-th element sampled (a multiple of the tile rows' width), at most
            # cfg.sample of them
            stride_s = max(cfg.ept, K.triton.next_power_of_2(K.triton.cdiv(v, cfg.sample)))
            count = torch.zeros(rows, dtype=torch.int32, device=logits.device) if append else None
            K._sampler_top_p_kernel[(nprog,)](
                x, tau, support, val, pos, temperature_t, count, rows, v, inner, s_outer, s_inner, t, p_arg,
                stride_s, K.triton.cdiv(v, stride_s), K.BAND_Z, EXACT_SHIFT=exact,
                T_FROM_PTR=t_ptr, LO_BIT=lo_bit, CAP=cap, SUP_CAP=meta.SUPPORT_CAP, BLOCK_V=cfg.block,
                EPT=cfg.ept, BLOCK=cfg.block, CHUNK=cfg.chunk, APPEND=append, SORT_R=cfg.sort_r,
                num_warps=cfg.warps)

    def exact_rows():
        K._sampler_exact_kernel[(rows,)](
            x, tau, support, temperature_t, v, inner, s_outer, s_inner, t, min_p_arg, k_arg, p_arg,
            ALL_ROWS=every_row, HAS_MINP=has_minp, HAS_TOPK=has_topk, HAS_TOPP=has_topp, EXACT_SHIFT=exact,
            T_FROM_PTR=t_ptr, LO_BIT=lo_bit, SUP_CAP=meta.SUPPORT_CAP, BLOCK=cfg.exact_block, num_warps=4)

    if not finish:
        return tau, support, exact_rows
    exact_rows()
    return tau, support


def _filter_launches(K, cfg, x, tau, support, temperature_t, rows, v, layout, t, min_p_arg, k_arg, p_arg, has_minp,
                     has_topk, has_topp, t_ptr, exact, lo_bit):
    """The filter kernel over every row (its tail in each program), or with the
    ``sampler_filter_split`` setting in launch pairs of at most cfg.split_rows rows: the
    streaming kernel (a working list per row), then the tail kernel (a small program per row)."""
    dev = x.device
    split = settings.sampler_filter_split
    count = torch.zeros(rows, dtype=torch.int32, device=dev)  # the rows' atomic counts
    nprog_max = cfg.filter_programs or n_sm(dev) * K.FILTER_PROGRAMS_PER_SM
    lists = min(rows, cfg.split_rows) if split else min(rows, nprog_max)
    val = torch.empty((lists, cfg.cap), dtype=torch.float32, device=dev)
    pos = torch.empty((lists, 2 * cfg.cap), dtype=torch.int32, device=dev)
    ml = torch.empty((lists, 3), dtype=torch.float32, device=dev) if split else None
    flags = dict(HAS_MINP=has_minp, HAS_TOPK=has_topk, HAS_TOPP=has_topp, T_FROM_PTR=t_ptr, EXACT_SHIFT=exact,
                 LO_BIT=lo_bit, CAP=cfg.cap, SUP_CAP=meta.SUPPORT_CAP, ONE_PASS=settings.sampler_filter_one_pass)
    step = lists if split else rows
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        K._sampler_filter_kernel[(min(r1 - r0, nprog_max),)](
            x, tau, support, val, pos, count, temperature_t, ml, r0, r1, v, *layout, t, min_p_arg, k_arg, p_arg,
            BLOCK=cfg.block, CHUNK=cfg.chunk, SORT_R=cfg.sort_r, WARM=cfg.warm, SPLIT=split,
            num_warps=cfg.filter_warps, **flags)
        if split:
            K._sampler_filter_tail_kernel[(r1 - r0,)](
                x, tau, support, val, pos, count, temperature_t, ml, r0, v, *layout, t, min_p_arg, k_arg, p_arg,
                CHUNK=cfg.tail_chunk, SORT_R=cfg.tail_sort_r, num_warps=cfg.tail_warps, **flags)


def _done(finish, tau, support):
    return (tau, support) if finish else (tau, support, lambda: None)


if TRITON_DEVICES:
    sampler_threshold.register_kernel(TRITON_DEVICES)(_threshold_triton)
