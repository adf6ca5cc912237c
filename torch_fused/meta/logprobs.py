"""The log-prob family's options, input checks and fake (meta) implementations.

``LogprobOptions`` is the one list of the family's non-tensor arguments. The core ops' schemas
(ops/logprobs.py), the public ops' keyword tails, the fakes here, the launch plans' keys, the
autograd formula's gradient tuple, the reference (reference.py), the vocabulary-parallel ops
(parallel.py) and the fused head's use of the logits kernels all follow from it, and it is the
only thing passed between them.

Adding a keyword to the log-prob ops:
1. a field of ``LogprobOptions`` with its default: ``_public(default)`` when users pass it (the
   public ops and their schemas then take it as a keyword-only argument), ``core=False`` when the
   public ops apply it around the core ops rather than the kernels (as the sampler's top_k,
   top_p, min_p: fused::_sampler_threshold turns them into one threshold per row, which the
   core ops take as a tensor; reference.sampler_threshold);
2. its check in ``check_options`` (here);
3. its effect: in the reference (reference.py) and in the kernels' host code or the kernels
   (ops/logprobs.py, kernels/logprobs.py), both reading ``opts.<field>``; or, for a field the
   core does not see, in the public ops' composite (ops/logprobs.py ``_composite``);
4. the public functions' keyword (torch_fused/__init__.py), passed on in the options.
Nothing else changes: schemas, fakes, plan keys, gradient tuples and the parallel and head
routes take the object whole.

``check_options`` (over ``check_logits_index``) is the one validation function, called by the
fakes and by every implementation, so eager and compiled calls fail with the same message. It
reads shapes and dtypes only, never data.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._library import FLOAT_DTYPES, INDEX_DTYPES, acc_dtype, check, check_value


# the schema type of each LogprobOptions field's annotation
_SCHEMA_TYPES = {"float": "float", "int": "SymInt", "bool": "bool", "int | None": "SymInt?", "float | None": "float?"}
# the public ops' own spelling of a field's type (their schemas predate the options)
_PUBLIC_TYPES = {"float": "float", "int": "int", "bool": "bool", "int | None": "int?", "float | None": "float?"}


def _public(default, core=True):
    """A field users pass as a keyword of the public ops; ``core=False``: one the public ops apply
    around the core ops (which neither take nor see it)."""
    return dataclasses.field(default=default, metadata={"public": True, "core": core})


@dataclasses.dataclass(frozen=True)
class LogprobOptions:
    """The log-prob family's non-tensor arguments, in the core ops' schema order (after their
    tensors: logits, index and the tensor temperature), with the public functions' defaults.
    Frozen and hashable: a launch plan's key holds it whole.

    temperature: the float temperature (a placeholder 1.0 where a tensor temperature is given);
    ignore_index: positions holding it give 0 and no gradient;
    compute_entropy: whether the core also makes the entropy (set by the public op, not a keyword);
    shift: the logits are [..., L+1, V] and position t scores index t (the last one dropped);
    top_k, top_p, min_p: the sampler's support (sampler_threshold in reference.py), applied by the
    public ops around the core ops (which take the rows' thresholds and support lists as tensors
    after these fields): None (or top_p 1, min_p 0) leaves the whole vocabulary."""
    temperature: float = 1.0
    ignore_index: int = -100
    compute_entropy: bool = True
    shift: bool = _public(False)
    top_k: int | None = _public(None, core=False)
    top_p: float | None = _public(None, core=False)
    min_p: float | None = _public(None, core=False)

    @classmethod
    def core_fields(cls) -> tuple:
        return tuple(f for f in dataclasses.fields(cls) if f.metadata.get("core", True))

    def values(self) -> tuple:
        """The core fields in order: the core ops' positional arguments after their tensors. (By
        names fixed at import: Dynamo traces this in the vocabulary-parallel paths, and cannot
        trace ``dataclasses.fields`` of the class.)"""
        return tuple(getattr(self, name) for name in _CORE_NAMES)

    @classmethod
    def count(cls) -> int:
        return len(cls.core_fields())

    @classmethod
    def schema(cls) -> str:
        """The core fields as schema arguments, e.g. ``float temperature, SymInt ignore_index, ...``."""
        return ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}" for f in cls.core_fields())

    def restricts_support(self) -> bool:
        """Whether the sampler options leave out part of the vocabulary."""
        return restricts_support(self)

    @classmethod
    def public_fields(cls) -> tuple:
        """The keyword-only fields of the public ops, in order (shift first)."""
        return tuple(f for f in dataclasses.fields(cls) if f.metadata.get("public"))

    @classmethod
    def public_schema_tail(cls) -> str:
        """The public ops' keyword-only arguments: the public fields with their defaults, then
        the tensor temperature."""
        parts = [f"{_PUBLIC_TYPES[f.type]} {f.name}={f.default!r}" for f in cls.public_fields()]
        return "*, " + ", ".join(parts + ["Tensor? temperature_tensor=None"])


_CORE_NAMES = tuple(f.name for f in LogprobOptions.core_fields())


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


# the most kept ids a row's support list holds: top_k up to 256 with ties, and most min-p and
# top-p supports of peaked distributions
SUPPORT_CAP = 512


def support_shape(logits: torch.Tensor, shift: bool) -> tuple:
    return (math.prod(row_shape(logits, shift)), SUPPORT_CAP + 1)


def check_support(logits: torch.Tensor, shift: bool, threshold: torch.Tensor | None,
                  support: torch.Tensor | None) -> None:
    """A log-prob core op's threshold and support list, as _sampler_threshold makes them for these
    logits (shapes and dtypes only)."""
    if threshold is not None:
        lead = row_shape(logits, shift)
        check(tuple(threshold.shape) == tuple(lead) and threshold.dtype == acc_dtype(logits.dtype),
              lambda: f"threshold: expected {acc_dtype(logits.dtype)} of shape {tuple(lead)} (one per row), got "
                      f"{threshold.dtype} of shape {tuple(threshold.shape)}")
    if support is not None:
        want = support_shape(logits, shift)
        check(threshold is not None and tuple(support.shape) == want and support.dtype == torch.int32,
              lambda: f"support: expected int32 of shape {want} beside a threshold, got {support.dtype} of shape "
                      f"{tuple(support.shape)}" + ("" if threshold is not None else " without one"))


def restricts_support(opts) -> bool:
    """Whether options with the sampler's fields (``top_k``, ``top_p``, ``min_p``: the log-prob
    family's or the fused head's) leave out part of the vocabulary."""
    return (opts.top_k is not None or (opts.top_p is not None and opts.top_p < 1.0)
            or (opts.min_p is not None and opts.min_p > 0.0))


def shown(value) -> str:
    """A value as an error message shows it: a tensor by its type and shape (torch.compile traces
    no repr() of a tensor), anything else by repr()."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)


def check_sampler(opts) -> None:
    """The sampler options' values (ValueError, naming the option)."""
    k, p, mp = opts.top_k, opts.top_p, opts.min_p
    if k is not None:
        check_value(isinstance(k, int) and not isinstance(k, bool) and k >= 1,
                    lambda: f"top_k: expected None or an int >= 1, got {shown(k)}")
        check_value(k < 2**63, lambda: f"top_k: expected an int64 value, got {k}")
    if p is not None:
        check_value(not isinstance(p, bool) and isinstance(p, (int, float)) and 0.0 < p <= 1.0,
                    lambda: f"top_p: expected None or a number in (0, 1], got {shown(p)}")
    if mp is not None:
        check_value(not isinstance(mp, bool) and isinstance(mp, (int, float)) and 0.0 <= mp <= 1.0,
                    lambda: f"min_p: expected None or a number in [0, 1], got {shown(mp)}")


def check_options(logits: torch.Tensor, index: torch.Tensor | None, temperature_t: torch.Tensor | None,
                  opts: LogprobOptions) -> None:
    """The checks of a log-prob op's call: its tensors and its options."""
    check_sampler(opts)
    check_logits_index(logits, index, opts.temperature, temperature_t, opts.shift)


def split_core_args(rest) -> tuple:
    """(options, threshold, support) of a core op's arguments after its leading tensors: the core
    fields' values, then the optional threshold and support list (absent or None: the whole
    vocabulary)."""
    n = LogprobOptions.count()
    extra = tuple(rest[n:]) + (None, None)
    return LogprobOptions(*rest[:n]), extra[0], extra[1]


def logprobs_entropy_forward_fake(logits, index, temperature_t, *rest):
    opts, threshold, support = split_core_args(rest)
    check_options(logits, index, temperature_t, opts)
    check_support(logits, opts.shift, threshold, support)
    dt = acc_dtype(logits.dtype)
    lead = row_shape(logits, opts.shift)
    logp = logits.new_empty(index.shape if index is not None else (0,), dtype=dt)
    ent = logits.new_empty(lead if opts.compute_entropy else (0,), dtype=dt)
    stats = logits.new_empty(lead + (2,), dtype=dt)
    return logp, ent, stats


def logprobs_entropy_backward_fake(grad_logp, grad_entropy, logits, index, stats, entropy, temperature_t, *rest,
                                   temperature_grad=True):
    opts, threshold, support = split_core_args(rest)
    check_options(logits, index, temperature_t, opts)
    check_support(logits, opts.shift, threshold, support)
    from ..reference import temperature_grad_dtype

    dt_dtype = temperature_grad_dtype(logits, temperature_t)
    dt = logits.new_empty((), dtype=dt_dtype) if temperature_t is not None and temperature_grad else \
        logits.new_empty((0,), dtype=dt_dtype)
    return logits.new_empty(logits.shape), dt


def slice_backward_fake(grad_logp, grad_entropy, logits, index, stats, entropy, *options, v_off, v_total):
    return logits.new_empty(logits.shape)
