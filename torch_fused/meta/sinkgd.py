"""Input checks and the fake implementation of fused::sinkgd_step (shapes and dtypes only).

Every check raises ValueError naming the argument, in eager and compiled calls; the sharded
step (optim/sharded.py) runs the same settings checks (``check_settings``)."""

from __future__ import annotations

import torch

from .._library import check_value as check

PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SPECTRAL_TARGETS = ("unit", "muon")


def _all_valid(params, grads) -> bool:
    """Whether every (param, grad) pair passes the per-parameter checks of check_sinkgd (one
    cheap pass: a step of a model with many matrices runs this on the host every time)."""
    strided = torch.strided
    return all(p.dim() >= 2 and p.dtype in PARAM_DTYPES and p.layout == strided and g.layout == strided
               and p.is_contiguous() and g.shape == p.shape and g.device == p.device
               for p, g in zip(params, grads))


def _vecs_valid(params, spectral_vecs) -> bool:
    """Whether every spectral vector is float32 [B, n] on its parameter's device (one pass)."""
    f32 = torch.float32
    return all(v.dtype == f32 and v.dim() == 2 and v.shape[1] == p.shape[-1] and v.device == p.device
               and v.shape[0] * p.shape[-2] * p.shape[-1] == p.numel()
               for p, v in zip(params, spectral_vecs))


def check_settings(n_params, n_grads, n_vecs, sinkhorn_iters, eps, spectral_norm, spectral_target,
                   spectral_iters) -> None:
    """The step's settings and list lengths (single-device and sharded steps alike)."""
    check(n_params == n_grads, lambda: f"grads: expected one gradient per parameter ({n_params}), got {n_grads}")
    check(sinkhorn_iters >= 0, lambda: f"sinkhorn_iters: expected >= 0, got {sinkhorn_iters}")
    check(eps > 0, lambda: f"eps: expected > 0, got {eps}")
    check(spectral_target in SPECTRAL_TARGETS,
          lambda: f"spectral_target: expected one of {SPECTRAL_TARGETS}, got {spectral_target!r}")
    if spectral_norm:
        check(n_vecs == n_params, lambda: f"spectral_vecs: expected one vector per parameter ({n_params}), got {n_vecs}")
        check(spectral_iters >= 1, lambda: f"spectral_iters: expected >= 1, got {spectral_iters}")


def check_matrix(i, p, name: str | None = None) -> None:
    """params[i] (``name`` where given) is a matrix (or a batch of them) of a supported dtype."""
    name = f"params[{i}]" if name is None else name
    check(p.dim() >= 2, lambda: f"{name}: SinkGD needs a matrix [..., m, n], got shape {tuple(p.shape)}")
    check(p.dtype in PARAM_DTYPES, lambda: f"{name}: expected a floating dtype, got {p.dtype}")


def check_param_grad(p, g, p_name: str, g_name: str) -> None:
    """One matrix and its gradient (the per-parameter checks of check_sinkgd, which _all_valid
    passes at once), each error naming ``p_name`` or ``g_name``."""
    check_matrix(None, p, p_name)
    check(p.layout == torch.strided and g.layout == torch.strided,
          lambda: f"{p_name}: sparse parameters or gradients are not supported")
    check(p.is_contiguous(),
          lambda: f"{p_name}: expected a contiguous parameter, got strides {tuple(p.stride())} for shape {tuple(p.shape)}")
    check(tuple(g.shape) == tuple(p.shape),
          lambda: f"{g_name}: shape {tuple(g.shape)} does not match its parameter's {tuple(p.shape)}")
    check(g.device == p.device, lambda: f"{g_name}: device {g.device} differs from its parameter's {p.device}")


def check_sinkgd_scalars(params, grads, spectral_vecs, lr, sinkhorn_iters, spectral_norm, spectral_target,
                         spectral_iters, eps, seed) -> None:
    """check_sinkgd's checks of everything but the per-parameter tensors."""
    check_settings(len(params), len(grads), len(spectral_vecs), sinkhorn_iters, eps, spectral_norm,
                   spectral_target, spectral_iters)
    check(lr.dim() == 0, lambda: f"lr: expected a 0-dim tensor, got shape {tuple(lr.shape)}")
    check(seed.dim() == 0, lambda: f"seed: expected a 0-dim tensor (a step count), got shape {tuple(seed.shape)}")


def check_sinkgd(params, grads, spectral_vecs, lr, sinkhorn_iters, spectral_norm, spectral_target,
                 spectral_iters, eps, seed) -> None:
    check_sinkgd_scalars(params, grads, spectral_vecs, lr, sinkhorn_iters, spectral_norm, spectral_target,
                         spectral_iters, eps, seed)
    if _all_valid(params, grads) and (not spectral_norm or _vecs_valid(params, spectral_vecs)):
        return  # the common case, checked in one pass; the loop below names what is wrong
    for i, (p, g) in enumerate(zip(params, grads)):
        check_param_grad(p, g, f"params[{i}]", f"grads[{i}]")
        if spectral_norm:
            v = spectral_vecs[i]
            b = p.numel() // (p.shape[-2] * p.shape[-1]) if p.numel() else 0
            check(tuple(v.shape) == (b, p.shape[-1]) and v.dtype == torch.float32,
                  lambda: f"spectral_vecs[{i}]: expected float32 of shape {(b, p.shape[-1])}, got {v.dtype} "
                          f"{tuple(v.shape)}")
            check(v.device == p.device,
                  lambda: f"spectral_vecs[{i}]: device {v.device} differs from its parameter's {p.device}")


def sinkgd_step_fake(params, grads, spectral_vecs, lr, lr_scale, weight_decay, eps, sinkhorn_iters,
                     spectral_norm, spectral_target, spectral_iters, base_width, width_exponent,
                     stochastic_round, seed) -> None:
    check_sinkgd(params, grads, spectral_vecs, lr, sinkhorn_iters, spectral_norm, spectral_target,
                 spectral_iters, eps, seed)
    return None
