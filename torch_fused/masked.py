"""Helpers built on fused::mask_reduce: the op's cost model, masked means and the RL loss
aggregations. None of them materializes a broadcast mask."""

from __future__ import annotations

import torch

from ._library import acc_dtype, eager_eligible, is_dtensor
from .ops.mask_reduce import eager_mask_reduce
from .meta.mask_reduce import _check, check_dim_type, check_mask_reduce
from .reference import stored_view

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _on_replicated(fn, tensors: dict, *args):
    """``fn(*locals, *args)`` as a ``Replicate()`` DTensor when any of ``tensors`` (name -> tensor
    or None, in fn's argument order) is a DTensor, as the vocab-parallel functions return them;
    None otherwise. Every DTensor among them must be replicated on one mesh: the helpers reduce
    over dims that are not sharded, so each rank computes the whole result from its copy."""
    if not any(is_dtensor(t) for t in tensors.values()):
        return None
    from torch.distributed.tensor import DTensor, Replicate

    mesh = None
    local = []
    for name, t in tensors.items():
        if is_dtensor(t):
            if not all(isinstance(p, Replicate) for p in t.placements):
                raise ValueError(f"{name}: expected a DTensor with Replicate() placements (as the vocab-parallel "
                                 f"functions return), got {tuple(t.placements)}; call .full_tensor() or redistribute "
                                 "it first")
            if mesh is not None and t.device_mesh != mesh:
                raise ValueError(f"{name}: on another device mesh than the other DTensor arguments")
            mesh = t.device_mesh
            t = t.to_local()
        local.append(t)
    out = fn(*local, *args)
    return DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)


def mask_reduce(x, dim, mask=None, scale=None, *, out_dtype=None):
    """Sum over ``dim`` of ``x * scale`` where ``mask != 0``.

    Args:
        x: 1 to 4 dims; float16, bfloat16, float32 or float64.
        dim: the dim to reduce.
        mask: bool or integer, broadcastable to ``x`` (any strides, stride 0 included: an
            ``expand``ed view is read from its stored elements only). ``None`` keeps everything.
        scale: floating, broadcastable to ``x``, same rules. ``None`` means 1.
        out_dtype: dtype of the result; default ``x.dtype``. Accumulation is float32 (float64
            for float64 x) whatever the output dtype.

    Masked-off elements are never read: a NaN or inf there does not reach the result.
    Gradient flows to ``x`` only (``dx = dy`` broadcast over ``dim``, times ``scale``, 0 where
    masked); ``mask`` and ``scale`` get none.
    """
    check_dim_type(dim)
    out = _on_replicated(lambda x, m, s: mask_reduce(x, dim, m, s, out_dtype=out_dtype),
                         dict(x=x, mask=mask, scale=scale))
    if out is not None:
        return out
    if eager_eligible(x, mask, scale):
        return eager_mask_reduce(x, dim, mask, scale, out_dtype)
    return torch.ops.fused.mask_reduce(x, dim, mask, scale, out_dtype)


def mask_reduce_cost(x: torch.Tensor, dim: int, mask: torch.Tensor | None = None,
                     scale: torch.Tensor | None = None) -> dict:
    """What ``mask_reduce(x, dim, mask, scale)`` loads, adds and moves, counted on the stored
    elements of broadcast views (a stride-0 dim is counted once and multiplied by its repeats);
    nothing of the logical size is allocated. Reads the mask's stored values (a device sync on
    CUDA) to count the kept elements.

    Returns a dict:
        elements: x.numel(); kept: elements where mask != 0 (x loads and adds performed);
        mask_stored / scale_stored: stored elements read for mask / scale;
        loads: kept + mask_stored + scale_stored; adds: kept;
        floor_bytes: x read once + stored mask and scale bytes + y written (the benchmark floor);
        bytes: the same with only the kept x elements read (what the kernel moves at best);
        materialized_mask_bytes: what a copy of the broadcast mask alone would take.

    Its arguments are checked as mask_reduce's (the same errors).
    """
    d = check_mask_reduce(x, dim, mask, scale, None)
    shape = tuple(x.shape)
    out_elems = 1
    for i, s in enumerate(shape):
        if i != d:
            out_elems *= s
    m = stored_view(mask, shape)
    s = stored_view(scale, shape)
    if m is None:
        kept = x.numel()
    else:
        repeats = x.numel() // max(m.numel(), 1) if m.numel() else 0
        kept = int((m != 0).sum().item()) * repeats
    mask_stored = 0 if m is None else m.numel()
    scale_stored = 0 if s is None else s.numel()
    side = mask_stored * (mask.element_size() if mask is not None else 0) + scale_stored * (
        scale.element_size() if scale is not None else 0)
    y_bytes = out_elems * x.element_size()
    return dict(
        elements=x.numel(),
        kept=kept,
        mask_stored=mask_stored,
        scale_stored=scale_stored,
        loads=kept + mask_stored + scale_stored,
        adds=kept,
        floor_bytes=x.numel() * x.element_size() + side + y_bytes,
        bytes=kept * x.element_size() + side + y_bytes,
        materialized_mask_bytes=0 if mask is None else x.numel() * mask.element_size(),
    )


def _count(mask: torch.Tensor, shape, dim: int) -> torch.Tensor:
    """Number of mask != 0 entries along dim, shaped like the reduction; float32. One op
    (fused::_mask_count) that reads the stored elements only: the helpers never read the strides
    of a tensor themselves, since under torch.compile a mask may be an intermediate whose layout
    the compiler chooses."""
    return torch.ops.fused._mask_count(mask, list(shape), dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask != 0``, over ``dim`` (all elements when None).

    Args:
        values: 0 to 4 dims (1 to 4 with ``dim``); float16, bfloat16, float32 or float64.
        mask: bool, integer or floating, broadcastable to ``values`` (stride-0 views are read
            from their stored elements). An element is kept where ``mask != 0``, whatever the
            value: ``mask.float()`` of a bool mask works, and a non-binary float such as 0.5 (or
            -1, or NaN) keeps its element with weight 1. The mask selects; it never weights.
        dim: the dim to average over, or None for all elements.

    float32 result (float64 for float64 values). Where the mask keeps nothing the mean is 0,
    never NaN (TRL's masked_mean would give NaN there).

    ``Replicate()`` DTensors (the vocab-parallel functions' outputs) are accepted for ``values``
    and ``mask``; the result is then a ``Replicate()`` DTensor (the same for ``aggregate_loss``
    and ``mask_reduce``)."""
    out = _on_replicated(masked_mean, dict(values=values, mask=mask), dim)
    if out is not None:
        return out
    out_dtype = acc_dtype(values.dtype)
    if dim is None and values.dim() == 0:
        values = values.reshape(1)
        mask = mask.reshape(1) if mask.dim() == 0 else mask
    d = values.dim() - 1 if dim is None else dim
    check_mask_reduce(values, d, mask, None, None, x_name="values")
    shape = tuple(values.shape)
    total = mask_reduce(values, d, mask, out_dtype=out_dtype)
    count = _count(mask, shape, d)
    if dim is None:
        return total.sum() / count.sum().clamp_min(1)
    return total / count.to(out_dtype).clamp_min(1)


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Reduce a per-token loss ``[B, L]`` under a ``[B, L]`` (or broadcastable) mask to a scalar.

    ``mask`` is bool, integer or floating; a token is kept where ``mask != 0``, whatever the value
    (``mask.float()`` works, and a non-binary float such as 0.5 keeps its token with weight 1:
    the mask selects, it never weights).

    With S_b = sum of loss over the kept tokens of row b, N_b = their count, B rows,
    L = loss.shape[-1]:
        token-mean:               sum_b S_b / max(sum_b N_b, 1)
        seq-mean-token-mean:      sum over rows with N_b > 0 of S_b / N_b, divided by
                                  max(#rows with N_b > 0, 1)  (empty rows are left out)
        seq-mean-token-sum:       sum_b S_b / B
        seq-mean-token-sum-norm:  sum_b S_b / L  (Dr. GRPO / veRL: a constant normalizer)
    No mode gives NaN for rows whose mask is all zero. Errors name ``loss``, ``mask`` and
    ``mode`` (RuntimeError; ValueError for an unknown mode), eagerly and under torch.compile.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"mode: expected one of {AGG_MODES}, got {mode!r}")
    out = _on_replicated(aggregate_loss, dict(loss=loss, mask=mask), mode)
    if out is not None:
        return out
    _check(loss.dim() == 2, lambda: f"loss: expected a [B, L] tensor, got shape {tuple(loss.shape)}")
    check_mask_reduce(loss, 1, mask, None, None, x_name="loss")
    out_dtype = acc_dtype(loss.dtype)
    shape = tuple(loss.shape)
    s = mask_reduce(loss, 1, mask, out_dtype=out_dtype)  # [B]
    if mode == "seq-mean-token-sum":
        return s.sum() / max(shape[0], 1)
    if mode == "seq-mean-token-sum-norm":
        return s.sum() / max(shape[1], 1)
    n = _count(mask, shape, 1).to(out_dtype)
    if mode == "token-mean":
        return s.sum() / n.sum().clamp_min(1)
    nonempty = n > 0
    per_row = torch.where(nonempty, s / n.clamp_min(1), torch.zeros_like(s))
    return per_row.sum() / nonempty.sum().clamp_min(1)
