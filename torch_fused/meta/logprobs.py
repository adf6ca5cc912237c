"""Input checks and fake (meta) implementations of the log-prob / entropy ops.

``check_logits_index`` is the one validation function: the public ops call it before they
dispatch, and the fake implementations call it again, so an eager call and a call traced by
``torch.compile`` fail with the same message. It reads shapes and dtypes only, never data.
"""

from __future__ import annotations

import math

import torch

from .._library import FLOAT_DTYPES, INDEX_DTYPES, acc_dtype, check, check_value


def check_temperature(temperature: float) -> None:
    # ValueError, as for a tensor temperature whose value is checked where it is read
    check_value(
        0 < temperature < math.inf,
        lambda: f"temperature: expected a positive finite number, got {temperature}",
    )


def check_logits(logits: torch.Tensor) -> None:
    check(
        logits.dtype in FLOAT_DTYPES,
        lambda: f"logits: expected dtype float16, bfloat16, float32 or float64, got {logits.dtype}",
    )
    check(logits.dim() >= 1, lambda: "logits: expected at least 1 dim [..., V], got a 0-dim tensor")
    check(
        logits.shape[-1] >= 1,
        lambda: f"logits: the last dim (vocabulary V) must be >= 1, got shape {tuple(logits.shape)}",
    )


def row_shape(logits: torch.Tensor, shift: bool) -> tuple:
    """The leading (row) dims the op computes over: logits.shape[:-1], or with shift the
    positions 0..L-1 of [..., L+1, V]."""
    lead = tuple(logits.shape[:-1])
    return lead[:-1] + (lead[-1] - 1,) if shift else lead


def check_logits_index(logits: torch.Tensor, index: torch.Tensor | None, temperature: float,
                       temperature_t: torch.Tensor | None = None, shift: bool = False, what: str = "logits") -> None:
    """``what`` names the tensor whose leading dims are the rows (the fused lm_head passes its
    hidden states, which it has checked itself)."""
    if what == "logits":
        check_logits(logits)
    last = "V" if what == "logits" else "H"
    if temperature_t is None:
        check_temperature(temperature)
    else:  # its value (> 0) is data: checked where reading it costs no sync (reference.py)
        check(temperature_t.dim() == 0 and temperature_t.dtype.is_floating_point,
              lambda: f"temperature: expected a float or a 0-dim floating tensor, got {temperature_t.dtype} "
                      f"of shape {tuple(temperature_t.shape)}")
        check(temperature_t.device == logits.device,
              lambda: f"temperature: expected device {logits.device} (the logits' device), got {temperature_t.device}")
    if shift:
        check(logits.dim() >= 2 and logits.shape[-2] >= 1,
              lambda: f"{what}: shift=True needs {what} [..., L+1, {last}] with L+1 >= 1, "
                      f"got shape {tuple(logits.shape)}")
    if index is None:
        return
    check(
        index.dtype in INDEX_DTYPES,
        lambda: f"index: expected dtype int32 or int64, got {index.dtype}",
    )
    check(
        index.device == logits.device,
        lambda: f"index: expected device {logits.device} (the device of {what}), got {index.device}",
    )
    lead = row_shape(logits, shift)
    ishape = tuple(index.shape)
    if shift:
        check(
            ishape == lead or (len(ishape) == len(lead) + 1 and ishape[:-1] == lead),
            lambda: (
                f"index: with shift=True, {what} [..., L+1, {last}] of shape {tuple(logits.shape)} score index "
                f"[..., L] = {lead} (or {lead + ('K',)}); got index of shape {ishape}"
            ),
        )
        return
    check(
        ishape == lead or (len(ishape) == len(lead) + 1 and ishape[:-1] == lead),
        lambda: (
            f"index: expected shape {lead} (one id per row) or {lead + ('K',)} (K ids per row) "
            f"for {what} of shape {tuple(logits.shape)}, got {ishape}"
        ),
    )


def logprobs_entropy_forward_fake(logits, index, temperature, ignore_index, compute_entropy, temperature_t=None,
                                  shift=False):
    check_logits_index(logits, index, temperature, temperature_t, shift)
    dt = acc_dtype(logits.dtype)
    lead = row_shape(logits, shift)
    logp = logits.new_empty(index.shape if index is not None else (0,), dtype=dt)
    ent = logits.new_empty(lead if compute_entropy else (0,), dtype=dt)
    stats = logits.new_empty(lead + (2,), dtype=dt)
    return logp, ent, stats


def logprobs_entropy_backward_fake(
    grad_logp, grad_entropy, logits, index, stats, entropy, temperature, ignore_index, temperature_t=None,
    shift=False, temperature_grad=True,
):
    check_logits_index(logits, index, temperature, temperature_t, shift)
    from ..reference import temperature_grad_dtype

    dt_dtype = temperature_grad_dtype(logits, temperature_t)
    dt = logits.new_empty((), dtype=dt_dtype) if temperature_t is not None and temperature_grad else \
        logits.new_empty((0,), dtype=dt_dtype)
    return logits.new_empty(logits.shape), dt
