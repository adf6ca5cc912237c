"""The sampler's support op (``fused::_sampler_threshold``, ops/sampler.py): its output shapes,
checks and fake implementation.

The op returns, for the rows a log-prob op scores, the threshold tau (float32; float64 for
float64 logits) such that the support is {j : x_j >= tau} (reference.sampler_threshold), and
the support list: int32 [rows, SUPPORT_CAP + 1], per row the count n of kept ids followed by
their positions in ascending order when n <= SUPPORT_CAP, else n = -1 (not listed; the CPU
reference lists no row). The log-prob backward writes a listed row's gradient from the list
alone (kernels/logprobs.py); the list is what the backward keeps of the support: SUPPORT_CAP
int32 per row, O(rows).
"""

from __future__ import annotations

import torch

from .._library import acc_dtype
from .logprobs import SUPPORT_CAP, LogprobOptions, check_options, row_shape, support_shape  # noqa: F401

def sampler_options(temperature: float, shift: bool, top_k, top_p, min_p) -> LogprobOptions:
    return LogprobOptions(temperature=temperature, shift=shift, top_k=top_k, top_p=top_p, min_p=min_p)


def sampler_threshold_fake(logits, temperature_t, temperature, shift, top_k, top_p, min_p):
    check_options(logits, None, temperature_t, sampler_options(temperature, shift, top_k, top_p, min_p))
    tau = logits.new_empty(row_shape(logits, shift), dtype=acc_dtype(logits.dtype))
    return tau, logits.new_empty(support_shape(logits, shift), dtype=torch.int32)
