"""torch-fused: fused Triton kernels for LLM training, registered as ``torch.library`` ops.

Every op lives in the ``fused`` namespace (``torch.ops.fused.<name>``); the functions here are
the documented Python entry points over them.
"""

from __future__ import annotations


import numbers as _numbers
import warnings

import torch

# The oldest torch tested to work: the whole CPU suite passes on 2.10 (triton 3.6), 2.11, 2.13 and
# 2.14, the GPU tests on 2.11. On 2.9 (triton 3.5) the compiled graph's traced kernel launches fail
# their check; on 2.6 and 2.7 the suite fails in compiled error paths, DTensor and the older
# Triton's kernels. pyproject.toml requires it; an older torch installed past it gets this warning.
MIN_TORCH = (2, 10)

from .settings import key_compile_caches_by_schemas as _key_compile_caches_by_schemas  # noqa: E402
from .settings import torch_release as _torch_release  # noqa: E402


def _torch_version_warning(version: str) -> str | None:
    """The warning for an installed torch older than MIN_TORCH, None otherwise."""
    release = _torch_release(version)
    if release is None or release >= MIN_TORCH:  # unparsable (an unusual local build): assume recent
        return None
    return (f"torch_fused needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found {version}: on older "
            "releases some ops and their compiled paths fail (tested: 2.6, 2.7 and 2.9); upgrade torch")


if (_message := _torch_version_warning(torch.__version__)) is not None:
    warnings.warn(_message, RuntimeWarning, stacklevel=2)

from . import ops as _ops  # noqa: E402,F401  (registers the fused:: ops)
from ._library import eager_eligible as _eager_eligible, is_dtensor as _is_dtensor  # noqa: E402
from .ops.logprobs import eager_core as _eager_core  # noqa: E402
from .meta.logprobs import LogprobOptions as _LogprobOptions, check_sampler as _check_sampler  # noqa: E402
from .meta.logprobs import shown as _shown  # noqa: E402

__version__ = "0.1.0"

from .masked import aggregate_loss, mask_reduce, mask_reduce_cost, masked_mean  # noqa: E402
from .packed import packed_targets  # noqa: E402
from . import optim  # noqa: E402,F401
from .optim import sinkgd_step  # noqa: E402

__all__ = [
    "selective_log_softmax",
    "entropy_from_logits",
    "logprobs_and_entropy",
    "linear_logprobs_and_entropy",
    "distill",
    "linear_distill",
    "mask_reduce",
    "mask_reduce_cost",
    "masked_mean",
    "aggregate_loss",
    "packed_targets",
    "sinkgd_step",
]


def _parallel():
    from . import parallel

    return parallel


def _no_mesh_dim(mesh_dim) -> None:
    if mesh_dim is not None:
        raise ValueError(f"mesh_dim: only for DTensor inputs (the mesh dim that shards the vocabulary), got "
                         f"mesh_dim={mesh_dim!r} with plain tensors")


def _ignore_index(value) -> int:
    """ignore_index as the ops take it: an int (not a bool) in int64's range, else an error naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ignore_index: expected an int (positions holding it give 0 and no gradient; "
                        f"default -100), got {_shown(value)}")
    if not -2**63 <= value < 2**63:
        raise ValueError(f"ignore_index: expected an int64 value, got {value}")
    return value


def _shift(value) -> bool:
    return _flag("shift", value)


def _flag(name: str, value) -> bool:
    """A bool keyword (True or False, not a truthy value), else a TypeError naming it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {_shown(value)}")
    return value


def _number(fn: str, name: str, value, *, optional: bool = False) -> float | None:
    """A float keyword of ``fn`` that the op takes as a constant: a Python real number (not a
    bool); None where ``optional``. A tensor is refused (the op's float would drop its gradient,
    and a compiled call could not read it), naming the argument."""
    if value is None and optional:
        return None
    if isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: {fn} takes a float {name} (a constant: no gradient flows to it); got "
                         f"{_shown(value)}. Pass float(t)")
    if isinstance(value, bool) or not isinstance(value, (_numbers.Real, torch.SymInt, torch.SymFloat)):
        raise TypeError(f"{name}: expected a number{' or None' if optional else ''}, got {_shown(value)}")
    return float(value)


def _sampler(top_k, top_p, min_p, logits) -> dict:
    """The sampler options given (checked), as keywords of the public ops; {} for none."""
    given = {k: v for k, v in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)) if v is not None}
    if given:
        _check_sampler(_LogprobOptions(**given))
        if _is_dtensor(logits):
            raise NotImplementedError(f"{', '.join(given)}: the sampler's support is not supported on DTensor "
                                      "(vocabulary-parallel) inputs; call with plain tensors (the full vocabulary)")
    return given


def _temperature_args(temperature, logits) -> tuple[float, torch.Tensor | None]:
    """(float temperature, temperature tensor or None) for the ops' schemas: a Python number is a
    constant of the op; a 1-element tensor is passed as ``temperature_tensor`` (differentiable).
    None means 1.0: a literal here, so torch.compile never sees a float default as an input."""
    if temperature is None:
        return 1.0, None
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            raise ValueError(f"temperature: expected a float or a 1-element tensor, got shape {tuple(temperature.shape)}")
        if temperature.device != logits.device and temperature.device.type != "cpu":
            raise ValueError(f"temperature: a tensor on {temperature.device} with logits on {logits.device}; pass it "
                             "on the logits' device (or on the CPU)")
        return 1.0, temperature.to(logits.device).reshape(())  # differentiable; a CPU scalar moves
    return float(temperature), None


def selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    *,
    temperature: float | torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    mesh_dim: int | str | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """``log_softmax(logits / temperature, -1)`` gathered at ``index``, never materialized.

    Args:
        logits: ``[..., V]`` float16/bfloat16/float32/float64; any strides in the leading dims
            (``logits[:, :-1]`` runs without a copy).
        index: ``[...]`` (one id per row) or ``[..., K]`` (K ids per row), int32 or int64.
        temperature: > 0 and finite (default None: 1.0), applied inside the kernel: a float (a constant of the op),
            or a 0-dim tensor on the logits' device, which is read on the device and
            differentiated (d T = -(1/T) sum x dx, from the same backward pass). A bad value
            raises ``ValueError``; a tensor's value is checked where reading it costs no device
            sync (CPU), and gives NaN on CUDA.
        ignore_index: positions holding it give 0 and receive no gradient.
        shift: the model's call pattern without a slice: logits ``[..., L+1, V]`` as the model
            returns them and index ``[..., L]`` (or ``[..., L, K]``); position t of the logits
            scores index t and the last position is dropped. Outputs are ``[..., L]``; the
            gradient is ``[..., L+1, V]``, zero at the last position, written in one pass (no
            slice node and no second logits-sized buffer in the autograd graph).
        mesh_dim: for DTensor logits sharded on the vocabulary (vocab-parallel), the mesh dim that
            shards it; None: the only dim of a 1-D mesh.
        top_k, top_p, min_p: the log-prob under the distribution the sampler drew from (vLLM's
            "processed logprobs"): temperature, then min-p (keep p >= min_p * max p), then top-k
            (keep logits >= the k-th largest, ties kept), then top-p (keep the most probable ids
            while the probability before them is < top_p, always the largest; a tie at the cut is
            kept whole), renormalized over the kept ids. None (or top_p 1, min_p 0) leaves the
            whole vocabulary. An id outside the support gets ``-inf`` and no gradient; gradients
            flow through the kept logits only. ``(logp == -inf)`` counts such tokens: they appear
            where the trainer's logits differ from the sampler's, and a trainer should mask them
            out of the loss (or cap their importance ratio) rather than train on them. Costs: each
            row's threshold is found by Triton kernels (CUDA) without a sort or a copy of the
            logits, in about one extra pass over the row for ``top_k`` and ``min_p`` and two for
            ``top_p``; the backward writes a row whose support holds at most 512 ids without
            reading its logits. Extra memory is O(rows) (the thresholds and those ids). On CPU
            the plain-PyTorch rule runs (a row sort for ``top_p``). Plain tensors only.

    Vocab-parallel: ``logits`` may be a DTensor with placement ``Shard(-1)`` (on a 1-D mesh, or on
    ``mesh_dim`` with ``Replicate()`` on the other mesh dims; uneven splits allowed) and ``index`` a
    plain tensor (the same on every rank) or a ``Replicate()`` DTensor. The result is then a
    ``Replicate()`` DTensor equal to the single-device result, from one all-gather of O(rows)
    partial statistics; the logits' gradient is a ``Shard(-1)`` DTensor computed locally (no
    collective). ``temperature`` must then be a float. See torch_fused/parallel.py.

    Returns:
        float32 log-probs shaped like ``index`` (float64 for float64 logits). An index outside
        ``[0, V)`` that is not ``ignore_index`` raises ``IndexError`` on CPU; on CUDA (where
        checking would cost a device sync) it gives NaN at that position and a NaN gradient row.
    """
    sampler = _sampler(top_k, top_p, min_p, logits)
    if _is_dtensor(logits):
        return _parallel().logprobs_entropy(logits, index, temperature=temperature, ignore_index=_ignore_index(ignore_index),
                                            shift=shift, mesh_dim=mesh_dim, want_ent=False)[0]
    _no_mesh_dim(mesh_dim)
    t, t_tensor = _temperature_args(temperature, logits)
    ignore_index, shift = _ignore_index(ignore_index), _shift(shift)
    if sampler:
        return torch.ops.fused.selective_log_softmax(logits, index, t, ignore_index, shift=shift,
                                                     temperature_tensor=t_tensor, **sampler)
    if _eager_eligible(logits, index, t_tensor):
        return _eager_core("fused::selective_log_softmax", logits, index, t_tensor,
                           _LogprobOptions(t, ignore_index, False, shift))
    return torch.ops.fused.selective_log_softmax(logits, index, t, ignore_index, shift=shift,
                                                 temperature_tensor=t_tensor)


def entropy_from_logits(
    logits: torch.Tensor, chunk_size: int | None = None, *, temperature: float | torch.Tensor | None = None,
    shift: bool = False, mesh_dim: int | str | None = None, top_k: int | None = None, top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """Shannon entropy (nats) of ``softmax(logits / temperature)`` per row, in one pass over V.

    ``chunk_size`` exists so TRL's call form ``entropy_from_logits(logits, chunk_size)`` keeps
    working; it is ignored (the kernel never materializes a chunk). Returns float32 (float64
    for float64 logits) of shape ``logits.shape[:-1]`` (``[..., L]`` with ``shift=True``, which
    drops the last position of ``[..., L+1, V]``). Entries of ``-inf`` are masked vocabulary and
    contribute nothing; a row of equal logits gives ``log V``. ``temperature``, ``top_k``, ``top_p``,
    ``min_p``: as in :func:`selective_log_softmax` (a tensor temperature is differentiated; the
    sampler options give the entropy of the sampler's renormalized distribution). DTensor logits ``Shard(-1)``
    and ``mesh_dim``: as in :func:`selective_log_softmax` (a ``Replicate()`` DTensor result).
    """
    del chunk_size
    sampler = _sampler(top_k, top_p, min_p, logits)
    if _is_dtensor(logits):
        return _parallel().logprobs_entropy(logits, None, temperature=temperature, shift=shift, mesh_dim=mesh_dim,
                                            want_logp=False)[1]
    _no_mesh_dim(mesh_dim)
    t, t_tensor = _temperature_args(temperature, logits)
    shift = _shift(shift)
    if sampler:
        return torch.ops.fused.entropy_from_logits(logits, t, shift=shift, temperature_tensor=t_tensor, **sampler)
    if _eager_eligible(logits, t_tensor):
        return _eager_core("fused::entropy_from_logits", logits, None, t_tensor,
                           _LogprobOptions(t, -100, True, shift))
    return torch.ops.fused.entropy_from_logits(logits, t, shift=shift, temperature_tensor=t_tensor)


def logprobs_and_entropy(
    logits: torch.Tensor,
    index: torch.Tensor,
    *,
    temperature: float | torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    mesh_dim: int | str | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(selective_log_softmax(...), entropy_from_logits(...))`` from ONE read of the logits.

    Same arguments and index semantics as :func:`selective_log_softmax`; with ``top_k``,
    ``top_p`` or ``min_p`` the entropy is that of the sampler's renormalized distribution. The backward is one
    fused pass for any combination of the two upstream gradients. DTensor logits ``Shard(-1)``
    and ``mesh_dim``: as in :func:`selective_log_softmax` (both results ``Replicate()``
    DTensors, from the same one all-gather).
    """
    sampler = _sampler(top_k, top_p, min_p, logits)
    if _is_dtensor(logits):
        return _parallel().logprobs_entropy(logits, index, temperature=temperature, ignore_index=_ignore_index(ignore_index),
                                            shift=shift, mesh_dim=mesh_dim)
    _no_mesh_dim(mesh_dim)
    t, t_tensor = _temperature_args(temperature, logits)
    ignore_index, shift = _ignore_index(ignore_index), _shift(shift)
    if sampler:
        return torch.ops.fused.logprobs_and_entropy(logits, index, t, ignore_index, shift=shift,
                                                    temperature_tensor=t_tensor, **sampler)
    if _eager_eligible(logits, index, t_tensor):
        return _eager_core("fused::logprobs_and_entropy", logits, index, t_tensor,
                           _LogprobOptions(t, ignore_index, True, shift))
    return torch.ops.fused.logprobs_and_entropy(logits, index, t, ignore_index, shift=shift,
                                                temperature_tensor=t_tensor)


def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    shift: bool = False,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    mesh_dim: int | str | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused lm_head: log-probs at ``index`` and entropy of ``softmax(z / temperature)`` with
    ``z = softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap)`` (no tanh when
    ``softcap`` is None), without ever holding the ``[N, V]`` logits.

    Args:
        hidden: ``[..., L, H]`` hidden states (``[..., L+1, H]`` with ``shift=True``: position t
            scores index t, the last position is dropped and gets zero gradient), float16,
            bfloat16 or float32 (float64 for validation).
        weight: ``[V, H]`` (``lm_head.weight``'s layout), the hidden states' dtype.
        index: ``[..., L]`` or ``[..., L, K]`` token ids, int32 or int64.
        bias: optional ``[V]``.
        temperature, ignore_index: as in :func:`selective_log_softmax`, but a float temperature (None
            means 1.0; a tensor raises ValueError: for a differentiable one, make the logits and call
            :func:`logprobs_and_entropy`).
        logit_scale: multiplies the logits (models that scale their logits before the softmax).
        softcap: caps the logits as ``c * tanh(z / c)`` (Gemma-style), or None.
        mesh_dim: for a DTensor weight, the mesh dim that shards the vocabulary (None: the only
            dim of a 1-D mesh).
        top_k, top_p, min_p: the log-prob and entropy under the sampler's support, with the rule
            of :func:`selective_log_softmax` applied to ``z / temperature`` (ids outside it give
            ``-inf`` and no gradient). The head then runs over chunks of token rows whose fp32
            logits ``[rows, V]`` it holds one chunk at a time (the ``lm_head_support_chunk_bytes``
            setting: 512 MiB on CUDA): a row's threshold needs all of its logits. With ``top_k``
            <= 512 the forward lists each row's kept ids and logits and the backward runs from
            that list without a GEMM; otherwise it recomputes each chunk's logits. Either way d
            weight is summed in fp32 ``[V, H]`` (extra memory beside the chunk). Plain tensors only.

    Vocab-parallel head: ``weight`` may be a DTensor ``Shard(0)`` (``bias`` then None or a DTensor
    placed like it), with ``hidden`` and ``index`` plain tensors (the same on every rank) or
    ``Replicate()`` DTensors. Each rank runs the fused head on its weight rows; one all-gather of
    O(rows) partial statistics gives ``Replicate()`` DTensor results equal to the single-device
    ones. Backward: d weight (d bias) stays ``Shard(0)``, local; d hidden is summed over the ranks
    with one all-reduce (fp32, rounded once to hidden's dtype).

    Returns:
        ``(logp, entropy)``, float32 (float64 for float64 inputs), shaped like ``index`` and
        ``[..., L]``. An id outside ``[0, V)`` (not ``ignore_index``) raises ``IndexError`` on CPU;
        on CUDA it gives NaN at its position and a NaN row of d hidden, with d weight and d bias
        those of the id ignored. Differentiable in ``hidden``, ``weight`` and ``bias``: exact gradients
        (nothing filtered), d logits rounded once to the weight's dtype as a materialized path
        rounds them (on CUDA; the CPU path runs its GEMMs in fp32 and keeps fp32 d logits),
        every GEMM accumulating in fp32.
    """
    sampler = _sampler(top_k, top_p, min_p, weight if _is_dtensor(weight) else hidden)
    fn = "linear_logprobs_and_entropy"
    logit_scale = _number(fn, "logit_scale", logit_scale)
    softcap = _number(fn, "softcap", softcap, optional=True)
    if _is_dtensor(weight) or _is_dtensor(hidden):
        return _parallel().linear_logprobs_and_entropy(
            hidden, weight, index, bias=bias, temperature=temperature, ignore_index=_ignore_index(ignore_index),
            shift=_shift(shift),
            logit_scale=logit_scale, softcap=softcap, mesh_dim=mesh_dim)
    _no_mesh_dim(mesh_dim)
    if temperature is None:
        temperature = 1.0
    elif isinstance(temperature, torch.Tensor):  # the op takes a float: a tensor's gradient would be lost
        raise ValueError("temperature: linear_logprobs_and_entropy takes a float temperature (no gradient flows "
                         "to it); got a tensor. Pass float(t), or make the logits and call logprobs_and_entropy, "
                         "whose temperature may be a differentiable tensor")
    return torch.ops.fused.linear_logprobs_and_entropy(
        hidden, weight, index, bias=bias, temperature=_number(fn, "temperature", temperature),
        ignore_index=_ignore_index(ignore_index), shift=_shift(shift), logit_scale=logit_scale, softcap=softcap,
        **sampler)


def distill(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None = None,
    *,
    teacher_topk_ids: torch.Tensor | None = None,
    teacher_topk_logprobs: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    reduction: str = "none",
    return_entropy: bool = False,
    tail: str = "bucket",
    mesh_dim: int | str | None = None,
):
    """The per-token divergence between a student's and a teacher's next-token distributions,
    from their logits, without a softmax or log-softmax of either held in memory.

    With p_s = softmax(student_logits / T) and p_t = softmax(teacher_logits / T) per position:
    ``beta`` 0 gives KL(p_t || p_s) (forward KL), 1 gives KL(p_s || p_t) (reverse KL), and a value
    between them the generalized Jensen-Shannon divergence
    ``beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)`` with ``m = (1 - beta) p_s + beta p_t``,
    as TRL's ``generalized_jsd_loss`` and ``ChunkedDivergenceFunction`` define them.

    Args:
        student_logits: ``[..., L, V]`` float16/bfloat16/float32/float64 (``[..., L+1, V]`` with
            ``shift=True``); any strides.
        teacher_logits: the teacher's logits, the student's shape (any float dtype). No gradient
            flows to them.
        teacher_topk_ids, teacher_topk_logprobs: instead of ``teacher_logits``, a top-k teacher:
            ``[..., L, k]`` ids (int64 or int32) and the teacher's log-probs at them (taken as
            given: no temperature is applied to them). The student's side is its
            full-vocabulary log-probs at the k ids (temperature applied). A slot whose id equals
            ``ignore_index`` or whose teacher log-prob is ``-inf`` is unused (on both sides). Their
            values are not checked (that would read them on the device): log-probs above 0, a
            total probability above 1 or an id repeated in a row give a number that is not a
            divergence. ``teacher_logit_scale`` and ``teacher_softcap`` do not apply to them
            (a ValueError unless left at 1.0 and None).
        tail: for a top-k teacher: ``"bucket"`` (default) adds a (k+1)-th category holding
            ``1 - sum p`` on each side (as TRL's ``_add_tail_bucket``, its log clamped at
            ``log(1 - exp(-1e-7))``); ``"renormalize"`` renormalizes both sides over the k ids.
        beta: in [0, 1], see above.
        temperature: a number > 0 (None: 1.0), divides both models' logits; a constant (a
            tensor is refused: no gradient flows to it).
        labels: ``[..., L]`` int; positions whose label is ``ignore_index`` give 0 and no
            gradient (their entropy is still computed). None: every position counts.
        shift: the model's call pattern: logits ``[..., L+1, V]``, labels and top-k tensors
            ``[..., L]`` / ``[..., L, k]``; position t is scored, the last position is dropped and
            gets zero gradient.
        reduction: ``"none"`` (per position), ``"sum"``, or ``"token-mean"`` (the sum over the
            kept positions divided by their count, 0 when none is kept).
        return_entropy: also return the student's entropy (nats) per position (a by-product of
            the same pass; no gradient flows through it).
        mesh_dim: for DTensor logits sharded on the vocabulary (vocab-parallel), the mesh dim that
            shards it; None: the only dim of a 1-D mesh.

    Vocab-parallel: ``student_logits`` and ``teacher_logits`` may be DTensors ``Shard(-1)`` with the
    same layout (the same mesh and placements: each rank holds both models' logits of the same
    vocabulary slice; on ``mesh_dim`` with ``Replicate()`` elsewhere; uneven splits allowed);
    ``labels`` (and a top-k teacher's tensors) plain tensors, the same on every rank, or
    ``Replicate()`` DTensors. The results are ``Replicate()`` DTensors equal to the single-device
    ones (fp32 accuracy), from O(rows) collectives only: ``beta`` 0 or 1 ONE all-gather of the
    slices' statistics and divergences (merged by the chain rule of the KL divergence); a
    ``beta`` between them TWO (an all-gather of the statistics, then an all-reduce of the
    divergence's per-slice sums: the mixture needs both models' whole-row normalizers first).
    The student logits' gradient is a ``Shard(-1)`` DTensor computed locally (no collective).
    With a top-k teacher only the student's logits are sharded: its log-probs at the k ids come
    from one all-gather, as :func:`selective_log_softmax`'s. ``temperature`` must be a float.
    See torch_fused/parallel_distill.py.

    Returns:
        float32 (float64 for float64 student logits): ``[..., L]`` with ``reduction="none"``, a
        0-dim tensor otherwise; with ``return_entropy`` the pair ``(divergence, entropy)``.
        Differentiable in ``student_logits`` only: the gradient is written once, in their dtype.
        A top-k id outside ``[0, V)`` raises ``IndexError`` on CPU and gives a NaN divergence at
        its position (and a NaN gradient row) on CUDA.
    """
    beta = _number("distill", "beta", beta)
    temperature = 1.0 if temperature is None else _number("distill", "temperature", temperature)
    return_entropy = _flag("return_entropy", return_entropy)
    if _is_dtensor(student_logits) or _is_dtensor(teacher_logits):
        from . import parallel_distill

        div, ent = parallel_distill.distill(
            student_logits, teacher_logits, teacher_topk_ids=teacher_topk_ids,
            teacher_topk_logprobs=teacher_topk_logprobs, beta=beta, temperature=temperature, labels=labels,
            ignore_index=_ignore_index(ignore_index), shift=_shift(shift), reduction=reduction,
            return_entropy=return_entropy, tail=tail, mesh_dim=mesh_dim)
        return (div, ent) if return_entropy else div
    _no_mesh_dim(mesh_dim)
    div, ent = torch.ops.fused.distill(
        student_logits, teacher_logits, teacher_topk_ids=teacher_topk_ids, teacher_topk_logprobs=teacher_topk_logprobs,
        beta=beta, temperature=temperature, labels=labels, ignore_index=_ignore_index(ignore_index),
        shift=_shift(shift), reduction=reduction, return_entropy=return_entropy, tail=tail)
    return (div, ent) if return_entropy else div


def linear_distill(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    reduction: str = "none",
    return_entropy: bool = False,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    teacher_topk_ids: torch.Tensor | None = None,
    teacher_topk_logprobs: torch.Tensor | None = None,
    tail: str = "bucket",
    mesh_dim: int | str | None = None,
):
    """:func:`distill` from both models' hidden states and lm_heads, never holding either model's
    ``[N, V]`` logits: z = softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap) (no
    tanh without a softcap) per model, then the divergence of ``softmax(z / T)``.

    Args:
        student_hidden: ``[..., L, H_s]`` (``[..., L+1, H_s]`` with ``shift=True``),
            float16/bfloat16/float32 (float64 for validation).
        student_weight: ``[V, H_s]`` (``lm_head.weight``'s layout), the hidden states' dtype;
            ``student_bias``: optional ``[V]``.
        teacher_hidden, teacher_weight, teacher_bias: the teacher's, the same leading shape and
            vocabulary; its hidden size and dtype may differ from the student's. No gradient
            flows to them.
        teacher_topk_ids, teacher_topk_logprobs, tail: a top-k teacher instead of its hidden
            states and head, as in :func:`distill`; only the student's head is computed.
        student_logit_scale, teacher_logit_scale, student_softcap, teacher_softcap: each head's
            logit scale and softcap (Gemma-style ``c * tanh(z / c)``), before the temperature.
        beta, temperature, labels, ignore_index, shift, return_entropy: as in :func:`distill`.
        reduction: ``"none"``: the per-token divergence; the forward keeps only O(N) row
            statistics and the backward recomputes both models' logits chunk by chunk.
            ``"sum"`` / ``"token-mean"``: a 0-dim loss whose gradients are computed in the
            forward (its weights are known there) and kept in fp32 (d hidden, d weight
            ``[V, H_s]``, d bias) until the backward, which only scales them by the upstream
            gradient: no GEMM is recomputed. For a full teacher; a top-k teacher's loss
            is reduced after the head's log-probs (its backward recomputes the student's head).
        mesh_dim: for DTensor weights, the mesh dim that shards the vocabulary (None: the only
            dim of a 1-D mesh).

    Vocab-parallel heads: ``student_weight`` and ``teacher_weight`` may be DTensors ``Shard(0)``
    with the same layout (each bias, if any, a DTensor placed like its weight), the hidden states
    and ``labels`` plain tensors (the same on every rank) or ``Replicate()`` DTensors. Each rank runs
    the chunk loop on its rows of both heads; the collectives are those of :func:`distill` (one
    all-gather of O(rows) for ``beta`` 0 or 1, an all-gather and an all-reduce for the JSD, whose
    second pass recomputes the rank's GEMMs). Results are ``Replicate()`` DTensors equal to the
    single-device ones. Backward: d weight and d bias stay ``Shard(0)`` (local); d hidden is summed
    over the ranks with ONE all-reduce of ``[N, H_s]`` (fp32, rounded once to hidden's dtype). With
    ``"sum"`` / ``"token-mean"`` the loss is reduced from the per-token divergence and the backward
    recomputes the rank's GEMMs (its gradients need the whole rows' statistics, known only after
    the forward's collective). A top-k teacher needs only ``student_weight`` sharded (one
    all-gather, as :func:`linear_logprobs_and_entropy`'s).

    Returns:
        as :func:`distill`. Gradients flow to ``student_hidden``, ``student_weight`` and
        ``student_bias`` only: exact (nothing filtered), d logits rounded once to the student
        weight's dtype (on CUDA; the CPU path keeps them in fp32), every GEMM accumulating in fp32.
    """
    fn = "linear_distill"
    beta = _number(fn, "beta", beta)
    temperature = 1.0 if temperature is None else _number(fn, "temperature", temperature)
    return_entropy = _flag("return_entropy", return_entropy)
    scales = dict(student_logit_scale=_number(fn, "student_logit_scale", student_logit_scale),
                  teacher_logit_scale=_number(fn, "teacher_logit_scale", teacher_logit_scale),
                  student_softcap=_number(fn, "student_softcap", student_softcap, optional=True),
                  teacher_softcap=_number(fn, "teacher_softcap", teacher_softcap, optional=True))
    if any(_is_dtensor(t) for t in (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                                    teacher_bias)):
        from . import parallel_distill

        div, ent = parallel_distill.linear_distill(
            student_hidden, student_weight, teacher_hidden, teacher_weight, beta=beta, temperature=temperature,
            labels=labels, ignore_index=_ignore_index(ignore_index), shift=_shift(shift), reduction=reduction,
            return_entropy=return_entropy, student_bias=student_bias, teacher_bias=teacher_bias, **scales,
            teacher_topk_ids=teacher_topk_ids, teacher_topk_logprobs=teacher_topk_logprobs, tail=tail,
            mesh_dim=mesh_dim)
        return (div, ent) if return_entropy else div
    _no_mesh_dim(mesh_dim)
    div, ent = torch.ops.fused.linear_distill(
        student_hidden, student_weight, teacher_hidden, teacher_weight, beta=beta,
        temperature=temperature, labels=labels, ignore_index=_ignore_index(ignore_index), shift=_shift(shift),
        reduction=reduction, return_entropy=return_entropy, student_bias=student_bias,
        teacher_bias=teacher_bias, **scales,
        teacher_topk_ids=teacher_topk_ids, teacher_topk_logprobs=teacher_topk_logprobs, tail=tail)
    return (div, ent) if return_entropy else div


# every op is registered now: torch.compile's caches are keyed by their schemas (settings.py)
_key_compile_caches_by_schemas()


def __dir__():
    """The public API (the functions above, ``optim`` and ``__version__``), not the modules and
    names the package imports to build it."""
    return sorted(__all__ + ["optim", "__version__"])
