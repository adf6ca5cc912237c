"""The fused lm_head's options, input checks and fake (meta) implementations,
``fused::linear_logprobs_and_entropy``.

``HeadOptions`` is the one list of the head's non-tensor arguments: the op schemas
(ops/linear_logprobs.py), the fakes here, the implementations and the vocabulary-parallel head
(parallel.py) derive theirs from it. Adding an option: a field of ``HeadOptions``, its check in
``check_linear``, its use in ops/linear_logprobs.py (and the kernels or the reference where it acts), and
the public function's keyword (torch_fused/__init__.py). The sampler's fields (``top_k``, ``top_p``,
``min_p``) are the log-prob family's, with its checks (``check_sampler``).

``check_linear`` is the one validation function, called by the fakes and by every
implementation, so eager and compiled calls fail with the same message. Shapes and dtypes only.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._library import FLOAT_DTYPES, acc_dtype, check, check_value
from .logprobs import SUPPORT_CAP, check_logits_index, check_sampler, restricts_support, row_shape


# the schema type of each HeadOptions field's annotation
_SCHEMA_TYPES = {"float": "float", "int": "int", "bool": "bool", "float | None": "float?", "int | None": "int?"}


@dataclasses.dataclass(frozen=True)
class HeadOptions:
    """The fused head's arguments after (hidden, weight, index, bias), in schema order, with the
    public function's defaults."""
    temperature: float = 1.0
    ignore_index: int = -100
    shift: bool = False
    logit_scale: float = 1.0
    softcap: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def restricts_support(self) -> bool:
        """Whether the sampler options leave out part of the vocabulary (the head then runs over
        token-row chunks of logits: ops/linear_logprobs.py ``_support_forward``)."""
        return restricts_support(self)

    def listed_ids(self, v: int) -> int:
        """Ids per row that the support path lists in its forward for a backward without GEMMs
        (ops/linear_logprobs.py ``_listed_backward``): ``top_k`` (at most V) where it is at most
        SUPPORT_CAP, else 0 (no list: the backward recomputes the logits)."""
        k = self.top_k
        return min(k, v) if self.restricts_support() and k is not None and k <= SUPPORT_CAP else 0

    def stats_width(self, v: int) -> int:
        """Row statistics the forward saves for the backward: (max, log2 sum); where the sampler's
        support is restricted, the row's threshold; where its ids are listed, their count (-1:
        not listed), the ids (as floats) and their logits (``listed_ids`` each)."""
        if not self.restricts_support():
            return 2
        k = self.listed_ids(v)
        return 4 + 2 * k if k else 3

    def values(self) -> tuple:
        """The fields in order: the op's positional arguments."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @classmethod
    def schema(cls, defaults: bool = False) -> str:
        """The fields as schema arguments, e.g. ``float temperature, int ignore_index, ...`` (with
        ``=default`` each where ``defaults``)."""
        parts = []
        for f in dataclasses.fields(cls):
            arg = f"{_SCHEMA_TYPES[f.type]} {f.name}"
            parts.append(f"{arg}={f.default!r}" if defaults else arg)
        return ", ".join(parts)


def check_linear(hidden, weight, index, bias, opts: HeadOptions) -> None:
    temperature, shift, logit_scale, softcap = opts.temperature, opts.shift, opts.logit_scale, opts.softcap
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
    check_value(0 < logit_scale < math.inf,
                lambda: f"logit_scale: expected a positive finite number, got {logit_scale}")
    if softcap is not None:
        check_value(0 < softcap < math.inf,
                    lambda: f"softcap: expected None or a positive finite number, got {softcap}")
    check_sampler(opts)
    # index and temperature: the log-prob ops' checks, with the hidden states in the logits' place
    # (their leading dims are the logits' rows)
    check_logits_index(hidden, index, temperature, None, shift, what="hidden")


def linear_forward_fake(hidden, weight, index, bias, *options):
    opts = HeadOptions(*options)
    check_linear(hidden, weight, index, bias, opts)
    dt = acc_dtype(hidden.dtype)
    lead = row_shape(hidden, opts.shift)
    return (hidden.new_empty(index.shape, dtype=dt), hidden.new_empty(lead, dtype=dt),
            hidden.new_empty(lead + (opts.stats_width(weight.shape[0]),), dtype=dt))


def linear_backward_fake(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy, *options,
                         hidden_grad=True, weight_grad=True):
    check_linear(hidden, weight, index, bias, HeadOptions(*options))
    db = hidden.new_empty(bias.shape if bias is not None else (0,))
    return (hidden.new_empty(hidden.shape if hidden_grad else (0,)),
            weight.new_empty(weight.shape if weight_grad else (0,)), db)
