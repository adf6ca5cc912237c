"""Helpers built on fused::mask_reduce: the op's cost model, masked means and the RL loss
aggregations. None of them materializes a broadcast mask."""

from __future__ import annotations

import torch

from ._library import acc_dtype, eager_eligible, is_dtensor
from .ops.mask_reduce import eager_mask_reduce
from .meta.mask_reduce import _check, check_cu_seqlens, check_dim_type, check_mask_reduce
from .packed import check_cu_values, per_sequence, segment_sums
from .reference import stored_view
from .meta.logprobs import shown as _shown

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


def mask_reduce(x, dim, mask=None, scale=None, *, out_dtype=None, cu_seqlens=None):
    """Sum over ``dim`` of ``x * scale`` where ``mask != 0``; with ``cu_seqlens``, over each
    packed sequence of ``dim``.

    Args:
        x: 1 to 4 dims; float16, bfloat16, float32 or float64.
        dim: the dim to reduce.
        mask: bool, integer or floating, broadcastable to ``x`` (any strides, stride 0
            included: an ``expand``ed view is read from its stored elements only). An element
            is kept where ``mask != 0``, whatever the value: the mask selects, a floating mask's
            0.5 (or NaN) keeps its element at weight 1. ``None`` keeps everything.
        scale: floating, broadcastable to ``x``, same rules. ``None`` means 1. Weights go here
            (``mask_reduce(x, d, w, scale=w)`` is the weighted sum of ``x * w`` that
            ``masked_mean`` and ``aggregate_loss`` take for a floating mask ``w``).
        out_dtype: dtype of the result; default ``x.dtype``. Accumulation is float32 (float64
            for float64 x) whatever the output dtype.
        cu_seqlens: a packed ``dim`` (sequences laid end to end, no padding): int32 (or int64)
            ``[S+1]``, FlashAttention's cumulative lengths (0 first, non-decreasing,
            ``x.shape[dim]`` last; a repeated value is an empty sequence). The result is then
            shaped like ``x`` with ``dim`` replaced by S: the sum over each sequence, equal to
            ``mask_reduce`` over dim 1 of the padded ``[S, L_max]`` layout of the same data. Its
            dtype and device are checked, its values on CPU only (a device sync elsewhere: on
            CUDA, bad values give wrong sums, never a read out of bounds). Computed with plain
            PyTorch ops (segment sums by ``index_add``: on CUDA their order of additions is not
            fixed unless ``torch.use_deterministic_algorithms(True)``), compiled once for all S
            and lengths under ``torch.compile(dynamic=True)``.

    Masked-off elements are never read: a NaN or inf there does not reach the result.
    Gradient flows to ``x`` only (``dx = dy`` broadcast over ``dim``, times ``scale``, 0 where
    masked); ``mask`` and ``scale`` get none.
    """
    check_dim_type(dim)
    out = _on_replicated(lambda x, m, s, c: mask_reduce(x, dim, m, s, out_dtype=out_dtype, cu_seqlens=c),
                         dict(x=x, mask=mask, scale=scale, cu_seqlens=cu_seqlens))
    if out is not None:
        return out
    if cu_seqlens is not None:
        d = check_mask_reduce(x, dim, mask, scale, out_dtype)
        check_cu_seqlens(cu_seqlens, x, d)
        check_cu_values(cu_seqlens, x.shape[d], f"x.shape[{d}]")
        sums, _ = segment_sums(x, d, mask, scale, cu_seqlens)
        return per_sequence(sums, d).to(out_dtype or x.dtype)
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


def _weights(mask: torch.Tensor, shape, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Sum along dim of the mask's weights (a floating mask's values; 1 where a bool or integer
    mask != 0), shaped like the reduction, in dtype. One op (fused::_mask_weight) that reads the
    stored elements only: the helpers never read the strides of a tensor themselves, since under
    torch.compile a mask may be an intermediate whose layout the compiler chooses."""
    return torch.ops.fused._mask_weight(mask, list(shape), dim, dtype)


def _scale(mask: torch.Tensor) -> torch.Tensor | None:
    """mask_reduce's scale for a helper's mask: a floating mask weighs its elements (it is passed
    as mask and as scale, both read from their stored elements); a bool or integer one keeps its
    elements at weight 1."""
    return mask if mask.dtype.is_floating_point else None


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, 0 where den == 0: no NaN or inf there, and no NaN in num's gradient."""
    nonzero = den != 0
    return torch.where(nonzero, num / torch.where(nonzero, den, torch.ones_like(den)), torch.zeros_like(num))


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None, *,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted mean of ``values`` under ``mask``, over ``dim`` (all elements when None):
    ``(values * w).sum(dim) / w.sum(dim)``, and 0 where ``w.sum(dim) == 0``.

    Args:
        values: 0 to 4 dims (1 to 4 with ``dim``); float16, bfloat16, float32 or float64.
        mask: bool, integer or floating, broadcastable to ``values`` (stride-0 views are read
            from their stored elements, never materialized). Its weights ``w``: a floating
            mask's values (0.5 counts half, 2.0 twice, a negative weight subtracts, a NaN weight
            gives NaN, as the plain formula would); 1 where a bool or integer mask is nonzero,
            else 0 (an integer 3 keeps its element at weight 1).
        dim: the dim to average over, or None for all elements.
        cu_seqlens: a packed ``dim`` (see :func:`mask_reduce`): int32 ``[S+1]``. With ``dim``, the
            mean of each sequence, shaped like ``values`` with ``dim`` replaced by S (``[1, T]``
            over dim 1 gives ``[1, S]``), equal to ``masked_mean(padded, padded_mask, 1)`` of the
            padded ``[S, L_max]`` layout (0 for an empty sequence). With ``dim=None`` the mean of
            all elements, which the layout does not change: ``cu_seqlens`` is only checked
            (against the last dim).

    float32 result (float64 for float64 values). Where the weights sum to 0 (nothing kept, or
    weights that cancel) the mean is 0, never NaN or inf (TRL's masked_mean would give NaN
    there). Elements of weight 0 are never read: a NaN or inf value there does not reach the
    result. Gradient flows to ``values`` only; the mask gets none, whatever its dtype.

    ``Replicate()`` DTensors (the vocab-parallel functions' outputs) are accepted for ``values``
    and ``mask``; the result is then a ``Replicate()`` DTensor (the same for ``aggregate_loss``
    and ``mask_reduce``)."""
    out = _on_replicated(lambda v, m, c: masked_mean(v, m, dim, cu_seqlens=c),
                         dict(values=values, mask=mask, cu_seqlens=cu_seqlens))
    if out is not None:
        return out
    out_dtype = acc_dtype(values.dtype)
    if dim is None and values.dim() == 0:
        values = values.reshape(1)
        mask = mask.reshape(1) if mask.dim() == 0 else mask
    d = values.dim() - 1 if dim is None else dim
    nd = check_mask_reduce(values, d, mask, None, None, x_name="values")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, values, nd, x_name="values")
        check_cu_values(cu_seqlens, values.shape[nd], f"values.shape[{nd}]")
        if dim is not None:
            total, weight = segment_sums(values, nd, mask, _scale(mask), cu_seqlens, weights=True)
            return per_sequence(_ratio(total, weight), nd)
    shape = tuple(values.shape)
    total = mask_reduce(values, d, mask, _scale(mask), out_dtype=out_dtype)
    weight = _weights(mask, shape, d, out_dtype)
    if dim is None:
        total, weight = total.sum(), weight.sum()
    return _ratio(total, weight)


def _norm_len(norm_len, mode: str, packed: bool):
    """aggregate_loss's ``norm_len``, checked (ValueError or TypeError naming it)."""
    if norm_len is None:
        if packed and mode == "seq-mean-token-sum-norm":
            raise ValueError("norm_len: required with cu_seqlens in mode 'seq-mean-token-sum-norm' (a packed row has "
                             "no padded length: pass the constant the padded layout divides by, its length L)")
        return None
    if mode != "seq-mean-token-sum-norm":
        raise ValueError(f"norm_len: only for mode 'seq-mean-token-sum-norm' (its constant normalizer), got "
                         f"norm_len={_shown(norm_len)} with mode {mode!r}")
    if isinstance(norm_len, bool) or not isinstance(norm_len, (int, float, torch.SymInt, torch.SymFloat)):
        raise TypeError(f"norm_len: expected a positive int or float, got {_shown(norm_len)}")
    if not (0 < norm_len < float("inf")):
        raise ValueError(f"norm_len: expected a positive finite number, got {_shown(norm_len)}")
    return norm_len


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
                   cu_seqlens: torch.Tensor | None = None, norm_len: int | float | None = None) -> torch.Tensor:
    """Reduce a per-token loss ``[B, L]`` under a ``[B, L]`` (or broadcastable) mask to a scalar;
    with ``cu_seqlens``, a packed row ``[1, T]`` (or ``[T]``) of S sequences.

    ``mask`` is bool, integer or floating, with the weights of :func:`masked_mean`: a floating
    mask's values (``mask.float()`` of a bool mask gives the bool mask's results; 0.5 weighs
    its token half), 1 where a bool or integer mask is nonzero.

    With w the weights, S_b = sum_t loss[b, t] * w[b, t] and W_b = sum_t w[b, t] (row b),
    B rows, L = loss.shape[-1], and x / 0 read as 0:
        token-mean:               sum_b S_b / sum_b W_b, the plain ``(loss * mask).sum() /
                                  mask.sum()`` of TRL and veRL (up to how they guard a 0 sum)
        seq-mean-token-mean:      the mean of S_b / W_b over the rows with W_b != 0 (rows whose
                                  weights sum to 0 are left out; none left gives 0)
        seq-mean-token-sum:       sum_b S_b / B
        seq-mean-token-sum-norm:  sum_b S_b / L  (Dr. GRPO / veRL: a constant normalizer;
                                  ``norm_len`` replaces L)
    No mode gives NaN or inf where the weights sum to 0 (an all-zero mask row, or weights that
    cancel); a NaN weight gives NaN, as the plain formula would. Tokens of weight 0 are never
    read. Gradient flows to ``loss`` only. Errors name ``loss``, ``mask``, ``mode``,
    ``cu_seqlens`` and ``norm_len`` (RuntimeError; ValueError for an unknown mode or a bad
    ``norm_len``, TypeError for an argument of the wrong type), eagerly and under torch.compile.

    Packed batches: with ``cu_seqlens`` (int32 or int64 ``[S+1]``, FlashAttention's cumulative
    lengths: 0 first, non-decreasing, T last; a repeated value is an empty sequence) ``loss`` is
    ``[1, T]`` or ``[T]`` and ``mask`` broadcasts to it. The sequences take the place of the
    rows: b runs over the S sequences (an empty one counts in B = S, as an all-masked row of the
    padded layout does), and each mode equals its value on the padded ``[S, L_max]`` layout of the
    same data. ``seq-mean-token-sum-norm`` then needs ``norm_len``, the padded length L (a packed
    row has none); without ``cu_seqlens`` it defaults to ``loss.shape[-1]``. ``norm_len`` is
    refused with the other modes. The values of ``cu_seqlens`` are checked on CPU only (see
    :func:`mask_reduce`); nothing recompiles as S or T change under
    ``torch.compile(dynamic=True)``.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"mode: expected one of {AGG_MODES}, got {_shown(mode)}")
    norm_len = _norm_len(norm_len, mode, cu_seqlens is not None)
    out = _on_replicated(lambda lo, m, c: aggregate_loss(lo, m, mode, cu_seqlens=c, norm_len=norm_len),
                         dict(loss=loss, mask=mask, cu_seqlens=cu_seqlens))
    if out is not None:
        return out
    if cu_seqlens is not None:
        return _aggregate_packed(loss, mask, mode, cu_seqlens, norm_len)
    _check(loss.dim() == 2, lambda: f"loss: expected a [B, L] tensor, got shape {tuple(loss.shape)}")
    check_mask_reduce(loss, 1, mask, None, None, x_name="loss")
    out_dtype = acc_dtype(loss.dtype)
    shape = tuple(loss.shape)
    s = mask_reduce(loss, 1, mask, _scale(mask), out_dtype=out_dtype)  # S_b, [B]
    if mode == "seq-mean-token-sum":
        return s.sum() / max(shape[0], 1)
    if mode == "seq-mean-token-sum-norm":
        return s.sum() / (max(shape[1], 1) if norm_len is None else norm_len)
    w = _weights(mask, shape, 1, out_dtype)  # W_b, [B]
    if mode == "token-mean":
        return _ratio(s.sum(), w.sum())
    rows = (w != 0).sum().to(out_dtype)
    return _ratio(_ratio(s, w).sum(), rows)


def _aggregate_packed(loss, mask, mode, cu_seqlens, norm_len):
    """aggregate_loss over the S sequences of a packed row (its arguments checked here)."""
    _check(loss.dim() == 1 or (loss.dim() == 2 and loss.shape[0] == 1),
           lambda: f"loss: with cu_seqlens, expected a packed row [1, T] or [T], got shape {tuple(loss.shape)}")
    d = loss.dim() - 1
    check_mask_reduce(loss, d, mask, None, None, x_name="loss")
    check_cu_seqlens(cu_seqlens, loss, d, x_name="loss")
    check_cu_values(cu_seqlens, loss.shape[d], "loss.shape[-1]")
    if mode == "token-mean":  # the layout does not matter: every kept token of the row
        return aggregate_loss(loss.reshape(1, -1), mask, mode)  # mask broadcasts to [T], so to [1, T]
    # [S + 2] buckets, sequence s at s + 1, the two outer ones 0: sums over all of them are sums
    # over the sequences, and no [S] tensor (whose size 1 torch.compile would specialize) is made
    s, w = segment_sums(loss, d, mask, _scale(mask), cu_seqlens, weights=mode == "seq-mean-token-mean")
    s = s.reshape(-1)
    if mode == "seq-mean-token-sum":
        return s.sum() / torch.sym_max(cu_seqlens.shape[0] - 1, 1)
    if mode == "seq-mean-token-sum-norm":
        return s.sum() / norm_len
    w = w.reshape(-1)
    rows = (w != 0).sum().to(s.dtype)
    return _ratio(_ratio(s, w).sum(), rows)
