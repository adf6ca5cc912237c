"""Input checks and fake implementations of fused::mask_reduce (shapes and dtypes only)."""

from __future__ import annotations

import torch

from .._library import FLOAT_DTYPES, check

MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _broadcastable(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    for s, t in zip(reversed(tuple(shape)), reversed(tuple(target))):
        if not (s == t or s == 1):
            return False
    return True


def check_mask_reduce(x, dim, mask, scale, out_dtype) -> int:
    """Validate and return dim normalized to [0, x.dim())."""
    check(x.dtype in FLOAT_DTYPES,
          lambda: f"x: expected dtype float16, bfloat16, float32 or float64, got {x.dtype}")
    check(1 <= x.dim() <= 4, lambda: f"x: expected 1 to 4 dims, got {x.dim()} (shape {tuple(x.shape)})")
    check(-x.dim() <= dim < x.dim(), lambda: f"dim: expected a dim of x in [{-x.dim()}, {x.dim()}), got {dim}")
    for name, t, dtypes, kind in (("mask", mask, MASK_DTYPES, "bool or integer"), ("scale", scale, FLOAT_DTYPES, "floating")):
        if t is None:
            continue
        check(t.dtype in dtypes, lambda: f"{name}: expected a {kind} dtype, got {t.dtype}")
        check(t.device == x.device, lambda: f"{name}: expected device {x.device} (x's device), got {t.device}")
        check(_broadcastable(t.shape, x.shape),
              lambda: f"{name}: shape {tuple(t.shape)} does not broadcast to x's shape {tuple(x.shape)}")
    check(out_dtype is None or out_dtype in FLOAT_DTYPES,
          lambda: f"out_dtype: expected None or a floating dtype, got {out_dtype}")
    return dim % x.dim()


def mask_reduce_fake(x, dim, mask=None, scale=None, out_dtype=None):
    d = check_mask_reduce(x, dim, mask, scale, out_dtype)
    shape = tuple(x.shape[:d]) + tuple(x.shape[d + 1:])
    return x.new_empty(shape, dtype=out_dtype or x.dtype)


def mask_reduce_backward_fake(grad, x, dim, mask=None, scale=None):
    check_mask_reduce(x, dim, mask, scale, None)
    return x.new_empty(x.shape)
