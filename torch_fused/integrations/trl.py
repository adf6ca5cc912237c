"""Route TRL's log-prob, entropy and distillation-divergence computations to torch_fused.

    import torch_fused.integrations.trl as tf_trl
    tf_trl.patch()                      # before or after building the trainer
    trainer.train()
    tf_trl.unpatch()                    # or: with tf_trl.patched(): trainer.train()

What ``patch()`` replaces, in ``trl.trainer.utils``, ``trl.kernels`` (where present) and every
already-imported ``trl.*`` module holding the original function object (modules imported later
take the names from ``trl.trainer.utils`` and so get the replacements too):

=========================================  ===============================================  ==========
TRL name                                   routed to                                        tested TRL
=========================================  ===============================================  ==========
``selective_log_softmax``                  :func:`torch_fused.selective_log_softmax`        1.13-1.16
``entropy_from_logits``                    :func:`torch_fused.entropy_from_logits`          1.13-1.16
``selective_log_softmax_and_entropy``      :func:`torch_fused.logprobs_and_entropy`         1.14, 1.16
(``trl.trainer.utils``, ``trl.kernels``)
``ChunkedLogProbFunction`` (the chunked    :func:`torch_fused.linear_logprobs_and_entropy`  1.16
lm_head; ``fused_lm_head=False`` leaves
it to TRL)
``_chunked_divergence_loss``               :func:`torch_fused.linear_distill`, reduced      1.13-1.16
(``DistillationTrainer``'s loss)           (``"token-mean"``, or ``"sum"`` over
                                           ``num_items_in_batch``)
``ChunkedDivergenceFunction``              :func:`torch_fused.linear_distill`, per token    1.16
(``trl.kernels.chunked_divergence``)
``GKDTrainer.generalized_jsd_loss``        :func:`torch_fused.distill`, ``"sum"``           1.13-1.16
(``trl.experimental.gkd``; where loaded
before ``patch()``)
=========================================  ===============================================  ==========

The last three are the distillation route (``distill=False`` leaves them to TRL).

Each replacement keeps TRL's signature (checked against the installed function at patch time)
and its return conventions: the output dtype TRL's own function would return for those inputs
(float32 where TRL's Triton kernel would run, the logits' dtype where TRL's PyTorch fallback would
run), ``row_mask`` rows zero with no gradient, ``entropy_requires_grad=False`` detaches the
entropy, ``chunk_size`` is accepted and ignored (the fused ops never materialize a chunk). Calls
outside what the fused ops compute with the same semantics go to TRL's original function:
a tensor temperature or a non-positive one (TRL raises), index shapes other than ``logits.shape[:-1]``
(and ``[..., K]`` for ``selective_log_softmax``), index dtypes other than int32/int64, devices
other than CPU and CUDA, DTensor inputs, fewer than 2 logits dims.

Differences that remain: the fused ops read an index of ``-100`` as ignored (log-prob 0, no
gradient) where TRL's fallback raises and its kernel reads out of bounds; a row holding ``-inf``
logits (masked vocabulary) has a finite entropy where TRL's PyTorch fallback gives NaN; and the
results are the fp32-accurate values, rounded once to TRL's output dtype.

The lm_head route. In TRL 1.16, ``GRPOTrainer`` (and the DPO, KTO, RLOO and SFT trainers) compute
every per-token log-prob through TRL's chunked lm_head (``add_fused_lm_head`` ->
``trl.trainer.utils._ChunkedLogProbFunction``), never through the logits functions, so there the
default ``patch()`` routes that chunked head (``fused_lm_head=False`` leaves it, and with it those
trainers' numbers, to TRL; the logits functions serve TRL's experimental trainers and user code).
In TRL 1.13 and 1.14, ``GRPOTrainer`` works on materialized logits (1.13: ``selective_log_softmax``
and ``entropy_from_logits``; 1.14: ``selective_log_softmax_and_entropy`` with ``temperature`` and
``row_mask``) and the default ``patch()`` routes them. Their ``_ChunkedLogProbFunction`` has two
outputs (1.14's GRPOTrainer runs it with ``use_liger_kernel``) and is left to TRL (the default says
so at patch time); ``fused_lm_head=True`` raises there.

The lm_head route is on by default where TRL has the form it adapts (TRL 1.16): measured in one
run against TRL's chunked head, ours is faster at every benchmark shape with a fraction of the
memory (docs/BENCHMARKS.md, "Fused lm_head", holds the figures and the command). Under
autocast the route casts ``lm_head.weight`` to the autocast dtype in one piece (TRL casts chunk by
chunk): with fp32 weights under bf16 autocast that is one bf16 copy of the weight. Calls with
DeepSpeed ZeRO-3 parameters (whose backward must re-gather the weight) or a non-positive logit
scale or softcap go to TRL's class. Requested diagnostic outputs (``log_sum_sq_probs``,
``mean_logits``, ``is_top1``, no gradient) cost one more forward pass over the lm_head GEMM, in
the compute dtype as TRL's tiles.

The distillation route. TRL's ``DistillationTrainer`` computes its loss in
``_chunked_divergence_loss``: both models' hidden states and lm_heads, the per-token divergence
(TRL 1.16: from ``ChunkedDivergenceFunction``, whose backward projects both heads again; 1.13 and
1.14: a checkpointed loop over chunks of materialized logits, rounded to the compute dtype, with
a ``chunk_size`` argument that the route accepts and ignores), summed over the completion mask
and divided by ``num_items_in_batch``. The route replaces that function with a
reduced-mode call of :func:`torch_fused.linear_distill`: the student's gradients are formed in the
forward pass, where the loss's weights are known, and the backward only scales them (no GEMM is
recomputed; the price is an fp32 ``[V, H]`` d-weight buffer held from the forward to the
backward). On CUDA only the completion positions are projected, as TRL does on a Triton device.
The logged entropy is the student's, as TRL's. An lm_head bias enters in the compute dtype
(TRL adds it in fp32). ``ChunkedDivergenceFunction`` itself (for other
callers) is routed to the per-token mode. ``GKDTrainer.generalized_jsd_loss`` (materialized
logits, ``labels`` of -100 dropped) goes to :func:`torch_fused.distill` for the reductions
``batchmean``, ``sum``, ``mean`` and ``num_items_in_batch``; ``reduction="none"`` (a per-element
result) and a teacher that requires a gradient stay with TRL. ``patch()`` does not import
``trl.experimental`` (its import prints TRL's notice): import ``GKDTrainer`` before ``patch()``,
or call ``patch()`` again after importing it. Calls that stay with TRL: DeepSpeed ZeRO-3
parameters, beta outside [0, 1], a non-positive temperature, logit scale or softcap, compute
dtypes other than fp16/bf16/fp32, devices other than CPU/CUDA. FSDP2's DTensor lm_heads are
gathered once into full tensors, as TRL's loss does.

Versions: the TRL versions in ``TESTED_TRL_VERSIONS``. On any other version ``patch()`` raises
:class:`UnsupportedTRLVersion`; ``patch(strict=False)`` patches anyway, with a warning, every
function whose signature matches a tested form (for a TRL patch release, say), and skips the rest.
TRL 1.15 is not tested: its chunked lm_head launches Triton kernels on any device, so its
GRPOTrainer cannot run on CPU. Releases before 1.13 are not tested.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import sys
import warnings

import torch

import torch_fused as _tf
from torch_fused._library import is_dtensor as _is_dtensor

__all__ = [
    "patch",
    "unpatch",
    "patched",
    "is_patched",
    "patched_names",
    "UnsupportedTRLVersion",
    "TESTED_TRL_VERSIONS",
    "FUSED_LM_HEAD_TRL_VERSIONS",
    "DISTILL_TRL_VERSIONS",
]

# The TRL versions this module is tested against (tests/test_trl_integration.py runs GRPOTrainer on
# each); the `trl` extra admits these and no other release between them. 1.13.0 and 1.14.2 compute
# GRPO's log-probs from materialized logits (1.13: selective_log_softmax, entropy_from_logits; 1.14: their
# temperature/row_mask forms and selective_log_softmax_and_entropy); from 1.15 every trainer runs a
# chunked lm_head behind `add_fused_lm_head`. 1.15.0's chunked lm_head needs a GPU (Triton kernels
# on any device), so it cannot be tested on CPU.
TESTED_TRL_VERSIONS = ("1.13.0", "1.14.2", "1.16.0")
# Versions whose chunked lm_head (ChunkedLogProbFunction, 5 outputs) `fused_lm_head=True` routes.
FUSED_LM_HEAD_TRL_VERSIONS = ("1.16.0",)
# Versions whose DistillationTrainer loss (_chunked_divergence_loss: 1.13 and 1.14 with a chunk_size
# argument) and GKDTrainer.generalized_jsd_loss the distillation route adapts; TRL 1.16 also has
# trl.kernels.chunked_divergence.ChunkedDivergenceFunction.
DISTILL_TRL_VERSIONS = ("1.13.0", "1.14.2", "1.16.0")

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LM_HEAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX = (torch.int32, torch.int64)
_DEVICES = ("cpu", "cuda")
_IGNORE = -100  # the fused ops' ignore_index; masked rows get it so that they are never read
_DIAG_TILE = 1 << 24  # elements of one fp32 tile of the lm_head diagnostics pass (64 MiB)


class UnsupportedTRLVersion(RuntimeError):
    """The installed TRL is not a version this integration is tested against."""


# ------------------------------------------------------------------------------------------------
# argument checks shared by the adapters: False sends the call to TRL's original function



def _plain_tensor(t, dtypes) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in dtypes and not _is_dtensor(t)


def _positive_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _routable_logits(logits) -> bool:
    return (_plain_tensor(logits, _FLOAT) and logits.dim() >= 2 and logits.shape[-1] > 0
            and logits.device.type in _DEVICES)


def _routable_index(logits, index, *, k_ok: bool) -> bool:
    if not _plain_tensor(index, _INDEX) or index.device != logits.device:
        return False
    if index.shape == logits.shape[:-1]:
        return True
    return k_ok and index.dim() == logits.dim() and index.shape[:-1] == logits.shape[:-1]


def _routable_mask(row_mask, index) -> bool:
    return row_mask is None or (isinstance(row_mask, torch.Tensor) and not _is_dtensor(row_mask)
                                and row_mask.shape == index.shape and row_mask.device == index.device)


def _ignore_masked(index, row_mask):
    """Masked rows get the ignore index: log-prob 0, no gradient, and their index never read."""
    return index if row_mask is None else index.masked_fill(row_mask == 0, _IGNORE)


# ------------------------------------------------------------------------------------------------
# adapters; each factory returns a function with TRL's exact signature (checked in patch())


def _trl_dtype_rule(utils):
    """The output dtype TRL's own function returns: float32 where its Triton kernel runs
    (``_supports_trl_loss_kernel``, TRL >= 1.14, asked at each call), else the logits' dtype
    (its PyTorch path)."""
    kernel = getattr(utils, "_fused_logprob_entropy", None) is not None

    def dtype(logits, index=None, row_mask=None):
        supports = getattr(utils, "_supports_trl_loss_kernel", None)
        if supports is not None and kernel and supports(logits, index, row_mask):
            return torch.float32
        return logits.dtype

    return dtype


def _selective_log_softmax_2(original, utils):
    """TRL <= 1.13: ``selective_log_softmax(logits, index)``, output in the logits' dtype."""

    def selective_log_softmax(logits, index):
        if not (_routable_logits(logits) and _routable_index(logits, index, k_ok=True)):
            return original(logits, index)
        return _tf.selective_log_softmax(logits, index).to(logits.dtype)

    return selective_log_softmax


def _selective_log_softmax_4(original, utils):
    """TRL >= 1.14: ``selective_log_softmax(logits, index, temperature=1.0, row_mask=None)``."""
    out_dtype = _trl_dtype_rule(utils)

    def selective_log_softmax(logits, index, temperature=1.0, row_mask=None):
        if not (_positive_number(temperature) and _routable_logits(logits)
                and _routable_index(logits, index, k_ok=True) and _routable_mask(row_mask, index)):
            return original(logits, index, temperature, row_mask)
        logp = _tf.selective_log_softmax(logits, _ignore_masked(index, row_mask), temperature=float(temperature))
        return logp.to(out_dtype(logits, index, row_mask))

    return selective_log_softmax


def _entropy_from_logits(original, utils):
    """``entropy_from_logits(logits, chunk_size=128)`` (all versions); chunk_size is a memory knob
    of TRL's loop, meaningless for the fused op."""
    out_dtype = _trl_dtype_rule(utils)

    def entropy_from_logits(logits, chunk_size=128):
        if not _routable_logits(logits):
            return original(logits, chunk_size)
        return _tf.entropy_from_logits(logits).to(out_dtype(logits))

    return entropy_from_logits


def _selective_log_softmax_and_entropy_utils(original, utils):
    """TRL >= 1.14 ``trl.trainer.utils.selective_log_softmax_and_entropy(logits, index,
    entropy_requires_grad=True, temperature=1.0, row_mask=None) -> (logprobs, entropy)``."""
    out_dtype = _trl_dtype_rule(utils)

    def selective_log_softmax_and_entropy(logits, index, entropy_requires_grad=True, temperature=1.0,
                                          row_mask=None):
        if not (_positive_number(temperature) and _routable_logits(logits)
                and _routable_index(logits, index, k_ok=False) and _routable_mask(row_mask, index)):
            return original(logits, index, entropy_requires_grad, temperature, row_mask)
        logp, ent = _tf.logprobs_and_entropy(logits, _ignore_masked(index, row_mask), temperature=float(temperature))
        # TRL's dtypes: both from its kernel where it takes (logits, index, row_mask); else log-probs
        # from its PyTorch path and the entropy from entropy_from_logits, whose kernel asks about
        # the logits alone (a float row mask: log-probs in the logits' dtype, entropy float32 on CUDA)
        logp, ent = logp.to(out_dtype(logits, index, row_mask)), ent.to(out_dtype(logits))
        if row_mask is not None:
            ent = ent.masked_fill(row_mask == 0, 0.0)
        return logp, (ent if entropy_requires_grad else ent.detach())

    return selective_log_softmax_and_entropy


def _selective_log_softmax_and_entropy_kernel(original, utils):
    """TRL >= 1.14 ``trl.kernels.selective_log_softmax_and_entropy(logits, index, temperature=1.0,
    row_mask=None) -> (logprobs, entropy)``, both float32 (TRL's Triton kernel)."""

    def selective_log_softmax_and_entropy(logits, index, temperature=1.0, row_mask=None):
        if not (_positive_number(temperature) and _routable_logits(logits)
                and _routable_index(logits, index, k_ok=False) and _routable_mask(row_mask, index)):
            return original(logits, index, temperature, row_mask)
        logp, ent = _tf.logprobs_and_entropy(logits, _ignore_masked(index, row_mask), temperature=float(temperature))
        if row_mask is not None:
            ent = ent.masked_fill(row_mask == 0, 0.0)
        return logp, ent

    return selective_log_softmax_and_entropy


@torch.no_grad()
def _lm_head_diagnostics(h, w, b, targets, inv_t, logit_scale, softcap, want, chunk_size):
    """TRL's optional per-token outputs of the chunked lm_head, without gradient: one pass over
    ``h @ w.T`` in tiles of at most ``_DIAG_TILE`` fp32 elements, the tiles computed in the compute
    dtype and transformed in fp32 as TRL's kernel does. Returns {name: tensor} for ``want``."""
    n, v = h.shape[0], w.shape[0]
    f32 = dict(device=h.device, dtype=torch.float32)
    run_max = torch.full((n,), -math.inf, **f32)
    sum_exp = torch.zeros(n, **f32)
    sq_sum_exp = torch.zeros(n, **f32)
    z_sum = torch.zeros(n, **f32)
    before = torch.full((n,), -math.inf, **f32)  # max logit over the columns left of the target
    target_z = torch.zeros(n, **f32)
    cols = max(1, min(int(chunk_size), v, _DIAG_TILE))
    rows = max(1, _DIAG_TILE // cols)
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        hr, tr = h[r0:r1], targets[r0:r1]
        for c0 in range(0, v, cols):
            c1 = min(c0 + cols, v)
            z = torch.mm(hr, w[c0:c1].t())
            if b is not None:
                z += b[c0:c1]
            z = z.float() * logit_scale
            if softcap is not None:
                z = softcap * torch.tanh(z / softcap)
            z = z * inv_t
            if "mean_logits" in want:
                z_sum[r0:r1] += z.sum(-1)
            local = tr - c0
            if "is_top1" in want:
                left = torch.arange(c1 - c0, device=z.device) < local.unsqueeze(-1)
                before[r0:r1] = torch.maximum(before[r0:r1], z.masked_fill(~left, -math.inf).amax(-1))
            in_tile = (local >= 0) & (local < c1 - c0)
            picked = z.gather(-1, local.clamp(0, c1 - c0 - 1).unsqueeze(-1)).squeeze(-1)
            target_z[r0:r1] = torch.where(in_tile, picked, target_z[r0:r1])
            new_max = torch.maximum(run_max[r0:r1], z.amax(-1))
            rescale = torch.exp(run_max[r0:r1] - new_max)
            e = torch.exp(z - new_max.unsqueeze(-1))
            sum_exp[r0:r1] = sum_exp[r0:r1] * rescale + e.sum(-1)
            if "log_sum_sq_probs" in want:
                sq_sum_exp[r0:r1] = sq_sum_exp[r0:r1] * rescale * rescale + (e * e).sum(-1)
            run_max[r0:r1] = new_max
    out = {}
    if "log_sum_sq_probs" in want:
        out["log_sum_sq_probs"] = torch.log(sq_sum_exp) - 2 * torch.log(sum_exp)
    if "mean_logits" in want:
        out["mean_logits"] = z_sum / v
    if "is_top1" in want:
        # the first maximum counts: a tie with an earlier token is not a top-1 prediction
        out["is_top1"] = (target_z >= run_max) & (target_z > before)
    return out


def _chunked_logprob_5(original, optional_outputs):
    """TRL >= 1.15 ``ChunkedLogProbFunction`` (``trl.kernels``; ``trl.trainer.utils._ChunkedLogProbFunction``):
    ``.apply(hidden [N, H], weight [V, H], bias, targets [N], temperature, chunk_size,
    final_logit_softcapping=None, logit_scale=1.0, outputs=OPTIONAL_OUTPUTS)`` returning
    ``(logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each but the first None unless
    named in ``outputs``; float32 (is_top1 bool); the last three without gradient."""

    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=optional_outputs):
        args = (hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale,
                outputs)
        dev = hidden.device if isinstance(hidden, torch.Tensor) else None
        if not (dev is not None and dev.type in _DEVICES
                and _plain_tensor(hidden, _FLOAT) and hidden.dim() == 2
                and _plain_tensor(weight, _FLOAT) and weight.dim() == 2 and weight.shape[0] > 0
                and not hasattr(weight, "ds_id")  # DeepSpeed ZeRO-3: TRL's backward re-gathers it
                and (bias is None or _plain_tensor(bias, _FLOAT))
                and _plain_tensor(targets, _INDEX) and targets.dim() == 1
                and _positive_number(temperature) and _positive_number(logit_scale)
                and (final_logit_softcapping is None or _positive_number(final_logit_softcapping))):
            return original.apply(*args)
        cd = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else hidden.dtype
        if cd not in _LM_HEAD_DTYPES:
            return original.apply(*args)
        softcap = None if final_logit_softcapping is None else float(final_logit_softcapping)
        with torch.autocast(dev.type, enabled=False):
            h, w = hidden.to(cd), weight.to(cd)
            b = None if bias is None else bias.to(cd)
            logp, ent = _tf.linear_logprobs_and_entropy(h, w, targets, bias=b, temperature=float(temperature),
                                                        logit_scale=float(logit_scale), softcap=softcap)
            want = {"log_sum_sq_probs", "mean_logits", "is_top1"}.intersection(outputs)
            diag = (_lm_head_diagnostics(h.detach(), w.detach(), None if b is None else b.detach(), targets,
                                         1.0 / float(temperature), float(logit_scale), softcap, want, chunk_size)
                    if want else {})
        return (logp, ent if "entropy" in outputs else None, diag.get("log_sum_sq_probs"),
                diag.get("mean_logits"), diag.get("is_top1"))

    # A class, as TRL's: callers write `ChunkedLogProbFunction.apply(...)`.
    return type("ChunkedLogProbFunction", (), {
        "__doc__": "TRL's ChunkedLogProbFunction call form, routed to torch_fused.linear_logprobs_and_entropy.",
        "__module__": __name__,
        "apply": staticmethod(apply),
        "torch_fused_original": original,
    })


# ------------------------------------------------------------------------------------------------
# the distillation divergence: DistillationTrainer (TRL 1.13-1.16) and GKDTrainer


def _number_in_unit(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 <= x <= 1.0


def _zero3(t) -> bool:
    return hasattr(t, "ds_id")  # a DeepSpeed ZeRO-3 parameter: TRL gathers it around each use


def _compute_dtype(t):
    """TRL's compute dtype of a head: the autocast dtype where autocast is on, else the hidden
    states' dtype."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


def _routable_heads(hs, ws, bs, ht, wt, bt, beta, temperature, scales, softcaps, *, flat: bool) -> bool:
    """Whether a two-head divergence call has the semantics of torch_fused.linear_distill: plain
    float tensors on one CPU/CUDA device (2-D hidden states where ``flat``), no ZeRO-3
    parameters, beta in [0, 1], a positive temperature and logit scales, softcaps None or
    positive, compute dtypes fp16/bf16/fp32."""
    if not (_plain_tensor(hs, _FLOAT) and hs.device.type in _DEVICES and hs.dim() >= 1):
        return False
    for t in (ws, ht, wt) + tuple(b for b in (bs, bt) if b is not None):
        if not _plain_tensor(t, _FLOAT) or t.device != hs.device or _zero3(t):
            return False
    if (flat and (hs.dim() != 2 or ht.dim() != 2)) or ws.dim() != 2 or wt.dim() != 2 or ws.shape[0] == 0:
        return False
    if hs.shape[-1] != ws.shape[1] or ht.shape[-1] != wt.shape[1] or hs.shape[:-1] != ht.shape[:-1]:
        return False
    if any(b is not None and b.shape != (w.shape[0],) for b, w in ((bs, ws), (bt, wt))):
        return False
    if not (_number_in_unit(beta) and _positive_number(temperature) and all(_positive_number(s) for s in scales)
            and all(c is None or _positive_number(c) for c in softcaps)):
        return False
    return _compute_dtype(hs) in _LM_HEAD_DTYPES and _compute_dtype(ht) in _LM_HEAD_DTYPES


def _linear_distill(hs, ws, bs, ht, wt, bt, beta, temperature, s_scale, s_cap, t_scale, t_cap, **kw):
    """torch_fused.linear_distill in TRL's compute dtypes (each head's autocast or hidden dtype,
    its weight and bias cast to it), the teacher's tensors detached (TRL's divergence gives the
    teacher no gradient). Returns (divergence, entropy), the entropy without gradient."""
    cs, ct = _compute_dtype(hs), _compute_dtype(ht)
    with torch.autocast(hs.device.type, enabled=False):
        div, ent = _tf.linear_distill(
            hs.to(cs), ws.to(cs), ht.detach().to(ct), wt.detach().to(ct), beta=float(beta),
            temperature=float(temperature), student_bias=None if bs is None else bs.to(cs),
            teacher_bias=None if bt is None else bt.detach().to(ct), student_logit_scale=float(s_scale),
            teacher_logit_scale=float(t_scale), student_softcap=None if s_cap is None else float(s_cap),
            teacher_softcap=None if t_cap is None else float(t_cap), return_entropy=True, **kw)
    return div, ent.detach()


def _chunked_divergence_12(original):
    """TRL 1.16 ``trl.kernels.chunked_divergence.ChunkedDivergenceFunction``: ``.apply(student_hidden
    [N, Hs], student_weight [V, Hs], student_bias, teacher_hidden [N, Ht], teacher_weight [V, Ht],
    teacher_bias, beta, temperature=1.0, student_logit_scale=1.0, student_final_logit_softcapping=None,
    teacher_logit_scale=1.0, teacher_final_logit_softcapping=None)`` returning the per-token
    divergence and the student's entropy (float32 [N], the entropy without gradient), gradients to
    the student's hidden states, weight and bias."""

    def apply(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
              temperature=1.0, student_logit_scale=1.0, student_final_logit_softcapping=None, teacher_logit_scale=1.0,
              teacher_final_logit_softcapping=None):
        args = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
                temperature, student_logit_scale, student_final_logit_softcapping, teacher_logit_scale,
                teacher_final_logit_softcapping)
        if not (_routable_heads(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                                teacher_bias, beta, temperature, (student_logit_scale, teacher_logit_scale),
                                (student_final_logit_softcapping, teacher_final_logit_softcapping), flat=True)
                and student_hidden.shape[0] > 0):
            return original.apply(*args)
        return _linear_distill(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                               teacher_bias, beta, temperature, student_logit_scale, student_final_logit_softcapping,
                               teacher_logit_scale, teacher_final_logit_softcapping)

    return type("ChunkedDivergenceFunction", (), {
        "__doc__": "TRL's ChunkedDivergenceFunction call form, routed to torch_fused.linear_distill (per token).",
        "__module__": __name__,
        "apply": staticmethod(apply),
        "torch_fused_original": original,
    })


def _full_head(weight, bias, dtype):
    """FSDP2 keeps the lm_head as DTensors: one full tensor of each, the weight in the hidden
    states' dtype, as TRL's loss makes them (plain tensors pass through)."""
    if _is_dtensor(weight):
        weight = weight.full_tensor().to(dtype)
        if bias is not None and _is_dtensor(bias):
            bias = bias.full_tensor()
    return weight, bias


def _divergence_loss(fallback, hs, ht, ws, wt, mask, beta, num_items_in_batch, bs, bt, s_scale, t_scale, s_cap,
                     t_cap, temperature):
    """DistillationTrainer's ``_chunked_divergence_loss`` on torch_fused.linear_distill's reduced
    modes; ``fallback(*the same arguments)`` runs TRL's own function."""
    if not (_plain_tensor(hs, _FLOAT) and _plain_tensor(ht, _FLOAT)):
        return fallback(hs, ht, ws, wt, mask, beta, num_items_in_batch, bs, bt, s_scale, t_scale, s_cap, t_cap,
                        temperature)
    ws, bs = _full_head(ws, bs, hs.dtype)
    wt, bt = _full_head(wt, bt, ht.dtype)
    args = (hs, ht, ws, wt, mask, beta, num_items_in_batch, bs, bt, s_scale, t_scale, s_cap, t_cap, temperature)
    if not (_routable_heads(hs, ws, bs, ht, wt, bt, beta, temperature, (s_scale, t_scale), (s_cap, t_cap), flat=False)
            and isinstance(mask, torch.Tensor) and not _is_dtensor(mask) and mask.device == hs.device
            and mask.numel() == hs.shape[:-1].numel() and mask.numel() > 0
            and (num_items_in_batch is None or isinstance(num_items_in_batch, (int, float, torch.Tensor)))):
        return fallback(*args)
    valid = mask.reshape(-1) != 0
    n_valid = valid.sum()
    h_s, h_t = hs.reshape(-1, hs.shape[-1]), ht.reshape(-1, ht.shape[-1])
    labels = None
    if h_s.device.type == "cuda":
        # as TRL 1.16 on a Triton device: only the masked-in positions are projected
        h_s, h_t = h_s[valid], h_t[valid]
        if h_s.shape[0] == 0:
            return fallback(*args)
    else:
        labels = torch.where(valid, 0, _IGNORE)
    # TRL's loss without num_items_in_batch: the sum over max(count, 1), token-mean's own
    # denominator (0 where nothing is kept); with it, the sum over it
    reduction = "token-mean" if num_items_in_batch is None else "sum"
    loss, ent = _linear_distill(h_s, ws, bs, h_t, wt, bt, beta, temperature, s_scale, s_cap, t_scale, t_cap,
                                labels=labels, reduction=reduction)
    entropy_sum = (ent if labels is None else ent.masked_fill(~valid, 0.0)).sum()
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss, entropy_sum, n_valid


def _chunked_divergence_loss_14(original):
    """TRL 1.16 ``trl.trainer.distillation_trainer._chunked_divergence_loss(student_hidden_states
    [B, K, Hs], teacher_hidden_states [B, K, Ht], student_lm_head_weight, teacher_lm_head_weight,
    completion_mask [B, K], beta, num_items_in_batch=None, ...)`` returning (loss, the sum of the
    student's per-token entropy, the number of masked-in positions): the loss is the divergence
    summed over the masked-in positions, over ``num_items_in_batch`` (or their count, at least 1).
    Routed to the reduced modes of torch_fused.linear_distill (``"token-mean"``, or ``"sum"``
    over ``num_items_in_batch``): the gradients are formed in the forward pass, no projection is
    recomputed in the backward."""

    def _chunked_divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                                 teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None,
                                 student_lm_head_bias=None, teacher_lm_head_bias=None, student_logit_scale=1.0,
                                 teacher_logit_scale=1.0, student_final_logit_softcapping=None,
                                 teacher_final_logit_softcapping=None, temperature=1.0):
        return _divergence_loss(original, student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                                teacher_lm_head_weight, completion_mask, beta, num_items_in_batch,
                                student_lm_head_bias, teacher_lm_head_bias, student_logit_scale, teacher_logit_scale,
                                student_final_logit_softcapping, teacher_final_logit_softcapping, temperature)

    return _chunked_divergence_loss


def _chunked_divergence_loss_15(original):
    """TRL 1.13 / 1.14 ``_chunked_divergence_loss``: 1.16's form with ``chunk_size`` (the rows of
    its checkpointed chunk loop) after ``beta``, accepted and ignored (the fused op never holds a
    chunk of logits); the same results."""

    def _chunked_divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                                 teacher_lm_head_weight, completion_mask, beta, chunk_size, num_items_in_batch=None,
                                 student_lm_head_bias=None, teacher_lm_head_bias=None, student_logit_scale=1.0,
                                 teacher_logit_scale=1.0, student_final_logit_softcapping=None,
                                 teacher_final_logit_softcapping=None, temperature=1.0):
        def fallback(hs, ht, ws, wt, mask, beta, *rest):
            return original(hs, ht, ws, wt, mask, beta, chunk_size, *rest)

        return _divergence_loss(fallback, student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                                teacher_lm_head_weight, completion_mask, beta, num_items_in_batch,
                                student_lm_head_bias, teacher_lm_head_bias, student_logit_scale, teacher_logit_scale,
                                student_final_logit_softcapping, teacher_final_logit_softcapping, temperature)

    return _chunked_divergence_loss


_GKD_REDUCTIONS = ("batchmean", "sum", "mean")


def _generalized_jsd_loss_7(original):
    """``GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5,
    temperature=1.0, reduction="batchmean", num_items_in_batch=None)`` (a staticmethod; TRL 1.16):
    the divergence summed over the positions whose label is not -100, over num_items_in_batch,
    or reduced as ``reduction`` says (batchmean: over the count of those positions, at least 1, or
    over the first dimension without labels; sum; mean: over every element of the [..., V]
    divergence). Routed to torch_fused.distill's ``reduction="sum"`` (the student's gradient
    formed in its forward pass); ``reduction="none"`` (a per-element result) and a teacher that
    requires a gradient go to TRL."""

    def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0,
                             reduction="batchmean", num_items_in_batch=None):
        args = (student_logits, teacher_logits, labels, beta, temperature, reduction, num_items_in_batch)
        s, t = student_logits, teacher_logits
        if not (_routable_logits(s) and _routable_logits(t) and t.shape == s.shape and t.device == s.device
                and not (torch.is_grad_enabled() and t.requires_grad)
                and (labels is None or (_plain_tensor(labels, _INDEX) and labels.shape == s.shape[:-1]
                                        and labels.device == s.device))
                and _number_in_unit(beta) and _positive_number(temperature)
                and (num_items_in_batch is not None or reduction in _GKD_REDUCTIONS)
                and (num_items_in_batch is None or isinstance(num_items_in_batch, (int, float, torch.Tensor)))):
            return original(*args)
        # TRL's result dtype: its arithmetic runs in the logits' dtypes (and the divisor's)
        dtype = torch.promote_types(s.dtype, t.dtype)
        total = _tf.distill(s, t, beta=float(beta), temperature=float(temperature), labels=labels,
                            ignore_index=_IGNORE, reduction="sum")  # over the kept positions
        n = s.shape[:-1].numel() if labels is None else (labels != _IGNORE).sum()
        if num_items_in_batch is not None:
            if isinstance(num_items_in_batch, torch.Tensor):
                num_items_in_batch = num_items_in_batch.to(total.device)
                dtype = torch.promote_types(dtype, num_items_in_batch.dtype)
            out = total / num_items_in_batch
        elif reduction == "batchmean":
            out = total / (max(s.shape[0], 1) if labels is None else n.clamp_min(1))
        elif reduction == "sum":
            out = total
        else:  # "mean": over every element of the kept rows' [V] divergences (0 / 0 with none kept, as TRL's)
            out = total / (n * s.shape[-1])
        return out.to(dtype)

    return generalized_jsd_loss


# ------------------------------------------------------------------------------------------------
# signatures


def _params(fn, *, drop_first=False):
    ps = list(inspect.signature(fn).parameters.values())
    if drop_first:
        ps = ps[1:]
    return [(p.name, p.kind, p.default) for p in ps]


def _same_signature(adapter_fn, original_fn, *, drop_first=False) -> bool:
    a, o = _params(adapter_fn), _params(original_fn, drop_first=drop_first)
    if len(a) != len(o):
        return False
    for (an, ak, ad), (on, ok, od) in zip(a, o):
        if an != on or ak != ok:
            return False
        if (ad is inspect.Parameter.empty) != (od is inspect.Parameter.empty):
            return False
        if ad is not inspect.Parameter.empty and not (ad is od or ad == od):
            return False
    return True


# ------------------------------------------------------------------------------------------------
# patch / unpatch

_STATE = None  # None, or {"options", "adapters": [(adapter, original, label)], "classes": [(cls, attr, original,
#               replacement, label)], "replaced": [(module, attr)], "version", "left"}


def _trl_version() -> str:
    try:
        import trl
    except ImportError as e:
        raise ImportError("torch_fused.integrations.trl needs TRL: pip install 'trl' (in a checkout of torch-fused: "
                          "pip install -e '.[trl]')") from e

    version = getattr(trl, "__version__", None)
    if version is None:  # pragma: no cover - every TRL release sets __version__
        from importlib.metadata import version as _v

        version = _v("trl")
    return version


def _import_optional(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _plan(fused_lm_head: bool | None, strict: bool, version: str, left: list | None = None,
          distill: bool | None = None):
    """[(adapter, original, label)] of the module attributes to replace, for the installed TRL;
    raises where strict demands. fused_lm_head / distill None: route the chunked lm_head / the
    distillation divergence where it has the supported form, else leave it to TRL (the reason
    appended to ``left``)."""
    left = [] if left is None else left
    import trl.trainer.utils as utils

    kernels = _import_optional("trl.kernels")
    plan = []

    def add(label, original, factories):
        if original is None:
            return
        for factory in factories:
            adapter = factory(original, utils)
            if _same_signature(adapter, original):
                plan.append((adapter, original, label))
                return
        msg = f"TRL {version}: {label}{inspect.signature(original)} has no signature this integration knows"
        if strict:
            raise UnsupportedTRLVersion(msg)
        warnings.warn(msg + "; left as it is", stacklevel=4)

    add("trl.trainer.utils.selective_log_softmax", getattr(utils, "selective_log_softmax", None),
        (_selective_log_softmax_4, _selective_log_softmax_2))
    add("trl.trainer.utils.entropy_from_logits", getattr(utils, "entropy_from_logits", None),
        (_entropy_from_logits,))
    add("trl.trainer.utils.selective_log_softmax_and_entropy",
        getattr(utils, "selective_log_softmax_and_entropy", None), (_selective_log_softmax_and_entropy_utils,))
    if kernels is not None:
        add("trl.kernels.selective_log_softmax_and_entropy",
            getattr(kernels, "selective_log_softmax_and_entropy", None), (_selective_log_softmax_and_entropy_kernel,))

    _plan_lm_head(plan, fused_lm_head, version, left, utils, kernels)
    _plan_distill(plan, distill, version, left)
    return plan


def _plan_lm_head(plan, fused_lm_head, version, left, utils, kernels):
    if not (fused_lm_head or fused_lm_head is None):
        return
    cls = getattr(kernels, "ChunkedLogProbFunction", None) if kernels is not None else None
    cls = cls or getattr(utils, "_ChunkedLogProbFunction", None)
    if cls is None and fused_lm_head is None:
        return  # nothing to route: this TRL's trainers score materialized logits
    if cls is None:
        raise ValueError(f"patch(fused_lm_head=True): TRL {version} has no chunked lm_head "
                         "(ChunkedLogProbFunction); its trainers compute log-probs from materialized logits, "
                         "which patch() routes without fused_lm_head")
    chunked = _import_optional(cls.__module__)
    optional = getattr(chunked, "OPTIONAL_OUTPUTS", None)
    adapter = _chunked_logprob_5(cls, optional) if optional is not None else None
    if adapter is None or not _same_signature(adapter.apply, cls.forward, drop_first=True):
        if fused_lm_head is None:
            left.append(f"{cls.__module__}.{cls.__name__} (not the five-output form of TRL "
                        f"{', '.join(FUSED_LM_HEAD_TRL_VERSIONS)} that the lm_head route adapts)")
            return
        raise ValueError(
            f"patch(fused_lm_head=True): TRL {version}'s {cls.__name__}{inspect.signature(cls.forward)} is not the "
            f"five-output form of TRL {', '.join(FUSED_LM_HEAD_TRL_VERSIONS)} that the lm_head route adapts; "
            "use one of those versions, or patch() without fused_lm_head")
    plan.append((adapter, cls, f"{cls.__module__}.{cls.__name__}"))


def _distill_mismatch(distill, version, what, left):
    """A distillation function whose form the route does not adapt: left to TRL (distill=None,
    the reason appended to ``left``) or ValueError (distill=True)."""
    if distill is None:
        left.append(f"{what} (not the form of TRL {', '.join(DISTILL_TRL_VERSIONS)} that the distillation route "
                    "adapts)")
        return
    raise ValueError(f"patch(distill=True): TRL {version}'s {what} is not the form of TRL "
                     f"{', '.join(DISTILL_TRL_VERSIONS)} that the distillation route adapts; use one of those "
                     "versions, or patch() without distill")


def _plan_distill(plan, distill, version, left):
    """DistillationTrainer's divergence: ``_chunked_divergence_loss`` (the trainer's loss, to the
    reduced mode) and ``ChunkedDivergenceFunction`` (per token, for other callers)."""
    if distill is False:
        return
    kernel = _import_optional("trl.kernels.chunked_divergence")
    trainer = _import_optional("trl.trainer.distillation_trainer")
    cls = getattr(kernel, "ChunkedDivergenceFunction", None)
    loss = getattr(trainer, "_chunked_divergence_loss", None)
    if cls is None and loss is None:
        if distill:
            raise ValueError(f"patch(distill=True): TRL {version} has no DistillationTrainer divergence "
                             "(trl.trainer.distillation_trainer._chunked_divergence_loss); TRL "
                             f"{', '.join(DISTILL_TRL_VERSIONS)} have it")
        return
    if loss is not None:
        label = "trl.trainer.distillation_trainer._chunked_divergence_loss"
        adapter = next((a for a in (_chunked_divergence_loss_14(loss), _chunked_divergence_loss_15(loss))
                        if _same_signature(a, loss)), None)
        if adapter is not None:
            plan.append((adapter, loss, label))
        else:
            _distill_mismatch(distill, version, f"{label}{inspect.signature(loss)}", left)
    if cls is not None:
        adapter = _chunked_divergence_12(cls)
        label = "trl.kernels.chunked_divergence.ChunkedDivergenceFunction"
        if _same_signature(adapter.apply, cls.forward, drop_first=True):
            plan.append((adapter, cls, label))
        else:
            _distill_mismatch(distill, version, f"{label}{inspect.signature(cls.forward)}", left)


_GKD_MODULE = "trl.experimental.gkd.gkd_trainer"


def _class_routes(distill, version, left):
    """[(class, attribute, original descriptor, replacement descriptor, label)]: GKDTrainer's
    ``generalized_jsd_loss`` staticmethod, where trl.experimental.gkd is loaded (patch() does not
    import TRL's experimental modules, whose import prints TRL's notice)."""
    if distill is False:
        return []
    mod = sys.modules.get(_GKD_MODULE)
    cls = getattr(mod, "GKDTrainer", None) if mod is not None else None
    desc = cls.__dict__.get("generalized_jsd_loss") if cls is not None else None
    if not isinstance(desc, staticmethod):
        return []
    label = f"{cls.__module__}.{cls.__qualname__}.generalized_jsd_loss"
    adapter = _generalized_jsd_loss_7(desc.__func__)
    if not _same_signature(adapter, desc.__func__):
        _distill_mismatch(distill, version, f"{label}{inspect.signature(desc.__func__)}", left)
        return []
    return [(cls, "generalized_jsd_loss", desc, staticmethod(adapter), label)]


def _set_class_routes(routes, *, forward: bool) -> None:
    for cls, attr, original, replacement, _ in routes:
        have, want = (original, replacement) if forward else (replacement, original)
        if cls.__dict__.get(attr) is have:
            setattr(cls, attr, want)


def _trl_modules():
    for name, mod in list(sys.modules.items()):
        if mod is not None and (name == "trl" or name.startswith("trl.")):
            yield name, mod


def _swap(mapping: dict, replaced: list | None = None) -> None:
    """In every loaded trl.* module, set each attribute holding a key of ``mapping`` (by identity)
    to its value."""
    for name, mod in _trl_modules():
        d = getattr(mod, "__dict__", None)
        if d is None:
            continue
        for attr, val in list(d.items()):
            hit = mapping.get(id(val))
            if hit is not None and hit[0] is val:
                setattr(mod, attr, hit[1])
                if replaced is not None and not any(m is mod and a == attr for m, a in replaced):
                    replaced.append((mod, attr))


def patch(*, fused_lm_head: bool | None = None, distill: bool | None = None, strict: bool = True,
          verbose: bool = True) -> None:
    """Route TRL's log-prob / entropy functions and its distillation divergence to torch_fused
    (see the module docstring).

    Args:
        fused_lm_head: route TRL's chunked lm_head (``ChunkedLogProbFunction``, behind
            ``add_fused_lm_head`` and every trainer's per-token log-probs in TRL 1.16) to
            :func:`torch_fused.linear_logprobs_and_entropy`. None (default): wherever the installed
            TRL has the form the route adapts (TRL 1.16), else left to TRL; True: required (raises
            ``ValueError`` where TRL has no such form); False: left to TRL. Its speed and memory
            against TRL's, measured in one run: docs/BENCHMARKS.md, "Fused lm_head".
        distill: route the distillation divergence, ``DistillationTrainer``'s
            (``_chunked_divergence_loss``, TRL 1.13-1.16, and ``ChunkedDivergenceFunction``, 1.16) to
            :func:`torch_fused.linear_distill` and ``GKDTrainer.generalized_jsd_loss`` (where
            ``trl.experimental.gkd`` is imported before ``patch()``) to :func:`torch_fused.distill`.
            None (default): wherever the installed TRL has the form the route adapts, else left to
            TRL; True: required (raises ``ValueError`` where TRL has no such form); False: left to
            TRL. Figures: docs/BENCHMARKS.md, "Distillation".
        strict: raise :class:`UnsupportedTRLVersion` unless the installed TRL is one of
            ``TESTED_TRL_VERSIONS``. ``strict=False`` warns instead and patches each function whose
            signature matches a tested form.
        verbose: print one line to stderr saying what was routed and what was left to TRL (and
            why).

    Idempotent: calling it again with the same options re-scans the loaded ``trl.*`` modules (and
    routes a ``GKDTrainer`` imported since) and changes nothing else; with other options it
    unpatches first. Raises ImportError without TRL.
    """
    global _STATE
    options = {"fused_lm_head": None if fused_lm_head is None else bool(fused_lm_head),
               "distill": None if distill is None else bool(distill), "strict": bool(strict)}
    if _STATE is not None and _STATE["options"] == options:
        _swap({id(o): (o, a) for a, o, _ in _STATE["adapters"]}, _STATE["replaced"])
        known = {(cls, attr) for cls, attr, *_ in _STATE["classes"]}
        new = [r for r in _class_routes(options["distill"], _STATE["version"], []) if (r[0], r[1]) not in known]
        _set_class_routes(new, forward=True)
        _STATE["classes"] += new
        if new and verbose:
            print(summary(), file=sys.stderr)
        return
    if _STATE is not None:
        unpatch()
    version = _trl_version()
    if version not in TESTED_TRL_VERSIONS:
        msg = (f"torch_fused.integrations.trl is tested with TRL {', '.join(TESTED_TRL_VERSIONS)}; the installed TRL "
               f"is {version}. Install a tested version (pip install 'trl=={TESTED_TRL_VERSIONS[-1]}', or "
               "pip install -e '.[trl]' in a torch-fused checkout), or call patch(strict=False) to patch the "
               "functions whose signatures match a tested version's")
        if strict:
            raise UnsupportedTRLVersion(msg)
        warnings.warn(msg, stacklevel=2)
    left: list = []
    if options["fused_lm_head"] is False:
        left.append("the chunked lm_head (fused_lm_head=False)")
    if options["distill"] is False:
        left.append("the distillation divergence (distill=False)")
    plan = _plan(options["fused_lm_head"], options["strict"], version, left, options["distill"])
    classes = _class_routes(options["distill"], version, left)
    replaced: list = []
    _swap({id(o): (o, a) for a, o, _ in plan}, replaced)
    _set_class_routes(classes, forward=True)
    _STATE = {"options": options, "adapters": plan, "classes": classes, "replaced": replaced, "version": version,
              "left": left}
    if verbose:
        print(summary(), file=sys.stderr)


def summary() -> str:
    """One line: what ``patch()`` routed to torch_fused, and what it left to TRL and why."""
    if _STATE is None:
        return "torch_fused.integrations.trl: not patched"
    labels = [label for _, _, label in _STATE["adapters"]] + [r[-1] for r in _STATE["classes"]]
    routed = ", ".join(labels) or "nothing"
    left = "; left to TRL: " + ", ".join(_STATE["left"]) if _STATE["left"] else ""
    return f"torch_fused.integrations.trl: TRL {_STATE['version']}: routed {routed}{left}"


def unpatch() -> None:
    """Put TRL's original objects back wherever ``patch()`` (or a later import) put an adapter.
    A no-op when not patched."""
    global _STATE
    if _STATE is None:
        return
    back = {id(a): (a, o) for a, o, _ in _STATE["adapters"]}
    _swap(back)
    for mod, attr in _STATE["replaced"]:  # modules since dropped from sys.modules
        hit = back.get(id(getattr(mod, attr, None)))
        if hit is not None and hit[0] is getattr(mod, attr):
            setattr(mod, attr, hit[1])
    _set_class_routes(_STATE["classes"], forward=False)
    _STATE = None


@contextlib.contextmanager
def patched(*, fused_lm_head: bool | None = None, distill: bool | None = None, strict: bool = True,
            verbose: bool = True):
    """``with patched(): ...`` patches for the block and then restores the state before it
    (unpatched, or patched with the previous options)."""
    before = None if _STATE is None else dict(_STATE["options"])
    patch(fused_lm_head=fused_lm_head, distill=distill, strict=strict, verbose=verbose)
    try:
        yield
    finally:
        if before is None:
            unpatch()
        else:
            patch(**before, verbose=False)


def is_patched() -> bool:
    return _STATE is not None


def patched_names() -> list[str]:
    """``module.attribute`` of every replacement currently in place (sorted)."""
    if _STATE is None:
        return []
    adapters = {id(a) for a, _, _ in _STATE["adapters"]}
    names = [f"{name}.{attr}" for name, mod in _trl_modules() for attr, val in list(vars(mod).items())
             if id(val) in adapters]
    names += [label for cls, attr, _, new, label in _STATE["classes"] if cls.__dict__.get(attr) is new]
    return sorted(names)
