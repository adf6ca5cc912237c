"""fused::sinkgd_step: one in-place SinkGD update of a list of parameters (SR-Sinkhorn
normalized gradient step; Scetbon et al., arXiv 2502.06742). Algorithm: docs/SINKGD.md.

A mutating, opaque op: it updates ``params`` (and the spectral warm-start vectors) in place and
returns nothing; it has no autograd formula. CPU: the plain-PyTorch reference; CUDA: Triton
kernels that carry only row/column scale vectors (kernels/sinkgd.py).

The Triton path works from a plan (``_Plan``: work tables and lr factors) per matrix group. A
``SinkGDCache`` passed to ``sinkgd_step_eager`` keeps them (and, on CUDA, graphs of repeated
steps) between calls; ``torch_fused.optim.SinkGD`` owns one cache per optimizer. Calls without
one (the op itself, as a compiled step calls it) reuse plans from the module's ``_OP_CACHE``,
which keeps plans only (no graphs, no step buffers). No plan built during a CUDA-graph capture
is kept (see ``_device_tensor``).

Modules: ``plan.py`` (the plan and its keys), ``staging.py`` (its device tables), ``cache.py``
(SinkGDCache), ``launch.py`` (the kernel launches of a step), ``graphs.py`` (a group's step,
replayed from a CUDA graph when it repeats), and this file: the op, its checks and grouping.
"""

from __future__ import annotations

from typing import List

import torch

from ..._library import NAMESPACE, TRITON_DEVICES, acc_dtype
from ... import reference
from ...meta import sinkgd as meta
from .cache import SinkGDCache
from .graphs import _group_replay_or_launch, _group_step
from .launch import launch_sharded
from .plan import _Plan, _as3d, _call_key, _coefs, _spectral_target

__all__ = ["SinkGDCache", "launch_sharded", "sinkgd_step", "sinkgd_step_eager", "_Plan"]


# The op's own plans (calls without a SinkGDCache: torch.compile'd steps, the keyword function
# without ``cache``), reused while the same tensors come back; never CUDA graphs of its own (a
# compiled step may run inside torch.compile's). Plans hold only addresses, shapes and lr
# factors: a plan found under a key is valid for any tensors with that key.
_OP_CACHE = SinkGDCache(max_plans=16, cuda_graphs=False)

def _step_impl(params, grads, spectral_vecs, lr, lr_scale, weight_decay, eps, sinkhorn_iters, spectral_norm,
               spectral_target, spectral_iters, base_width, width_exponent, stochastic_round, seed, use_triton,
               cache=None):
    store = (cache if cache is not None else _OP_CACHE) if use_triton else None
    call_key = None
    if store is not None:
        call_key = _call_key(params, grads, spectral_vecs if spectral_norm else (), lr_scale, base_width,
                             width_exponent)
        known = store.calls.get(call_key) if call_key is not None else None
        if known is not None:
            # the same tensors as a call that passed every check: only the scalars are checked
            meta.check_sinkgd_scalars(params, grads, spectral_vecs, lr, sinkhorn_iters, spectral_norm,
                                      spectral_target, spectral_iters, eps, seed)
            for pdt, idx, plan in known:
                ps = [params[i] for i in idx]
                vs = [spectral_vecs[i] for i in idx] if spectral_norm else []
                _group_replay_or_launch(plan, ps, [grads[i] for i in idx], vs, vs, lr, weight_decay, eps,
                                        sinkhorn_iters, spectral_norm, spectral_target, spectral_iters,
                                        bool(stochastic_round) and pdt == torch.bfloat16, seed, store)
            return
    meta.check_sinkgd(params, grads, spectral_vecs, lr, sinkhorn_iters, spectral_norm, spectral_target,
                      spectral_iters, eps, seed)
    groups: dict = {}
    reference_path = False
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.numel() == 0:
            continue
        if use_triton and torch.float64 not in (p.dtype, g.dtype):
            groups.setdefault((p.device, p.dtype, g.dtype), []).append(i)  # one plan per device
            continue
        # the reference path (CPU, and float64 anywhere)
        reference_path = True
        w3 = _as3d(p)  # a view: p is contiguous
        g3 = _as3d(g.contiguous())
        b, m, n = w3.shape
        r, c = reference.sinkgd_scales(g3, sinkhorn_iters, eps)
        if spectral_norm:
            target = _spectral_target(spectral_target, m, n)
            s = reference.sinkgd_spectral_scale(g3, r, c, spectral_vecs[i], spectral_iters, target, eps)
        else:
            s = torch.ones(b, dtype=torch.float32, device=p.device)
        coef_x, coef_w = _coefs(lr.to(p.device), n, lr_scale, weight_decay, base_width, width_exponent, s,
                                torch.promote_types(acc_dtype(p.dtype), r.dtype))
        reference.sinkgd_update_(w3, g3, r, c, coef_x, coef_w)
    known = []
    for (_, pdt, _), idx in groups.items():
        plan = _group_step([params[i] for i in idx], [grads[i] for i in idx],
                           [spectral_vecs[i] for i in idx] if spectral_norm else [], lr, lr_scale, weight_decay,
                           eps, sinkhorn_iters, spectral_norm, spectral_target, spectral_iters, base_width,
                           width_exponent, bool(stochastic_round) and pdt == torch.bfloat16, seed, store)
        known.append((pdt, idx, plan))
    if (call_key is not None and not reference_path and call_key[0]
            and all(k[-1] and k[-2] for k in call_key[0]) and all(k[-1] for k in call_key[1])
            and all(any(plan is q for q in store.plans.values()) for _, _, plan in known)):
        # every group's plan is kept by the store and every tensor is contiguous (the kernels
        # read them as given): the next call with the same key skips the checks and grouping
        if len(store.calls) >= store.max_plans:
            store.calls.clear()
        store.calls[call_key] = known


@torch.library.custom_op(f"{NAMESPACE}::sinkgd_step", mutates_args=("params", "spectral_vecs"))
def sinkgd_step(
    params: List[torch.Tensor],
    grads: List[torch.Tensor],
    spectral_vecs: List[torch.Tensor],
    lr: torch.Tensor,
    lr_scale: float,
    weight_decay: float,
    eps: float,
    sinkhorn_iters: int,
    spectral_norm: bool,
    spectral_target: str,
    spectral_iters: int,
    base_width: float | None,
    width_exponent: float,
    stochastic_round: bool,
    seed: torch.Tensor,
) -> None:
    """The positional schema of one SinkGD step; ``torch_fused.optim.sinkgd_step`` is the keyword
    entry point and documents every argument (``seed`` is its ``step``). This body is the CPU
    (reference) implementation."""
    _step_impl(params, grads, spectral_vecs, lr, lr_scale, weight_decay, eps, sinkhorn_iters, spectral_norm,
               spectral_target, spectral_iters, base_width, width_exponent, stochastic_round, seed, False)


def sinkgd_step_eager(params, grads, spectral_vecs, lr, lr_scale, weight_decay, eps, sinkhorn_iters,
                      spectral_norm, spectral_target, spectral_iters, base_width, width_exponent,
                      stochastic_round, seed, cache: SinkGDCache | None = None) -> None:
    """What fused::sinkgd_step runs for the parameters' device: its registered Triton-device
    kernel, and what the eager optimizer step calls directly. torch.library's wrapper around a
    custom op's kernel checks the storage of every tensor argument for aliasing on each call,
    host work that grows with the number of parameters and showed as the largest self time in
    profiles of many-matrix optimizer steps; the kernels are the same either way. ``cache`` (a
    SinkGDCache) keeps the plans, and on CUDA the step's graphs, for the next call; without
    one, plans come from the op's own cache (plans only). Under torch.compile the optimizer
    calls the op."""
    use_triton = bool(params) and params[0].device.type in TRITON_DEVICES
    _step_impl(params, grads, spectral_vecs, lr, lr_scale, weight_decay, eps, sinkhorn_iters, spectral_norm,
               spectral_target, spectral_iters, base_width, width_exponent, stochastic_round, seed, use_triton,
               cache)


sinkgd_step.register_fake(meta.sinkgd_step_fake)
if TRITON_DEVICES:
    sinkgd_step.register_kernel(TRITON_DEVICES)(sinkgd_step_eager)
