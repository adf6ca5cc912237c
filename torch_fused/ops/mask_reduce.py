"""fused::mask_reduce: sum over one dim of x * scale where mask != 0; broadcast (stride-0)
mask and scale are never materialized, in the kernel or around it.

Gradient: d x only (dx = dy broadcast over dim, times scale, 0 where masked). mask and scale get
no gradient: the mask is discrete, and scale in the MoE-combine and loss-weighting uses is a
routing weight or a constant whose gradient users take from their own graph if they need it.
"""

from __future__ import annotations

from typing import List

import torch

from .._library import (NAMESPACE, TRITON_DEVICES, PlanLaunch, Plans, acc_dtype, call_eager, n_sm, new_output,
                        on_triton, tensor_key, under_forward_settings)
from ..settings import values as _settings_values
from .. import reference
from ..meta import mask_reduce as meta


def _mask_reduce_default(
    x: torch.Tensor,
    dim: int,
    mask: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    meta.check_mask_reduce(x, dim, mask, scale, out_dtype)
    return reference.mask_reduce_forward(x, dim, mask, scale, out_dtype)


# the default implementation serves every device without a Triton one (CPU)
mask_reduce = torch.library.custom_op(f"{NAMESPACE}::mask_reduce", mutates_args=())(_mask_reduce_default)


@torch.library.custom_op(f"{NAMESPACE}::mask_reduce_backward", mutates_args=())
def mask_reduce_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    dim: int,
    mask: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return reference.mask_reduce_backward(grad, x, dim, mask, scale)


@torch.library.custom_op(f"{NAMESPACE}::_mask_weight", mutates_args=())
def mask_weight(mask: torch.Tensor, shape: List[int], dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Sum along ``dim`` of the weights of ``mask`` broadcast to ``shape`` (the masked helpers'
    denominators), in ``dtype``: a floating mask's values, 1 where a bool or integer mask is
    nonzero. Summed on the mask's stored elements. An op, so that the strides it reads are always
    those of a real tensor, never of a compiled graph's intermediate; one plain-PyTorch
    implementation serves every device (its work is the stored mask's size)."""
    return reference.mask_weight(mask, shape, dim, dtype)


mask_weight.register_fake(meta.mask_weight_fake)


def _mask_weight_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output)  # the helpers differentiate the values: no gradient reaches a mask


mask_weight.register_autograd(lambda ctx, grad: (None, None, None, None), setup_context=_mask_weight_setup)
mask_reduce.register_fake(meta.mask_reduce_fake)
mask_reduce_backward.register_fake(meta.mask_reduce_backward_fake)


_PLANS = Plans()


def _plan(x, dim, mask, scale, out_dtype):
    """What the checks and the layout arithmetic of a call conclude, for the calls of its key:
    (out shape, out dtype, reduce length, grid size, the reduce kernel's scalar arguments, its
    launch, COMPACT's (lists, their launch, its scalar arguments) or None). Raises on bad input."""
    d = meta.check_mask_reduce(x, dim, mask, scale, out_dtype)
    from ..kernels import mask_reduce as K

    shape = tuple(x.shape)
    out_shape = shape[:d] + shape[d + 1:]
    osz = list(out_shape)
    while len(osz) < 3:
        osz.insert(0, 1)
    o0, o1, i = osz
    r = shape[d]
    sx = _strides(x, shape, d)
    sm = _strides(mask, shape, d) if mask is not None else None
    ss = _strides(scale, shape, d) if scale is not None else None
    n_iblk, constexprs, warps = K.launch_config(r, o0, o1, i, sx, sm, ss, x.element_size(),
                                                acc_dtype(x.dtype) == torch.float64, n_sm(x.device))
    row_ids = None  # COMPACT: (lists, their launch, its scalar arguments)
    lst_0 = lst_1 = 0
    options = {}
    if constexprs["COMPACT"]:
        # the kept rows of each distinct row mask, listed (one small launch over the mask alone);
        # where the tiles ask for it, on Hopper and later, the reduce is launched while the
        # listing runs (programmatic dependent launch)
        pdl = (constexprs["PDL"] and K.HAS_PDL and x.device.type == "cuda" and torch.version.hip is None
               and torch.cuda.get_device_capability(x.device)[0] >= 9)
        constexprs = dict(constexprs, PDL=pdl)
        options = dict(launch_pdl=True) if pdl else {}
        n0, n1, lst_0, lst_1 = K.row_id_lists(o0, o1, sm)
        row_ids = (n0 * n1, PlanLaunch(K._row_ids_kernel, dict(BLOCK=K.row_ids_block(r), PDL=pdl, num_warps=4)),
                   (r, n1, sm[0], sm[1], sm[2]))
    scalars = (r, o1, i, n_iblk, o0 * o1, *sx, *(sm or (0, 0, 0, 0)), *(ss or (0, 0, 0, 0)), lst_0, lst_1)
    reduce = PlanLaunch(K._mask_reduce_forward_kernel, dict(constexprs, num_warps=warps, **options))
    return out_shape, out_dtype or x.dtype, r, o0 * o1 * n_iblk, scalars, reduce, row_ids


def _strides(t, shape, d):
    """(stride_r, stride_0, stride_1, stride_i) of t broadcast to shape, reduce dim d first; outer
    output dims padded in front to two. Stride 0 kept (a broadcast operand is never materialized)."""
    st = list(torch.broadcast_to(t, shape).stride())
    r = st.pop(d)
    while len(st) < 3:
        st.insert(0, 0)
    return (r, *st)


def _mask_reduce_triton(x, dim, mask=None, scale=None, out_dtype=None):
    key = (tensor_key(x), x.device, dim, type(dim), tensor_key(mask), mask is not None and mask.device, tensor_key(scale),
           scale is not None and scale.device, out_dtype, _settings_key())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _plan(x, dim, mask, scale, out_dtype))
    out_shape, y_dtype, r, grid, scalars, reduce, row_ids = plan
    y = new_output(out_shape, y_dtype, x.device)
    if grid == 0:
        return y
    if r == 0:
        return y.zero_()
    # the kernels read each operand at its own data pointer through the plan's (broadcast) strides
    m = None if mask is None else mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    rid = cnt = None
    if row_ids is not None:
        lists, list_rows, list_scalars = row_ids
        rid = torch.empty((lists, r), dtype=torch.int32, device=x.device)
        cnt = torch.empty((lists,), dtype=torch.int32, device=x.device)
        list_rows(lists, m, rid, cnt, *list_scalars)
    reduce(grid, x, m if m is not None else x, scale if scale is not None else x, y, rid, cnt, *scalars)
    return y


def _settings_key():
    """The settings a plan depends on (the tiles, through launch_config)."""
    from ..kernels import mask_reduce as K

    return _settings_values()["small_tiles"], K.tiles_key()


if TRITON_DEVICES:
    mask_reduce.register_kernel(TRITON_DEVICES)(_mask_reduce_triton)


def _setup_context(ctx, inputs, output):
    x, dim, mask, scale, _ = inputs
    ctx.dim = dim
    ctx.save_for_backward(x, mask, scale)


def _backward(ctx, grad):
    return _gradients(ctx, grad, torch.ops.fused.mask_reduce_backward)


def _gradients(ctx, grad, backward_op):
    """The autograd formula, with the backward op (or, on the eager fast path, its
    implementation) given."""
    x, mask, scale = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    return backward_op(grad, x, ctx.dim, mask, scale), None, None, None, None


_op_setup, _op_backward = under_forward_settings(_setup_context, _backward)
mask_reduce.register_autograd(_op_backward, setup_context=_op_setup)


# Eager fast path (as the log-prob ops': ops/logprobs.py): torch_fused.mask_reduce calls the
# implementation and this autograd formula without the dispatcher when nothing needs the op.
def _forward_impl(x: torch.Tensor):
    return _mask_reduce_triton if on_triton(x) else _mask_reduce_default


_eager_setup, _eager_backward = under_forward_settings(
    _setup_context, lambda ctx, grad: _gradients(ctx, grad, reference.mask_reduce_backward))


class _EagerMaskReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, mask, scale, out_dtype):
        y = _forward_impl(x)(x, dim, mask, scale, out_dtype)
        _eager_setup(ctx, (x, dim, mask, scale, out_dtype), y)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # as the backward op: no double backward
    def backward(ctx, grad):
        return _eager_backward(ctx, grad)


def eager_mask_reduce(x, dim, mask, scale, out_dtype):
    """fused::mask_reduce by the eager fast path (the caller checked eager_eligible)."""
    return call_eager("fused::mask_reduce", (x, mask, scale), _EagerMaskReduce.apply, _forward_impl(x),
                      x, dim, mask, scale, out_dtype)
