"""The distillation family's options, input checks and fake (meta) implementations:
``fused::distill`` (from logits) and ``fused::linear_distill`` (from hidden states and heads).

``DistillOptions`` is the one list of the family's non-tensor arguments. The core ops' schemas
(ops/distill.py), the fakes here, the implementations (ops/distill.py, reference.py,
kernels/distill.py) and the autograd formulas follow from it; it is the only thing passed
between them. Adding a keyword: a field here (with its default), its check in
``check_options``, its effect where the divergence is made (reference.py's distillation section
and the kernels' host code in ops/distill.py), and the public functions' keyword
(torch_fused/__init__.py).

``check_logits`` / ``check_head`` (over ``check_options``) are the validation functions, called
by the fakes and by every implementation, so eager and compiled calls fail with the same
message; ``check_topk`` is the top-k teacher's, called by the public composite ops before any
core op. They read shapes, dtypes and devices only, never data.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._library import FLOAT_DTYPES, INDEX_DTYPES, acc_dtype, check, check_value
from .logprobs import row_shape, shown

# the schema type of each DistillOptions field's annotation
_SCHEMA_TYPES = {"float": "float", "int": "int", "bool": "bool", "str": "str", "float | None": "float?"}

REDUCTIONS = ("none", "sum", "token-mean")
TAILS = ("bucket", "renormalize")


@dataclasses.dataclass(frozen=True)
class DistillOptions:
    """The distillation ops' non-tensor arguments, in the core ops' schema order (after their
    tensors), with the public functions' defaults. Frozen and hashable.

    beta: 0 is KL(teacher || student), 1 is KL(student || teacher), between them the generalized
    JSD with mixture (1 - beta) p_student + beta p_teacher (TRL's definition);
    temperature: divides both models' logits (after logit_scale and softcap);
    ignore_index: positions whose label holds it give 0 and no gradient;
    shift: the logits (hidden states) are [..., L+1, *] and position t is scored with label t;
    reduction: "none" (per token), "sum" or "token-mean" (over the kept positions);
    compute_entropy: whether the core also makes the student's entropy (set by the public op);
    student_/teacher_logit_scale, student_/teacher_softcap: the heads' logit transforms,
    z = softcap * tanh(scale * y / softcap) (no tanh without a softcap); the logits ops take the
    defaults only (their logits are the models' final ones)."""
    beta: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    shift: bool = False
    reduction: str = "none"
    compute_entropy: bool = True
    student_logit_scale: float = 1.0
    teacher_logit_scale: float = 1.0
    student_softcap: float | None = None
    teacher_softcap: float | None = None

    def values(self) -> tuple:
        """The fields in order: the core ops' positional arguments after their tensors."""
        return tuple(getattr(self, name) for name in _NAMES)

    @classmethod
    def schema(cls) -> str:
        """The fields as schema arguments, e.g. ``float beta, float temperature, ...``."""
        return ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}" for f in dataclasses.fields(cls))

    @property
    def mode(self) -> int:
        """0: KL(teacher || student) (beta 0), 1: KL(student || teacher) (beta 1), 2: the
        generalized JSD."""
        return 0 if self.beta == 0.0 else 1 if self.beta == 1.0 else 2

    @property
    def reduced(self) -> bool:
        return self.reduction != "none"


_NAMES = tuple(f.name for f in dataclasses.fields(DistillOptions))


def _positive(value, name, optional=False) -> None:
    if optional and value is None:
        return
    check_value(not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf,
                lambda: f"{name}: expected {'None or ' if optional else ''}a positive finite number, got {shown(value)}")


def check_options(opts: DistillOptions) -> None:
    """The options' values (ValueError naming the option)."""
    b = opts.beta
    check_value(not isinstance(b, bool) and isinstance(b, (int, float)) and 0.0 <= b <= 1.0,
                lambda: f"beta: expected a number in [0, 1] (0: KL(teacher || student), 1: KL(student || teacher), "
                        f"between: the generalized JSD), got {shown(b)}")
    _positive(opts.temperature, "temperature")
    check_value(opts.reduction in REDUCTIONS,
                lambda: f"reduction: expected one of {', '.join(map(repr, REDUCTIONS))}, got {opts.reduction!r}")
    _positive(opts.student_logit_scale, "student_logit_scale")
    _positive(opts.teacher_logit_scale, "teacher_logit_scale")
    _positive(opts.student_softcap, "student_softcap", optional=True)
    _positive(opts.teacher_softcap, "teacher_softcap", optional=True)


def check_tail(tail) -> None:
    check_value(tail in TAILS, lambda: f"tail: expected one of {', '.join(map(repr, TAILS))}, got {tail!r}")


def _check_float(t, name, what) -> None:
    check(t.dtype in FLOAT_DTYPES,
          lambda: f"{name}: expected dtype float16, bfloat16, float32 or float64, got {t.dtype}")
    check(t.dim() >= 1, lambda: f"{name}: expected at least 1 dim [..., {what}], got a 0-dim tensor")


def _check_shift(t, name, what, shift) -> None:
    if shift:
        check(t.dim() >= 2 and t.shape[-2] >= 1,
              lambda: f"{name}: shift=True needs {name} [..., L+1, {what}] with L+1 >= 1, got shape {tuple(t.shape)}")


def check_labels(labels, lead, device, rows_name: str, shift: bool) -> None:
    """labels: [...lead] integer ids (only compared with ignore_index) on the rows' device."""
    if labels is None:
        return
    check(labels.dtype in INDEX_DTYPES, lambda: f"labels: expected dtype int32 or int64, got {labels.dtype}")
    check(labels.device == device,
          lambda: f"labels: expected device {device} (the device of {rows_name}), got {labels.device}")
    check(tuple(labels.shape) == tuple(lead),
          lambda: (f"labels: expected shape {tuple(lead)} (one per scored position of {rows_name}"
                   f"{', the last position dropped by shift=True' if shift else ''}), got {tuple(labels.shape)}"))


def check_logits(student, teacher, labels, opts: DistillOptions) -> None:
    """The checks of a logits core op's call (teacher: the full teacher's logits)."""
    check_options(opts)
    check_value(opts.student_logit_scale == 1.0 and opts.teacher_logit_scale == 1.0
                and opts.student_softcap is None and opts.teacher_softcap is None,
                lambda: "distill: the logits ops take the models' final logits (logit_scale 1, no softcap): apply "
                        "them to the logits first, or use linear_distill")
    _check_float(student, "student_logits", "V")
    check(student.shape[-1] >= 1,
          lambda: f"student_logits: the last dim (vocabulary V) must be >= 1, got shape {tuple(student.shape)}")
    _check_shift(student, "student_logits", "V", opts.shift)
    _check_float(teacher, "teacher_logits", "V")
    check(teacher.device == student.device,
          lambda: f"teacher_logits: expected the student_logits' device {student.device}, got {teacher.device}")
    check(teacher.shape[-1] == student.shape[-1],
          lambda: f"teacher_logits: vocabulary size {teacher.shape[-1]} (teacher_logits {tuple(teacher.shape)}) differs "
                  f"from the student's {student.shape[-1]} (student_logits {tuple(student.shape)}); the two models "
                  "must share one vocabulary")
    check(tuple(teacher.shape) == tuple(student.shape),
          lambda: f"teacher_logits: expected the student_logits' shape {tuple(student.shape)}, got {tuple(teacher.shape)}")
    check_labels(labels, row_shape(student, opts.shift), student.device, "student_logits", opts.shift)


def _check_one_head(hidden, weight, bias, who: str) -> None:
    h, w, b = f"{who}_hidden", f"{who}_weight", f"{who}_bias"
    _check_float(hidden, h, "H")
    check(weight.dim() == 2, lambda: f"{w}: expected [V, H] (lm_head.weight's layout), got shape {tuple(weight.shape)}")
    check(weight.dtype == hidden.dtype, lambda: f"{w}: expected {h}'s dtype {hidden.dtype}, got {weight.dtype}")
    check(weight.device == hidden.device, lambda: f"{w}: expected {h}'s device {hidden.device}, got {weight.device}")
    check(weight.shape[1] == hidden.shape[-1],
          lambda: f"{w}: hidden size {weight.shape[1]} ({w} [V, H] = {tuple(weight.shape)}) differs from {h}'s last "
                  f"dim {hidden.shape[-1]} ({h} {tuple(hidden.shape)})")
    check(weight.shape[0] >= 1, lambda: f"{w}: the vocabulary (dim 0) must be >= 1, got shape {tuple(weight.shape)}")
    check(weight.shape[1] >= 1, lambda: f"{w}: the hidden size (dim 1) must be >= 1, got shape {tuple(weight.shape)}")
    if bias is not None:
        check(bias.shape == (weight.shape[0],),
              lambda: f"{b}: expected shape ({weight.shape[0]},) (one per vocabulary row), got {tuple(bias.shape)}")
        check(bias.dtype == hidden.dtype and bias.device == hidden.device,
              lambda: f"{b}: expected {hidden.dtype} on {hidden.device}, got {bias.dtype} on {bias.device}")


def check_student_head(hidden, weight, bias, labels, opts: DistillOptions) -> None:
    check_options(opts)
    _check_one_head(hidden, weight, bias, "student")
    _check_shift(hidden, "student_hidden", "H", opts.shift)
    check_labels(labels, row_shape(hidden, opts.shift), hidden.device, "student_hidden", opts.shift)


def check_head(sh, sw, sb, th, tw, tb, labels, opts: DistillOptions) -> None:
    """The checks of a head core op's call (the full teacher's hidden states and head)."""
    check_student_head(sh, sw, sb, labels, opts)
    _check_one_head(th, tw, tb, "teacher")
    check(th.device == sh.device,
          lambda: f"teacher_hidden: expected the student_hidden's device {sh.device}, got {th.device}")
    check(tw.shape[0] == sw.shape[0],
          lambda: f"teacher_weight: vocabulary size {tw.shape[0]} (teacher_weight {tuple(tw.shape)}) differs from the "
                  f"student's {sw.shape[0]} (student_weight {tuple(sw.shape)}); the two models must share one vocabulary")
    check(tuple(th.shape[:-1]) == tuple(sh.shape[:-1]),
          lambda: f"teacher_hidden: expected the student_hidden's leading shape {tuple(sh.shape[:-1])} (one row per "
                  f"position; the hidden size may differ), got {tuple(th.shape)}")


def check_topk(rows, rows_name: str, ids, logprobs, shift: bool) -> None:
    """The top-k teacher: ids [..., L, k] (int) and logprobs [..., L, k] (float), aligned with the
    scored positions of ``rows`` (the student's logits or hidden states)."""
    lead = row_shape(rows, shift)
    check(ids.dtype in INDEX_DTYPES, lambda: f"teacher_topk_ids: expected dtype int64 or int32, got {ids.dtype}")
    check(logprobs.dtype in FLOAT_DTYPES,
          lambda: f"teacher_topk_logprobs: expected a floating dtype, got {logprobs.dtype}")
    for t, name in ((ids, "teacher_topk_ids"), (logprobs, "teacher_topk_logprobs")):
        check(t.device == rows.device, lambda: f"{name}: expected device {rows.device} (the device of {rows_name}), "
                                               f"got {t.device}")
        check(t.dim() == len(lead) + 1 and tuple(t.shape[:-1]) == tuple(lead),
              lambda: (f"{name}: expected shape {tuple(lead) + ('k',)} (k ids per scored position of {rows_name}"
                       f"{', the last position dropped by shift=True' if shift else ''}), got {tuple(t.shape)}"))
    check(ids.shape[-1] >= 1, lambda: f"teacher_topk_ids: expected k >= 1 ids per position, got shape {tuple(ids.shape)}")
    check(tuple(logprobs.shape) == tuple(ids.shape),
          lambda: f"teacher_topk_logprobs: expected teacher_topk_ids' shape {tuple(ids.shape)}, got {tuple(logprobs.shape)}")


# ---------------------------------------------------------------------------------------------
# fakes
# ---------------------------------------------------------------------------------------------
STATS = 5  # per row: student max, log2 of its sum, teacher max, log2 of its sum, the backward's aux


def distill_forward_fake(student, teacher, labels, *options):
    opts = DistillOptions(*options)
    check_logits(student, teacher, labels, opts)
    dt = acc_dtype(student.dtype)
    lead = row_shape(student, opts.shift)
    return (student.new_empty(lead, dtype=dt), student.new_empty(lead if opts.compute_entropy else (0,), dtype=dt),
            student.new_empty(tuple(lead) + (STATS,), dtype=dt))


def distill_backward_fake(grad_div, student, teacher, labels, stats, *options):
    check_logits(student, teacher, labels, DistillOptions(*options))
    return student.new_empty(student.shape)


def linear_forward_fake(sh, sw, sb, th, tw, tb, labels, *options, hidden_grad=False, weight_grad=False,
                        bias_grad=False):
    opts = DistillOptions(*options)
    check_head(sh, sw, sb, th, tw, tb, labels, opts)
    dt = acc_dtype(sh.dtype)
    lead = row_shape(sh, opts.shift)
    red = opts.reduced
    return (sh.new_empty(() if red else lead, dtype=dt),
            sh.new_empty(lead if opts.compute_entropy else (0,), dtype=dt),
            sh.new_empty(tuple(lead) + (STATS,), dtype=dt),
            sh.new_empty(sh.shape if red and hidden_grad else (0,), dtype=dt),
            sh.new_empty(sw.shape if red and weight_grad else (0,), dtype=dt),
            sh.new_empty(sb.shape if red and bias_grad and sb is not None else (0,), dtype=dt))


def linear_backward_fake(grad_div, sh, sw, sb, th, tw, tb, labels, stats, *options, hidden_grad=True,
                         weight_grad=True, bias_grad=True):
    check_head(sh, sw, sb, th, tw, tb, labels, DistillOptions(*options))
    return (sh.new_empty(sh.shape if hidden_grad else (0,)), sw.new_empty(sw.shape if weight_grad else (0,)),
            sh.new_empty(sb.shape if bias_grad and sb is not None else (0,)))


# ---------------------------------------------------------------------------------------------
# vocabulary slices (the vocabulary-parallel forward and backward, torch_fused/parallel_distill.py)
# ---------------------------------------------------------------------------------------------
def check_slice_stats(stats, lead, rows) -> None:
    """The whole rows' statistics given to a slice's divergence pass: [...lead, 5] in the
    accumulation dtype of ``rows`` (the student's logits or hidden states), on their device."""
    if stats is None:
        return
    want = tuple(lead) + (STATS,)
    check(tuple(stats.shape) == want and stats.dtype == acc_dtype(rows.dtype) and stats.device == rows.device,
          lambda: f"stats: expected the whole rows' statistics {want} {acc_dtype(rows.dtype)} on {rows.device}, got "
                  f"{tuple(stats.shape)} {stats.dtype} on {stats.device}")


def _slice_fakes(rows, lead, stats, opts):
    dt = acc_dtype(rows.dtype)
    stage_stats = stats is None
    return (rows.new_empty((0,) if stage_stats else lead, dtype=dt),
            rows.new_empty(lead if stage_stats and opts.compute_entropy else (0,), dtype=dt),
            rows.new_empty(tuple(lead) + (STATS,), dtype=dt))


def distill_slice_forward_fake(student, teacher, labels, stats, *options):
    opts = DistillOptions(*options)
    check_logits(student, teacher, labels, opts)
    lead = row_shape(student, opts.shift)
    check_slice_stats(stats, lead, student)
    return _slice_fakes(student, lead, stats, opts)


def linear_slice_forward_fake(sh, sw, sb, th, tw, tb, labels, stats, *options):
    opts = DistillOptions(*options)
    check_head(sh, sw, sb, th, tw, tb, labels, opts)
    lead = row_shape(sh, opts.shift)
    check_slice_stats(stats, lead, sh)
    return _slice_fakes(sh, lead, stats, opts)


def linear_slice_backward_fake(grad_div, sh, sw, sb, th, tw, tb, labels, stats, *options, hidden_grad=True,
                               weight_grad=True, bias_grad=True):
    opts = DistillOptions(*options)
    check_head(sh, sw, sb, th, tw, tb, labels, opts)
    n = math.prod(row_shape(sh, opts.shift))
    return (sh.new_empty((n, sh.shape[-1]) if hidden_grad else (0,), dtype=acc_dtype(sh.dtype)),
            sw.new_empty(sw.shape if weight_grad else (0,)),
            sh.new_empty(sb.shape if bias_grad and sb is not None else (0,)))
