"""Input checks and fake (meta) implementations of the fused lm_head,
``fused::linear_logprobs_and_entropy``.

``check_linear`` is the one validation function, called by the fakes and by every
implementation, so eager and compiled calls fail with the same message. Shapes and dtypes only.
"""

from __future__ import annotations

import math

import torch

from .._library import FLOAT_DTYPES, acc_dtype, check
from .logprobs import check_logits_index, row_shape


def check_linear(hidden, weight, index, bias, temperature, shift, logit_scale, softcap) -> None:
    check(hidden.dtype in FLOAT_DTYPES,
          lambda: f"hidden: expected dtype float16, bfloat16, float32 or float64, got {hidden.dtype}")
    check(hidden.dim() >= 1, lambda: "hidden: expected at least 1 dim [..., H], got a 0-dim tensor")
    check(weight.dim() == 2, lambda: f"weight: expected [V, H] (lm_head.weight's layout), got shape {tuple(weight.shape)}")
    check(weight.dtype == hidden.dtype,
          lambda: f"weight: expected the hidden states' dtype {hidden.dtype}, got {weight.dtype}")
    check(weight.device == hidden.device,
          lambda: f"weight: expected the hidden states' device {hidden.device}, got {weight.device}")
    check(weight.shape[1] == hidden.shape[-1],
          lambda: f"weight: hidden size {weight.shape[1]} (weight [V, H] = {tuple(weight.shape)}) differs from "
                  f"hidden's last dim {hidden.shape[-1]} (hidden {tuple(hidden.shape)})")
    check(weight.shape[0] >= 1, lambda: f"weight: the vocabulary (dim 0) must be >= 1, got shape {tuple(weight.shape)}")
    check(weight.shape[1] >= 1, lambda: f"weight: the hidden size (dim 1) must be >= 1, got shape {tuple(weight.shape)}")
    if bias is not None:
        check(bias.shape == (weight.shape[0],),
              lambda: f"bias: expected shape ({weight.shape[0]},) (one per vocabulary row), got {tuple(bias.shape)}")
        check(bias.dtype == hidden.dtype and bias.device == hidden.device,
              lambda: f"bias: expected {hidden.dtype} on {hidden.device}, got {bias.dtype} on {bias.device}")
    torch._check_value(logit_scale > 0 and math.isfinite(logit_scale),
                       lambda: f"logit_scale: expected a positive finite number, got {logit_scale}")
    if softcap is not None:
        torch._check_value(softcap > 0 and math.isfinite(softcap),
                           lambda: f"softcap: expected None or a positive finite number, got {softcap}")
    # index and temperature: the log-prob ops' checks, with the hidden states in the logits' place
    # (their leading dims are the logits' rows)
    check_logits_index(hidden, index, temperature, None, shift, what="hidden")


def linear_forward_fake(hidden, weight, index, bias, temperature, ignore_index, shift, logit_scale, softcap):
    check_linear(hidden, weight, index, bias, temperature, shift, logit_scale, softcap)
    dt = acc_dtype(hidden.dtype)
    lead = row_shape(hidden, shift)
    return (hidden.new_empty(index.shape, dtype=dt), hidden.new_empty(lead, dtype=dt),
            hidden.new_empty(lead + (2,), dtype=dt))


def linear_backward_fake(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy, temperature,
                         ignore_index, shift, logit_scale, softcap, hidden_grad=True, weight_grad=True):
    check_linear(hidden, weight, index, bias, temperature, shift, logit_scale, softcap)
    db = hidden.new_empty(bias.shape if bias is not None else (0,))
    return (hidden.new_empty(hidden.shape if hidden_grad else (0,)),
            weight.new_empty(weight.shape if weight_grad else (0,)), db)
