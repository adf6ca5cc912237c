"""Packed batches: sequences laid end to end along one dim (a ``[1, T]`` row, no padding),
described by ``cu_seqlens``, FlashAttention's cumulative sequence lengths: an int32 tensor
``[S+1]`` with ``cu_seqlens[0] == 0``, non-decreasing, and ``cu_seqlens[-1] == T``; sequence s
holds positions ``cu_seqlens[s]:cu_seqlens[s+1]`` (a repeated value is an empty sequence).

The masked helpers (``masked_mean``, ``aggregate_loss``, ``mask_reduce``) take ``cu_seqlens=`` and
reduce per sequence with the segment sums of this module; :func:`packed_targets` builds the
next-token targets of a packed row so that the log-prob ops never score across a boundary.

Everything here is plain PyTorch with static shapes (an ``[S+1]`` input gives ``[S+2]`` bucket
sums whatever the lengths), so ``torch.compile(dynamic=True)`` compiles it once for all S and T.
"""

from __future__ import annotations

import torch

from ._library import acc_dtype, eager_eligible
from .meta.logprobs import shown
from .meta.mask_reduce import _check, check_cu_seqlens


def check_cu_values(cu_seqlens: torch.Tensor, length, what: str) -> None:
    """The values of ``cu_seqlens`` (0 first, non-decreasing, ``length`` last), checked where that
    costs no device sync: on CPU, eagerly with a message that names the first bad value, and in a
    traced or compiled call by an assert of the graph (``torch._assert_async``). On other devices
    they are not read; ``what`` names the packed length in messages (``"loss.shape[-1]"``)."""
    if cu_seqlens.device.type != "cpu":
        return
    if eager_eligible(cu_seqlens):
        first = int(cu_seqlens[0])
        _check(first == 0, lambda: f"cu_seqlens: expected 0 first (cu_seqlens[0] == 0), got {first}")
        down = torch.nonzero(cu_seqlens[1:] < cu_seqlens[:-1])
        if down.numel():
            i = int(down[0, 0]) + 1
            raise RuntimeError(f"cu_seqlens: expected non-decreasing values (cumulative lengths), got "
                               f"{int(cu_seqlens[i])} after {int(cu_seqlens[i - 1])} at index {i}")
        last = int(cu_seqlens[-1])
        _check(last == int(length),
               lambda: f"cu_seqlens: expected the packed length {int(length)} ({what}) last, got {last}")
        return
    ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == length) & (cu_seqlens.cummax(0).values == cu_seqlens).all()
    torch._assert_async(ok, f"cu_seqlens: expected values that start at 0, never decrease and end at the packed "
                            f"length ({what})")


def _segments(cu_seqlens: torch.Tensor, length, device) -> torch.Tensor:
    """The bucket of each of ``length`` positions, ``[length]`` int64: s + 1 for sequence s, 0
    before ``cu_seqlens[0]`` and S + 1 from ``cu_seqlens[-1]`` on (only bad values use those two).
    A search in the sorted ``cu_seqlens``: a static shape, where a ``repeat_interleave`` of the
    lengths would have a data-dependent one."""
    pos = torch.arange(length, device=device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, pos, right=True)


def segment_sums(x: torch.Tensor, dim: int, mask: torch.Tensor | None, scale: torch.Tensor | None,
                 cu_seqlens: torch.Tensor, *, weights: bool = False):
    """Per-sequence sums along ``dim`` (normalized, the packed dim) of ``x * scale`` where
    ``mask != 0``, accumulated in float32 (float64 for float64 ``x``), and with ``weights=True``
    the per-sequence sums of the mask's weights (a floating mask's values, 1 where a bool or
    integer mask is nonzero; the masked helpers' denominators), else None.

    Both are shaped like ``x`` with ``dim`` replaced by S + 2 buckets: bucket s + 1 is sequence s;
    buckets 0 and S + 1 stay 0 (positions outside ``[cu_seqlens[0], cu_seqlens[-1])``, which only
    bad values leave, are dropped). Elements where ``mask == 0`` never reach a result, NaN or inf
    included. Gradient flows to ``x`` only; ``mask`` and ``scale`` are read detached."""
    length = x.shape[dim]
    seg = _segments(cu_seqlens, length, x.device)
    shape = [1] * x.dim()
    shape[dim] = length
    keep = ((seg > 0) & (seg < cu_seqlens.shape[0])).reshape(shape)
    if mask is not None:
        keep = keep & (mask.detach() != 0)
    acc = acc_dtype(x.dtype)
    v = torch.where(keep, x.to(acc), 0)
    if scale is not None:
        v = v * torch.where(keep, scale.detach().to(acc), 0)
    out_shape = list(x.shape)
    out_shape[dim] = cu_seqlens.shape[0] + 1
    sums = v.new_zeros(out_shape).index_add(dim, seg, v)
    if not weights:
        return sums, None
    if mask is not None and mask.dtype.is_floating_point:
        w = torch.where(keep, mask.detach().to(acc), 0)
    else:
        w = keep.to(acc)
    w = torch.broadcast_to(w, x.shape)
    return sums, v.new_zeros(out_shape).index_add(dim, seg, w)


def per_sequence(buckets: torch.Tensor, dim: int) -> torch.Tensor:
    """The S sequences' entries of ``segment_sums``' buckets, a fresh tensor (not a view)."""
    return buckets.narrow(dim, 1, buckets.shape[dim] - 2).clone(memory_format=torch.contiguous_format)


def packed_targets(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Next-token targets of a packed row, for the log-prob ops with ``shift=False``: position t of
    sequence s gets ``input_ids[..., t + 1]``, and the last position of each sequence gets
    ``ignore_index`` (its next token starts another sequence, or there is none).

    Args:
        input_ids: ``[..., T]`` (``[1, T]`` or ``[T]``), the packed dim last; any dtype.
        cu_seqlens: int32 (or int64) ``[S+1]``, 0 first, non-decreasing, T last (FlashAttention's
            convention; repeated values are empty sequences). Its values are checked on CPU; on
            CUDA they are not read (no device sync): bad ones give wrong targets, never a read
            out of bounds, and the last position is ``ignore_index`` whatever they hold.
        ignore_index: the value of each sequence's last position (an int; the log-prob ops'
            default -100). ``packed_targets(mask, cu_seqlens, 0)`` shifts a bool or integer
            completion mask the same way, so that it lines up with the targets.

    Returns:
        A tensor shaped like ``input_ids``, of its dtype. With the model's logits ``[1, T, V]``
        for the packed row,
        ``torch_fused.selective_log_softmax(logits, packed_targets(input_ids, cu_seqlens))`` is
        ``[1, T]``: sequence s's log-probs at its positions but the last, 0 there (no gradient),
        equal to scoring each sequence alone with ``shift=True``; ``[1, T]`` lines up with
        ``cu_seqlens`` for ``aggregate_loss(..., cu_seqlens=cu_seqlens)``. With ``shift=True``
        pass ``packed_targets(...)[..., :-1]`` (T - 1 positions).
    """
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids: expected a tensor [..., T], got {type(input_ids).__name__}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, torch.SymInt)):
        raise TypeError(f"ignore_index: expected an int, got {shown(ignore_index)}")
    _check(input_ids.dim() >= 1,
           lambda: "input_ids: expected a tensor [..., T] (the packed dim last), got a 0-dim tensor")
    if input_ids.dtype == torch.bool:
        fits = ignore_index in (0, 1)
    elif input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
        fits = True
    else:
        info = torch.iinfo(input_ids.dtype)
        fits = info.min <= ignore_index <= info.max
    if not fits:  # (a cast would wrap it into a real id, or make every last position True)
        raise ValueError(f"ignore_index: {ignore_index} is not a value of input_ids' dtype {input_ids.dtype} "
                         "(a bool mask takes 0 or 1)")
    check_cu_seqlens(cu_seqlens, input_ids, input_ids.dim() - 1, x_name="input_ids")
    length = input_ids.shape[-1]
    check_cu_values(cu_seqlens, length, "input_ids.shape[-1]")
    pos = torch.arange(length, device=input_ids.device, dtype=cu_seqlens.dtype)
    # a boundary at t + 1: t is the last position of its sequence (the search counts the values <= t)
    last = torch.searchsorted(cu_seqlens, pos + 1, right=True) > torch.searchsorted(cu_seqlens, pos, right=True)
    last = last | (pos == length - 1)
    return torch.roll(input_ids, -1, -1).masked_fill(last, ignore_index)
