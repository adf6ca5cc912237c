"""The log-prob / entropy family: ``fused::selective_log_softmax``, ``fused::entropy_from_logits``
and ``fused::logprobs_and_entropy``.

The three public ops are thin ``CompositeImplicitAutograd`` definitions over one opaque core op,
``fused::_logprobs_entropy_forward``, which returns (logp, entropy, stats) from ONE read of the
logits. Its autograd formula calls ``fused::_logprobs_entropy_backward``, one fused pass that
serves any combination of log-prob and entropy gradients. The core also returns the row
statistics ``stats[..., 2]`` = (row max of the logits, log2 of the shifted sum of exponentials;
see kernels/logprobs.py for why they are kept apart), so that the backward saves only O(rows)
tensors; the public ops hide them. Because the public ops
are composite, ``torch.compile`` sees straight through them to the two opaque core nodes.

The Triton implementations keep a launch plan per call key (``_library.Plans``): what the input checks
and the layout arithmetic concluded for those shapes, strides, dtypes and arguments, so that a
training loop's repeated call only allocates its outputs and launches.
"""

from __future__ import annotations

import functools
import struct

import torch

from .._library import (LIB, LOG2E, NAMESPACE, TRITON_DEVICES, acc_dtype, call_eager, exact_shift, no_forward_mode,
                        inline_under_compile, kernel_temperature, under_forward_settings, new_output, on_triton, rows_strides, PlanLaunch,
                        Plans, tensor_key, traced_constants)
from .. import reference
from ..settings import restored as settings_restored, snapshot as settings_snapshot, values as _settings_values
from ..meta import logprobs as meta

_FWD = f"{NAMESPACE}::_logprobs_entropy_forward"
_BWD = f"{NAMESPACE}::_logprobs_entropy_backward"


Options = meta.LogprobOptions
_N_OPTS = Options.count()
_OPTS_SCHEMA = Options.schema()


_split = meta.split_core_args
# the sampler's support (ops/sampler.py): the rows' thresholds and support lists, after the options
_SUPPORT_SCHEMA = "Tensor? threshold=None, Tensor? support=None"


@torch.library.custom_op(_FWD, mutates_args=(), schema=(
    f"(Tensor logits, Tensor? index, Tensor? temperature_t, {_OPTS_SCHEMA}, {_SUPPORT_SCHEMA}) "
    "-> (Tensor, Tensor, Tensor)"))
def logprobs_entropy_forward(logits, index, temperature_t, *rest):
    """(logp, entropy, stats) of the family from one read of the logits; the default implementation
    (the plain-PyTorch reference) serves every device without a Triton one (CPU). ``threshold``
    (one per row) restricts the row to its logits >= threshold (the sampler's support); the
    support list (the positions of each row's logits >= its threshold, where they fit) lets the
    Triton forward and backward skip the rest of a listed row."""
    opts, threshold, support = _split(rest)
    return _forward_default(logits, index, temperature_t, opts, threshold, support)


@torch.library.custom_op(_BWD, mutates_args=(), schema=(
    f"(Tensor? grad_logp, Tensor? grad_entropy, Tensor logits, Tensor? index, Tensor stats, Tensor entropy, "
    f"Tensor? temperature_t, {_OPTS_SCHEMA}, {_SUPPORT_SCHEMA}, *, bool temperature_grad=True) -> (Tensor, Tensor)"))
def logprobs_entropy_backward(grad_logp, grad_entropy, logits, index, stats, entropy, temperature_t, *rest,
                              temperature_grad=True):
    """(d logits, d T) of the core; d T only for a tensor temperature with ``temperature_grad``."""
    opts, threshold, support = _split(rest)
    return _backward_default(grad_logp, grad_entropy, logits, index, stats, entropy, temperature_t, opts,
                             temperature_grad, threshold=threshold, support=support)


def _forward_default(logits, index, temperature_t, opts, threshold=None, support=None):
    meta.check_options(logits, index, temperature_t, opts)
    meta.check_support(logits, opts.shift, threshold, support)
    return reference.logprobs_entropy_forward(logits, index, temperature_t, opts, threshold)


def _backward_default(grad_logp, grad_entropy, logits, index, stats, entropy, temperature_t, opts,
                      temperature_grad=True, *, threshold=None, support=None):
    return reference.logprobs_entropy_backward(grad_logp, grad_entropy, logits, index, stats, entropy, temperature_t,
                                               opts, temperature_grad, threshold=threshold)


logprobs_entropy_forward.register_fake(meta.logprobs_entropy_forward_fake)
logprobs_entropy_backward.register_fake(meta.logprobs_entropy_backward_fake)


# ---------------------------------------------------------------------------------------------
# Triton implementations
# ---------------------------------------------------------------------------------------------
_FWD_PLANS = Plans()


def _row_layout(x):
    """((inner_size, stride_outer, stride_inner), copy?) of the rows of x: its own strides where its
    leading dims collapse to two strided dims and V is contiguous, else (copy = True) those of a
    contiguous copy, derived from a meta tensor of its shape (no data is copied here)."""
    layout = rows_strides(x) if x.stride(-1) == 1 else None
    if layout is not None:
        return layout, False
    return rows_strides(torch.empty(x.shape, dtype=x.dtype, device="meta")), True


def _settings_key():
    """The settings a plan depends on (the kernels' block choice, the backward's segments)."""
    v = _settings_values()
    return v["logprobs_block"], v["small_tiles"], v["logprobs_bwd_segment"]


def _forward_plan(logits, index, temperature_t, opts, threshold=None, support=None):
    """(out shapes, dtype, rows, copy the logits?, layout, index as [rows, K] needs a copy?, k,
    kernel constexprs and options, scale c) of a forward call; raises on bad input."""
    meta.check_options(logits, index, temperature_t, opts)
    meta.check_support(logits, opts.shift, threshold, support)
    from ..kernels import logprobs as K

    shift, compute_entropy = opts.shift, opts.compute_entropy

    x = logits[..., :-1, :] if shift else logits  # rows 0..L-1 of [..., L+1, V], read in place
    v = x.shape[-1]
    rows = x.numel() // v
    lead = tuple(x.shape[:-1])
    layout, copy = _row_layout(x)
    k = (index.numel() // rows if rows else 1) if index is not None else 1
    index_copy = index is not None and not index.is_contiguous()
    block_v, warps = K.pick_block(v, x.element_size(), "fwd_ent" if compute_entropy else "fwd")
    c = LOG2E / kernel_temperature(opts.temperature)  # the float temperature's scale (a placeholder with temperature_t)
    constexprs = dict(
        HAS_INDEX=index is not None, HAS_ENT=compute_entropy,
        EXACT_SHIFT=exact_shift(None if temperature_t is not None else c),
        T_FROM_PTR=temperature_t is not None, HAS_TAU=threshold is not None, HAS_SUP=support is not None,
        BLOCK_V=block_v, BLOCK_K=max(2, K.triton.next_power_of_2(k)), EPT=16 // x.element_size(),
        num_warps=warps,
    )
    shapes = (tuple(index.shape) if index is not None else (0,), lead if compute_entropy else (0,), lead + (2,))
    return shapes, acc_dtype(x.dtype), rows, copy, layout, index_copy, k, v, c, constexprs, K


def _forward_triton(logits, index, temperature_t, *rest):
    """The forward op's Triton implementation."""
    opts, threshold, support = _split(rest)
    return _forward_run(logits, index, temperature_t, opts, True, threshold, support)[:3]


def _forward_run(logits, index, temperature_t, opts, placeholders, threshold=None, support=None):
    """(logp, entropy, stats, the backward plans of this forward's key) of the forward's Triton
    implementation. ``placeholders=False`` (the eager path, whose node returns only the public
    outputs): None for an output the call does not make (the log-probs without an index, the
    entropy without compute_entropy) instead of the op's empty tensor. float64 logits go to the
    reference, which ignores ``placeholders`` and always returns the op's three tensors (the eager
    path then picks its public outputs from them), and no backward plans (None).

    The backward plans: backward_triton's ``plans``, the eager path's cache of the backward
    launch plans of calls with this forward's key, keyed by the upstream gradients and the saved
    logits' and index's layouts (the rest of a backward plan's key is the forward's arguments)."""
    if logits.dtype == torch.float64:
        # float64 is a validation dtype: the reference on the same device keeps fp64 accuracy
        return _forward_default(logits, index, temperature_t, opts, threshold, support) + (None,)
    # the devices of the logits, index and tensor temperature too (tensor_key leaves them out):
    # a plan hit skips the checks, which name an index or temperature on another device
    key = (tensor_key(logits), tensor_key(index), tensor_key(temperature_t), opts, _settings_key(),
           logits.get_device(), None if index is None else index.get_device(),
           None if temperature_t is None else temperature_t.get_device(), tensor_key(threshold),
           None if threshold is None else threshold.get_device(), tensor_key(support),
           None if support is None else support.get_device())
    plan = _FWD_PLANS.get(key)
    if plan is None:
        p = _forward_plan(logits, index, temperature_t, opts, threshold, support)
        plan = _FWD_PLANS.put(key, (p, PlanLaunch(p[-1]._logprobs_entropy_forward_kernel, p[-2]), Plans()))
    plan, go, bwd_plans = plan
    (s_logp, s_ent, s_stats), dt, rows, copy, (inner, s_outer, s_inner), index_copy, k, v, c, constexprs, K = plan
    device = logits.device
    shift, compute_entropy = opts.shift, opts.compute_entropy
    logp = new_output(s_logp, dt, device) if placeholders or index is not None else None
    ent = new_output(s_ent, dt, device) if placeholders or compute_entropy else None
    stats = new_output(s_stats, dt, device)
    if rows == 0:
        return logp, ent, stats, bwd_plans
    # with shift the rows are the first L of every [L+1, V] block: the same first element
    x = (logits[..., :-1, :] if shift else logits).contiguous() if copy else logits
    # a pointer the launch does not touch is passed as None (a compile-time constant: no argument
    # to bind or check per launch, and nothing to allocate where the launch is traced)
    idx = None if index is None else index.contiguous() if index_copy else index  # [rows, K] row-major
    tau = None if threshold is None else threshold.contiguous()  # one per row, in row order
    sup = None if support is None else support.contiguous()  # [rows, SUPPORT_CAP + 1], in row order
    go(rows, x, idx, logp if index is not None else None, ent if compute_entropy else None, stats, temperature_t, tau,
       sup, v, k, inner, s_outer, s_inner, c, opts.ignore_index, 0 if sup is None else sup.stride(-2))
    return logp, ent, stats, bwd_plans


def shift_is_exact(triton_path: bool, dtype: torch.dtype, c: float) -> bool:
    """Whether statistics made in ``dtype`` are relative to the exact shift m c (the plain-PyTorch
    reference, the interpreter, float64, a large scale c: _library.exact_shift) or to the rounded
    product round(m c) (the GPU kernels): the ``exact`` of shift_difference."""
    return not triton_path or exact_shift(c) or dtype == torch.float64


def shift_difference(a, b, c: float, exact: bool):
    """(a - b) c in the units of sums that the kernels made relative to a shift m c (kernels/logprobs.py,
    _shift_diff): exactly where the sums are relative to the exact m c (``exact``: the reference, the
    interpreter, float64, a large scale c: _library.exact_shift), else as the GPU kernels form it,
    round(a c) - round(b c) in fp32 (c rounded to fp32 as the kernels take it). The rounded form is
    the custom op ``fused::_merge_shift``, so that a compiler (inductor, where the caller is traced)
    sees no product to fuse into the subtraction as an fma, which would use the exact a c (off by up
    to half an ulp of it, 5e-4 at |a c| ~ 1.4e4). Casts are no such barrier: inductor's Triton code
    for an fp64 product cast back to fp32 still came out fused on CUDA."""
    if exact:
        return (a - b) * c
    return torch.ops.fused._merge_shift(a, b, c)


def merge_row_stats(m, s, t, c: float, exact: bool, dim: int):
    """The whole rows' statistics from those of vocabulary parts, merged along ``dim`` in index
    order: part r holds (m_r its max, s_r = sum 2^d, t_r = sum 2^d d, with d = (x - m_r) c). Returns
    (m, s, t, e, da) with dim removed from the first three: m the max over live parts (s_r > 0;
    a row with none keeps the placeholder max 0, as the kernels), s = sum e_r s_r and
    t = sum e_r (t_r + da_r s_r), where da_r = (m_r - m) c (shift_difference) and e_r = 2^da_r
    (0 for an empty part: no 0 * inf). The one torch form of the merge the kernels make
    (kernels/logprobs.py _forward_combine): the fused head's chunk and tile merges and the
    vocabulary-parallel merge of the ranks' partials use it."""
    live = s > 0
    big = torch.where(live, m, float("-inf")).amax(dim, keepdim=True)
    big = torch.where(live.any(dim, keepdim=True), big, torch.zeros_like(big))
    da = shift_difference(m, big, c, exact)
    e = torch.where(live, torch.exp2(da), torch.zeros_like(da))
    return big.squeeze(dim), (s * e).sum(dim), (e * (t + da * s)).sum(dim), e, da


@torch.library.custom_op(f"{NAMESPACE}::_merge_shift", mutates_args=())
def _merge_shift(a: torch.Tensor, b: torch.Tensor, c: float) -> torch.Tensor:
    """round(a c) - round(b c) in fp32 (float32 a and b, broadcast; c rounded to fp32), each
    product rounded before the subtraction."""
    c32 = struct.unpack("f", struct.pack("f", c))[0]
    return torch.sub(torch.mul(a, c32), torch.mul(b, c32))


@_merge_shift.register_fake
def _(a, b, c):
    return torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=torch.promote_types(a.dtype, b.dtype),
                       device=a.device)


_BWD_PLANS = Plans()


def _view_or_none(t, shape):
    """t viewed as shape, or None where a reshape would have to copy it (decided from its strides
    alone, so the plan also runs on fake tensors)."""
    try:
        return t.view(shape)
    except RuntimeError:
        return None


def _backward_plan(grad_logp, grad_entropy, logits, index, temperature_t, opts, temperature_grad, v_off, v_total,
                   out_dtype, out, in_place, exact, threshold=None, support=None):
    """(d logits dtype, rows, which operands need a copy, the kernel's scalar arguments, its
    constexprs and options, grid size) of a backward call."""
    from ..kernels import logprobs as K

    shift = opts.shift

    dx_dtype = out.dtype if out is not None else out_dtype or logits.dtype
    # d logits' layout, from a meta tensor of its shape and strides (out's, or a fresh contiguous one)
    dx = (torch.empty_strided(out.shape, out.stride(), dtype=dx_dtype, device="meta") if out is not None
          else torch.empty(logits.shape, dtype=dx_dtype, device="meta"))
    x = logits[..., :-1, :] if shift else logits
    v = x.shape[-1]
    rows = x.numel() // v
    t_ptr = temperature_t is not None
    # d T's row partials only where T's gradient is wanted: they need one program per row
    has_dt = t_ptr and temperature_grad
    tail_rows = dx.numel() // max(v, 1) - rows
    (inner, s_outer, s_inner), x_copy = _row_layout(x)
    if shift:
        d_inner, d_outer, d_stride = rows_strides(dx[..., :-1, :])
        z_inner, z_outer, z_stride = rows_strides(dx[..., -1, :])
    else:
        d_inner, d_outer, d_stride = max(rows, 1), 0, dx.stride(0) if dx.dim() == 2 else v
        z_inner, z_outer, z_stride = 1, 0, 0
    has_glp = grad_logp is not None and index is not None
    k, idx_copy, glp_copy, glp_sr, glp_sk = 1, False, False, 0, 0
    if has_glp:
        k = index.numel() // rows if rows else 1
        idx_copy = not index.is_contiguous()
        glp = _view_or_none(grad_logp, (rows, k))
        glp_copy = glp is None  # a reshape copies it: contiguous
        glp_sr, glp_sk = (k, 1) if glp_copy else glp.stride()
    has_gh = grad_entropy is not None
    gh_copy, gh_s = False, 0
    if has_gh:
        gh = _view_or_none(grad_entropy, (rows,))
        gh_copy = gh is None  # likewise
        gh_s = 1 if gh_copy else gh.stride(0)
    block_v, warps = K.pick_block(v, x.element_size(), "bwd")
    t = kernel_temperature(opts.temperature)
    log2e = traced_constants()[0]  # LOG2E as a literal: the vocabulary-parallel backward is traced by Dynamo
    segs, seg_len = (1, v) if has_dt or in_place else K.backward_segments(v, block_v)
    if (threshold is not None or support is not None) and (in_place or v_off or v_total is not None):
        raise ValueError("backward_triton: a threshold or support list serves whole rows of the logits ops (no "
                         "vocabulary slice, no d logits written over the logits)")
    scalars = (v, k, rows, inner, s_outer, s_inner, v_off, v if v_total is None else v_total,
               d_inner, d_outer, d_stride, z_inner, z_outer, z_stride,
               log2e / t, 1.0 / t, opts.ignore_index, segs, seg_len, glp_sr, glp_sk, gh_s,
               0 if support is None else support.stride(0))
    constexprs = dict(
        HAS_GLP=has_glp, HAS_GH=has_gh, SINGLE_K=k == 1,
        EXACT_SHIFT=exact if exact is not None else exact_shift(None if t_ptr else log2e / t),
        T_FROM_PTR=t_ptr, HAS_DT=has_dt, ZERO_TAIL=tail_rows > 0, IN_PLACE=in_place,
        HAS_TAU=threshold is not None, HAS_SUP=support is not None,
        BLOCK_V=block_v, BLOCK_K=max(2, K.triton.next_power_of_2(k)),
        num_warps=warps,
    )
    grid = (rows + tail_rows) * segs if dx.numel() else 0
    return dx_dtype, rows, k, (x_copy, idx_copy, glp_copy, gh_copy), scalars, constexprs, grid, K


def _backward_triton(grad_logp, grad_entropy, logits, index, stats, entropy, temperature_t, *rest,
                     temperature_grad=True):
    """The backward op's Triton implementation."""
    opts, threshold, support = _split(rest)
    return backward_triton(grad_logp, grad_entropy, logits, index, stats, entropy, temperature_t, opts,
                           temperature_grad, threshold=threshold, support=support)


def backward_triton(grad_logp, grad_entropy, logits, index, stats, entropy, temperature_t, opts,
                    temperature_grad=True, *, v_off=0, v_total=None, out_dtype=None, out=None, exact=None,
                    want_dt=True, plans=None, threshold=None, support=None):
    """The kernels' host code of the backward: the one route into the backward kernel (the
    registered op, the eager path, the vocabulary-parallel slice op and the fused head all call
    it). Keyword-only extras for the fused lm_head
    (ops/linear_logprobs.py): the logits may be columns v_off .. v_off + V - 1 of a vocabulary
    of v_total (stats and entropy of the whole rows), and d logits may be of another dtype, or
    written into ``out``: a [rows, V] view with unit column stride, which may share memory with
    2-D logits whose elements are at least as wide, as long as row r of ``out`` starts at the
    first byte of logits row r (column j of ``out`` then never lies past column j of the
    logits; the kernel orders its warps' loads before the stores over them). ``exact``: the shift
    mode the stats were made with (_library.exact_shift); None: the logits ops' forward's.
    ``temperature_grad=False``: no d T for a tensor temperature (an empty tensor, or None with
    ``want_dt=False``), and the row may be split into segments as with a float one.
    ``want_dt=False``: d T is None (not an empty tensor) where it is not computed. ``plans``:
    the backward plans of the forward call that saved these tensors (_forward_run; the eager
    path, whose keyword extras are then all at their defaults), keyed by the upstream gradients
    and the saved logits' and index's layouts (the rest of the full key is the forward's).
    ``threshold``, ``support``: the sampler's support of the forward (ops/sampler.py), whole rows
    only: logits below a row's threshold have d logits 0, and a row whose support list holds its
    kept columns is written from the list without a pass over its logits."""
    if plans is not None and (v_off or v_total is not None or out_dtype is not None or out is not None
                              or exact is not None):
        raise ValueError("backward_triton: plans= is the eager path's, whose keyword extras (v_off, v_total, "
                         "out_dtype, out, exact) stay at their defaults")
    if logits.dtype == torch.float64:
        return reference.logprobs_entropy_backward(
            grad_logp, grad_entropy, logits, index, stats, entropy, temperature_t, opts, temperature_grad,
            v_off=v_off, v_total=v_total, out_dtype=out_dtype, threshold=threshold)
    # the saved logits and index as they arrive here: saved-tensor hooks (an offloader) may hand
    # back another layout than the forward's. With ``plans`` this is the whole key.
    key = (tensor_key(grad_logp), tensor_key(grad_entropy), tensor_key(logits), tensor_key(index), _settings_key(),
           temperature_grad, tensor_key(threshold), tensor_key(support))
    if plans is None:
        plans = _BWD_PLANS
        in_place = out is not None and out.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
        key += (opts, tensor_key(temperature_t), v_off, v_total, out_dtype, tensor_key(out), in_place, exact)
    else:
        in_place = False
    plan = plans.get(key)
    if plan is None:
        p = _backward_plan(grad_logp, grad_entropy, logits, index, temperature_t, opts, temperature_grad, v_off, v_total,
                           out_dtype, out, in_place, exact, threshold, support)
        plan = plans.put(key, (p, PlanLaunch(p[-1]._logprobs_entropy_backward_kernel, p[5])))
    plan, go = plan
    dx_dtype, rows, k, copies, scalars, constexprs, grid, K = plan
    # d logits has the logits' full shape; with shift its rows L of every sequence are zero and
    # are written by the same launch (programs past the live rows), never by a second pass
    dx = out if out is not None else new_output(logits.shape, dx_dtype, logits.device)
    has_dt = constexprs["HAS_DT"]
    # without d T: the empty d T (None where the caller does not want it: the eager path)
    dt_dtype = reference.temperature_grad_dtype(logits, temperature_t)
    xdx = (new_output((rows,), torch.float32, logits.device) if has_dt
           else logits.new_empty(0, dtype=dt_dtype) if want_dt else None)
    if grid == 0:
        return dx, reference.temperature_grad(xdx, temperature_t, dt_dtype) if has_dt else xdx
    x_copy, idx_copy, glp_copy, gh_copy = copies
    x = (logits[..., :-1, :] if opts.shift else logits).contiguous() if x_copy else logits
    # the upstream gradients are read through their strides (the expanded ones of a .sum(), stride
    # 0, without a copy); a copy only where their shape does not reshape to [rows, K] as a view.
    # Pointers the launch does not touch are None, as in the forward.
    idx = glp = gh = ent = None
    if constexprs["HAS_GLP"]:
        idx = index.contiguous() if idx_copy else index
        glp = grad_logp.reshape(rows, k) if glp_copy else grad_logp
    if constexprs["HAS_GH"]:
        gh = grad_entropy.reshape(rows) if gh_copy else grad_entropy
        ent = entropy.contiguous()
    tail = dx[..., -1, :] if opts.shift else None  # written with shift only (ZERO_TAIL)
    # the kernel reads the row statistics (and the entropy) as contiguous rows; a saved-tensor
    # hook may hand them back in another layout (contiguous() returns them as they are otherwise)
    tau = None if threshold is None else threshold.contiguous()
    go(grid, x, idx, glp, gh, stats.contiguous(), ent, dx, tail, temperature_t, xdx if has_dt else None, tau, support,
       *scalars)
    return dx, reference.temperature_grad(xdx, temperature_t, dt_dtype) if has_dt else xdx


@torch.library.custom_op(f"{NAMESPACE}::_logprobs_entropy_slice_backward", mutates_args=(), schema=(
    f"(Tensor? grad_logp, Tensor? grad_entropy, Tensor logits, Tensor? index, Tensor stats, Tensor entropy, "
    f"{_OPTS_SCHEMA}, *, SymInt v_off, SymInt v_total) -> Tensor"))
def slice_backward(grad_logp, grad_entropy, logits, index, stats, entropy, *options, v_off, v_total):
    """d logits of a vocabulary slice: ``logits`` holds ids v_off .. of a vocabulary of v_total,
    ``stats`` and ``entropy`` are the whole rows', ``index`` the global ids (the vocabulary-parallel
    ops, torch_fused/parallel.py). One opaque op, so that torch.compile traces the
    vocabulary-parallel backward without entering the launch code."""
    return reference.logprobs_entropy_backward(grad_logp, grad_entropy, logits, index, stats, entropy, None,
                                               Options(*options), v_off=v_off, v_total=v_total)[0]


slice_backward.register_fake(meta.slice_backward_fake)


if TRITON_DEVICES:
    @slice_backward.register_kernel(TRITON_DEVICES)
    def _slice_backward_triton(grad_logp, grad_entropy, logits, index, stats, entropy, *options, v_off, v_total):
        return backward_triton(grad_logp, grad_entropy, logits, index, stats, entropy, None, Options(*options),
                               v_off=v_off, v_total=v_total, want_dt=False)[0]

    logprobs_entropy_forward.register_kernel(TRITON_DEVICES)(_forward_triton)
    logprobs_entropy_backward.register_kernel(TRITON_DEVICES)(_backward_triton)
    inline_under_compile(logprobs_entropy_forward, _forward_triton, vocab_arg=0)
    # with shift, d logits' rows and its zeroed last positions are written through two views of it
    inline_under_compile(logprobs_entropy_backward, _backward_triton, vocab_arg=2,
                         keep_whole=lambda args, kwargs: Options(*args[7:7 + _N_OPTS]).shift)


# ---------------------------------------------------------------------------------------------
# Autograd of the core op
# ---------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output[2])
    logits, index, temperature_t, *rest = inputs
    opts, threshold, support = _split(rest)
    _save(ctx, logits, index, temperature_t, opts, output[1], output[2], threshold, support)


def _save(ctx, logits, index, temperature_t, opts, ent, stats, threshold=None, support=None):
    """What the autograd formula needs: the options and the saved tensors (the sampler's
    threshold and support list, O(rows), where given)."""
    ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: skip its term
    ctx.opts = opts
    # the entropy is an output the caller may modify in place: the backward keeps its own copy
    # (O(rows)), so the outputs behave as the plain formula's do
    ctx.save_for_backward(logits, index, stats, ent.detach().clone() if opts.compute_entropy else ent, temperature_t,
                          threshold, support)


def _backward(ctx, g_logp, g_ent, _g_stats):
    return _gradients(ctx, g_logp, g_ent, _backward_op)


def _backward_op(grad_logp, grad_entropy, logits, index, stats, entropy, temperature_t, opts, temperature_grad, *,
                 threshold=None, support=None):
    return torch.ops.fused._logprobs_entropy_backward(grad_logp, grad_entropy, logits, index, stats, entropy,
                                                      temperature_t, *opts.values(), threshold, support,
                                                      temperature_grad=temperature_grad)


def _gradients(ctx, g_logp, g_ent, backward, saved=None, **extra):
    """The autograd formula of the core, with the backward (the registered op, or on the eager
    fast path its implementation) given as a function of (grads, tensors, temperature_t, opts,
    temperature_grad); ``saved``: ctx.saved_tensors where the caller has unpacked them;
    ``extra``: keyword arguments for an implementation (backward_triton's want_dt, plans).
    One gradient per input of the core op: (logits, index, temperature_t, *options, threshold,
    support)."""
    logits, index, stats, ent, temperature_t, threshold, support = ctx.saved_tensors if saved is None else saved
    needs = ctx.needs_input_grad
    need_x, need_t = needs[0], len(needs) > 2 and needs[2]

    def grads(dx, dt):
        return ((dx if need_x else None, None, dt if need_t else None) + (None,) * (_N_OPTS + 2))[:len(needs)]

    if not (need_x or need_t):
        return grads(None, None)
    if index is None:
        g_logp = None
    if not ctx.opts.compute_entropy:
        g_ent = None
    if g_logp is None and g_ent is None:
        return grads(torch.zeros_like(logits) if need_x else None,
                     torch.zeros_like(temperature_t) if need_t else None)
    # a tensor temperature reaches the backward whether or not it requires grad: it is the T of
    # the d logits too (the float temperature is then only a placeholder); its gradient's row
    # partials are computed only where it requires grad
    if threshold is not None:
        extra = dict(extra, threshold=threshold, support=support)
    dx, dt = backward(g_logp, g_ent, logits, index, stats, ent, temperature_t, ctx.opts, bool(need_t), **extra)
    return grads(dx, dt.to(temperature_t.dtype) if need_t else None)


_setup_context, _backward = under_forward_settings(_setup_context, _backward)
logprobs_entropy_forward.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# Eager fast path. An eager call through the dispatcher runs several Python layers around the
# implementation (the composite public op, custom_op's autograd wrapper, its backend wrapper,
# the backward op's dispatch): on a small input they cost several times the kernels. The public
# functions (torch_fused.selective_log_softmax, ...) call the same implementations and the same
# autograd formula through one torch.autograd.Function instead, when nothing else needs to see
# the op: not while torch.compile traces, not under a dispatch or torch-function mode (fake
# tensors, make_fx, FlopCounterMode, torch.device(...)), not inside a functorch transform,
# torch.jit.trace or a forward-AD level, and only for plain tensors. Everything else, and every torch.ops.fused call,
# goes through the registered op. Both reach the kernels through the same host code
# (_forward_run, backward_triton) with the same options.
# ---------------------------------------------------------------------------------------------
# the eager path's implementations: no empty tensor allocated for an output the node does not
# return (the log-probs without an index, the entropy where it is not computed) or for d T of a
# float temperature (the formula drops it)
def _eager_forward(logits, index, temperature_t, opts):
    """(logp, entropy, stats, backward plans or None): _forward_run without placeholders on a
    Triton device, else the default implementation (no backward plans)."""
    if on_triton(logits):
        return _forward_run(logits, index, temperature_t, opts, False)
    return _forward_default(logits, index, temperature_t, opts) + (None,)


def _eager_backward(logits):
    """The backward implementation for the eager path's saved logits (without backward plans)."""
    return _backward_triton_eager if on_triton(logits) else _backward_default


_backward_triton_eager = functools.partial(backward_triton, want_dt=False)


def public_outputs(index, compute_entropy, output):
    """The public function's result from the core's (logp, entropy, stats): the entropy alone
    without an index, the log-probs alone without the entropy, else both. The one selection of
    the public ops and of the eager path (whose node's backward inverts it)."""
    if index is None:
        return output[1]
    return (output[0], output[1]) if compute_entropy else output[0]


class _EagerCore(torch.autograd.Function):
    """The core's implementation and autograd formula, returning only the public function's
    outputs (public_outputs): the stats, and the entropy where it is not returned, stay
    intermediates of the node (fewer outputs for autograd to wrap and hand back per call). Its
    inputs are the core op's, with the options as one object: (logits, index, temperature_t, opts)."""

    # forward with ctx (no separate setup_context): Function.apply then skips binding the
    # arguments by inspect.signature, which costs more than the rest of a small call
    @staticmethod
    def forward(ctx, logits, index, temperature_t, opts):
        output = _eager_forward(logits, index, temperature_t, opts)
        ctx.settings = settings_snapshot()
        _save(ctx, logits, index, temperature_t, opts, output[1], output[2])
        ctx.has_index = index is not None
        ctx.plans = output[3]  # the backward's launch plans for this forward's key (None: none kept)
        return public_outputs(index, opts.compute_entropy, output)

    @staticmethod
    def backward(ctx, *grads):
        with settings_restored(ctx.settings):  # the forward's settings, on any thread
            return _EagerCore._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx, *grads):
        # the public outputs' gradients back in the core's places
        if not ctx.has_index:  # the entropy alone
            g_logp, g_ent = None, grads[0]
        elif ctx.opts.compute_entropy:
            g_logp, g_ent = grads
        else:
            g_logp, g_ent = grads[0], None
        saved = ctx.saved_tensors  # unpacked once: each unpack makes new tensor objects
        if torch.is_grad_enabled():
            # create_graph=True: the registered backward op, which has no autograd formula, so a
            # second backward through d logits raises as on the op path (once_differentiable
            # would not: it looks at the upstream gradients only, which need not require grad,
            # and a second derivative through the saved logits would silently be zero). Its
            # schema takes a tensor for the entropy the eager forward did not make.
            if saved[3] is None:
                saved = saved[:3] + (saved[2].new_empty(0),) + saved[4:]
            return _gradients(ctx, g_logp, g_ent, _backward_op, saved)
        if ctx.plans is not None:
            return _gradients(ctx, g_logp, g_ent, backward_triton, saved, want_dt=False, plans=ctx.plans)
        return _gradients(ctx, g_logp, g_ent, _eager_backward(saved[0]), saved)


def _eager_implementation(logits, index, temperature_t, opts):
    return public_outputs(index, opts.compute_entropy, _eager_forward(logits, index, temperature_t, opts))


def eager_core(name, logits, index, temperature_t, opts):
    """The public function's result (public_outputs) by the eager fast path; ``name``: the public
    op's, for the profiler's record. Where no gradient can flow (no_grad, or no input requires
    grad) the implementation runs without the autograd.Function (and without the entropy copy it
    saves)."""
    return call_eager(name, (logits, temperature_t), _EagerCore.apply, _eager_implementation,
                      logits, index, temperature_t, opts)


# ---------------------------------------------------------------------------------------------
# Public ops (composite over the core). Inputs are checked once, by the core op's
# implementations and its fake: the same message in eager and compiled calls. A tensor
# temperature (``temperature_tensor``, 0-dim, read on the device and differentiated) replaces the
# float one when given. Their keyword-only arguments are the options' public fields
# (LogprobOptions.public_schema_tail), then the tensor temperature.
# ---------------------------------------------------------------------------------------------
_TAIL = Options.public_schema_tail()
LIB.define(
    "selective_log_softmax(Tensor logits, Tensor index, float temperature=1.0, int ignore_index=-100, "
    f"{_TAIL}) -> Tensor"
)
LIB.define(f"entropy_from_logits(Tensor logits, float temperature=1.0, {_TAIL}) -> Tensor")
LIB.define(
    "logprobs_and_entropy(Tensor logits, Tensor index, float temperature=1.0, int ignore_index=-100, "
    f"{_TAIL}) -> (Tensor, Tensor)"
)
_core = torch.ops.fused._logprobs_entropy_forward


def _restricted_core(logits, index, temperature_t, opts):
    """The core op's outputs over the sampler's support: the rows' thresholds and support lists
    (``fused::_sampler_threshold``, ops/sampler.py; the rule: reference.sampler_threshold), then
    the core op restricted to each row's logits >= its threshold (no masked copy of the logits),
    ids outside the support scored -inf with no gradient. Without sampler options: the core op
    itself."""
    meta.check_sampler(opts)
    if not opts.restricts_support():
        return _core(logits, index, temperature_t, *opts.values())
    # the thresholds are constants of the step: computed from the detached logits
    tau, support = torch.ops.fused._sampler_threshold(
        logits.detach(), None if temperature_t is None else temperature_t.detach(), opts.temperature, opts.shift,
        opts.top_k, opts.top_p, opts.min_p)
    logp, ent, stats = _core(logits, index, temperature_t, *opts.values(), tau, support)
    if index is not None:
        # -inf there already, and the core passes no gradient through such an id; the where
        # states it at the public op (a gather of the ids' logits, O(index))
        outside = reference.sampler_outside(logits, index, tau, opts)
        logp = torch.where(outside, torch.full((), float("-inf"), dtype=logp.dtype, device=logp.device), logp)
    return logp, ent, stats


def _composite(name, index, compute_entropy):
    """The public op ``name``'s composite implementation: its options from its arguments, the
    core op on them, the public outputs."""
    positional = ("index", "temperature", "ignore_index") if index else ("temperature",)

    def implementation(logits, *args, temperature_tensor=None, **keywords):
        given = dict(zip(positional, args))
        for k in positional:
            if k in keywords:
                given[k] = keywords.pop(k)
        opts = Options(temperature=given.get("temperature", 1.0), ignore_index=given.get("ignore_index", -100),
                       compute_entropy=compute_entropy, **keywords)
        idx = given.get("index")
        no_forward_mode(name, logits, temperature_tensor)
        return public_outputs(idx, compute_entropy, _restricted_core(logits, idx, temperature_tensor, opts))

    LIB.impl(name, implementation, "CompositeImplicitAutograd")


_composite("selective_log_softmax", index=True, compute_entropy=False)
_composite("entropy_from_logits", index=False, compute_entropy=True)
_composite("logprobs_and_entropy", index=True, compute_entropy=True)
