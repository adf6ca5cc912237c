"""fused::mask_reduce: sum over one dim of x * scale where mask != 0; broadcast (stride-0)
mask and scale are never materialized, in the kernel or around it.

Gradient: d x only (dx = dy broadcast over dim, times scale, 0 where masked). mask and scale get
no gradient: the mask is discrete, and scale in the MoE-combine and loss-weighting uses is a
routing weight or a constant whose gradient users take from their own graph if they need it.
"""

from __future__ import annotations

import torch

from .._library import NAMESPACE, TRITON_DEVICES, acc_dtype, n_sm, new_output
from .. import reference
from ..meta import mask_reduce as meta


@torch.library.custom_op(f"{NAMESPACE}::mask_reduce", mutates_args=())
def mask_reduce(
    x: torch.Tensor,
    dim: int,
    mask: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    meta.check_mask_reduce(x, dim, mask, scale, out_dtype)
    return reference.mask_reduce_forward(x, dim, mask, scale, out_dtype)


@torch.library.custom_op(f"{NAMESPACE}::mask_reduce_backward", mutates_args=())
def mask_reduce_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    dim: int,
    mask: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return reference.mask_reduce_backward(grad, x, dim, mask, scale)


mask_reduce.register_fake(meta.mask_reduce_fake)
mask_reduce_backward.register_fake(meta.mask_reduce_backward_fake)


def _operand(t, shape, d):
    """(tensor, (stride_r, stride_0, stride_1, stride_i)) of t broadcast to shape, reduce dim d
    first; outer output dims padded in front to two. Views only, stride 0 kept."""
    t = torch.broadcast_to(t, shape)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    st = list(t.stride())
    r = st.pop(d)
    while len(st) < 3:
        st.insert(0, 0)
    return t, (r, *st)


def _mask_reduce_triton(x, dim, mask=None, scale=None, out_dtype=None):
    d = meta.check_mask_reduce(x, dim, mask, scale, out_dtype)
    from ..kernels import mask_reduce as K

    shape = tuple(x.shape)
    out_shape = shape[:d] + shape[d + 1:]
    y = new_output(out_shape, out_dtype or x.dtype, x.device)
    if y.numel() == 0:
        return y
    if shape[d] == 0:
        return y.zero_()
    osz = list(out_shape)
    while len(osz) < 3:
        osz.insert(0, 1)
    o0, o1, i = osz
    r = shape[d]
    xt, sx = _operand(x, shape, d)
    mt, sm = _operand(mask, shape, d) if mask is not None else (x, (0, 0, 0, 0))
    sc, ss = _operand(scale, shape, d) if scale is not None else (x, (0, 0, 0, 0))
    r_contig = sx[0] == 1 and sx[3] != 1
    # predicate x on the mask only where the mask is constant along x's fast axis
    pred_x = mask is not None and ((sm[0] == 0) if r_contig else (sm[3] == 0))
    # a mask broadcast over an output dim is read by several programs: keep it in L2 for them
    m_outer = mask is not None and ((sm[1] == 0 and o0 > 1) or (sm[2] == 0 and o1 > 1))
    m_shared = K.EVICT_HINTS and mask is not None and (m_outer or (sm[3] == 0 and i > 1))
    block_r, block_i, warps, vec, pipeline, u = K.pick_blocks(r, i, o0 * o1, r_contig, x.element_size(), n_sm(x.device))
    n_iblk = K._cdiv(i, block_i)
    # in-tile offsets fit 32 bits unless a tile spans more than 2**31 elements of some operand
    span = max(abs(st[0]) * block_r * u + abs(st[3]) * block_i for st in (sx, sm, ss))
    K._mask_reduce_forward_kernel[(o0 * o1 * n_iblk,)](
        xt, mt, sc, y,
        r, o1, i, n_iblk, o0 * o1,
        *sx, *sm, *ss,
        HAS_MASK=mask is not None, HAS_SCALE=scale is not None,
        ACC_F64=acc_dtype(x.dtype) == torch.float64,
        M_BCAST_R=sm[0] == 0, M_BCAST_I=sm[3] == 0, S_BCAST_R=ss[0] == 0, S_BCAST_I=ss[3] == 0,
        PRED_X=pred_x, WIDE=span >= 2**31, BLOCK_R=block_r, BLOCK_I=block_i, VEC=vec,
        M_EVICT="evict_last" if m_shared else "", X_EVICT="evict_first" if m_shared else "",
        PIPELINE=pipeline, U=u, OUTER_FIRST=K.OUTER_FIRST and m_outer,
        EVEN=r % (block_r * u) == 0 and i % block_i == 0, num_warps=warps,
    )
    return y


if TRITON_DEVICES:
    mask_reduce.register_kernel(TRITON_DEVICES)(_mask_reduce_triton)


def _setup_context(ctx, inputs, output):
    x, dim, mask, scale, _ = inputs
    ctx.dim = dim
    ctx.save_for_backward(x, mask, scale)


def _backward(ctx, grad):
    x, mask, scale = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    dx = torch.ops.fused.mask_reduce_backward(grad, x, ctx.dim, mask, scale)
    return dx, None, None, None, None


mask_reduce.register_autograd(_backward, setup_context=_setup_context)
