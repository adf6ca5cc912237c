"""Input checks and fake implementations of fused::mask_reduce (shapes and dtypes only).

``check_mask_reduce`` is the one validation function: the op and its fake implementation call it,
and so do the helpers of ``torch_fused.masked`` (with their own argument names) before they
dispatch, so an eager call and a call traced by ``torch.compile`` fail with the same message.
"""

from __future__ import annotations

import torch

from .._library import FLOAT_DTYPES

# fused::mask_reduce keeps an element where mask != 0, whatever the mask's dtype (its mask
# selects: 0.5 and NaN keep their element at weight 1; weights go in ``scale``). The helpers of
# torch_fused.masked pass a floating mask as the scale too, so that there it weighs.
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64) + FLOAT_DTYPES


def _check(cond, message) -> None:
    """``torch._check(cond, message)``, raising in Python where ``cond`` is a plain False.

    Dynamo traces the masked helpers' checks; it re-raises an exception raised in the traced code
    with its message, but it cannot turn a ``torch._check`` message closure that reads a tensor
    or a size into a constant, and then reports that failure instead of the message."""
    if cond is True:
        return
    if cond is False:
        raise RuntimeError(message())  # what torch._check raises
    # A SymBool while tracing: a check on a dynamic int (a ``dim`` that changed between calls)
    # or size. Deciding it here guards the compiled graph on the outcome, and a failure raises
    # the message itself; torch._check would need a closure of constants only.
    if not cond:
        raise RuntimeError(message())


def _broadcastable(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    for s, t in zip(reversed(tuple(shape)), reversed(tuple(target))):
        if not (s == t or s == 1):
            return False
    return True


def check_dim_type(dim) -> None:
    """``dim`` is an int (a SymInt while tracing). The public helpers check it before dispatch too:
    under torch.compile the op's schema would reject it first, with torch's own message."""
    _check(isinstance(dim, (int, torch.SymInt)), lambda: f"dim: expected an int, got {type(dim).__name__}")


def check_mask_reduce(x, dim, mask, scale, out_dtype, *, x_name: str = "x") -> int:
    """Validate and return dim normalized to [0, x.dim()). Messages name x as ``x_name``, so a
    helper that reduces its ``loss`` argument reports ``loss``."""
    _check(x.dtype in FLOAT_DTYPES,
           lambda: f"{x_name}: expected dtype float16, bfloat16, float32 or float64, got {x.dtype}")
    _check(1 <= x.dim() <= 4, lambda: f"{x_name}: expected 1 to 4 dims, got {x.dim()} (shape {tuple(x.shape)})")
    check_dim_type(dim)
    _check(-x.dim() <= dim < x.dim(),
           # int(dim): Dynamo cannot format a dynamic int (a SymInt) into a string on every torch
           # version; int() specializes it, which only this failing call sees
           lambda: f"dim: expected a dim of {x_name} in [{-x.dim()}, {x.dim()}), got {int(dim)}")
    mask_kind = "bool, integer or floating"
    for name, t, dtypes, kind in (("mask", mask, MASK_DTYPES, mask_kind), ("scale", scale, FLOAT_DTYPES, "floating")):
        if t is None:
            continue
        _check(t.dtype in dtypes, lambda: f"{name}: expected a {kind} dtype, got {t.dtype}")
        _check(t.device == x.device,
               lambda: f"{name}: expected device {x.device} (the device of {x_name}), got {t.device}")
        _check(_broadcastable(t.shape, x.shape),
               lambda: f"{name}: shape {tuple(t.shape)} does not broadcast to {x_name} of shape {tuple(x.shape)}")
    _check(out_dtype is None or out_dtype in FLOAT_DTYPES,
           lambda: f"out_dtype: expected None or a floating dtype, got {out_dtype}")
    return dim % x.dim()


def mask_reduce_fake(x, dim, mask=None, scale=None, out_dtype=None):
    d = check_mask_reduce(x, dim, mask, scale, out_dtype)
    shape = tuple(x.shape[:d]) + tuple(x.shape[d + 1:])
    return x.new_empty(shape, dtype=out_dtype or x.dtype)


def mask_reduce_backward_fake(grad, x, dim, mask=None, scale=None):
    check_mask_reduce(x, dim, mask, scale, None)
    return x.new_empty(x.shape)


def mask_weight_fake(mask, shape, dim, dtype):
    d = dim % len(shape)
    return mask.new_empty(tuple(shape[:d]) + tuple(shape[d + 1:]), dtype=dtype)


CU_SEQLENS_DTYPES = (torch.int32, torch.int64)


def check_cu_seqlens(cu_seqlens, x, dim: int, *, x_name: str = "x") -> None:
    """What can be checked of ``cu_seqlens`` without reading its values: a 1-D int32 (or int64)
    tensor ``[S+1]`` on the device of ``x``, whose ``dim`` it splits into S sequences. Its values
    (0 first, non-decreasing, ``x.shape[dim]`` last) are data: ``torch_fused.packed`` checks them
    where that costs no device sync."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected an int32 tensor [S+1] (FlashAttention's cumulative sequence "
                        f"lengths), got {type(cu_seqlens).__name__}")
    _check(cu_seqlens.dtype in CU_SEQLENS_DTYPES,
           lambda: f"cu_seqlens: expected dtype int32 (or int64), got {cu_seqlens.dtype}")
    _check(cu_seqlens.dim() == 1,
           lambda: f"cu_seqlens: expected a 1-D tensor [S+1], got shape {tuple(cu_seqlens.shape)}")
    _check(cu_seqlens.shape[0] >= 1,
           lambda: "cu_seqlens: expected at least one value (S+1 values for S sequences, 0 first), got an empty tensor")
    _check(cu_seqlens.device == x.device,
           lambda: f"cu_seqlens: expected device {x.device} (the device of {x_name}), got {cu_seqlens.device}")
