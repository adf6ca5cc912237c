"""fused::sinkgd_step: one in-place SinkGD update of a list of parameters (SR-Sinkhorn
normalized gradient step; Scetbon et al., arXiv 2502.06742). Algorithm: docs/SINKGD.md.

A mutating, opaque op: it updates ``params`` (and the spectral warm-start vectors) in place and
returns nothing; it has no autograd formula. CPU: the plain-PyTorch reference; CUDA: Triton
kernels that carry only row/column scale vectors (kernels/sinkgd.py).
"""

from __future__ import annotations

import math

import torch

from .._library import NAMESPACE, TRITON_DEVICES
from .. import reference
from ..meta import sinkgd as meta


def _as3d(t: torch.Tensor) -> torch.Tensor:
    m, n = t.shape[-2], t.shape[-1]
    return t.reshape(-1, m, n)


def _coefs(lr, n, lr_scale, weight_decay, base_width, width_exponent, spectral_scale):
    """eta = lr * lr_scale * (base_width / n) ** width_exponent; returns (eta * s [B], eta * wd)
    as fp32 device tensors: no host sync, and a tensor lr that changes never recompiles."""
    factor = lr_scale * ((base_width / n) ** width_exponent if base_width is not None else 1.0)
    eta = lr.to(torch.float32) * factor
    return eta * spectral_scale, (eta * weight_decay).reshape(1)


def _scales_triton(g3, iters, eps):
    from ..kernels import sinkgd as K

    b, m, n = g3.shape
    r = torch.ones(b, m, dtype=torch.float32, device=g3.device)
    c = torch.ones(b, n, dtype=torch.float32, device=g3.device)
    if iters == 0:
        return r, c
    rbm, rbn, rw = K.ROW_TILE
    cbm, cbn, cw = K.COL_TILE
    tn = K.triton.cdiv(n, rbn)
    tm = K.triton.cdiv(m, cbm)
    part_r = torch.empty(b, tn, m, dtype=torch.float32, device=g3.device)
    part_c = torch.empty(b, tm, n, dtype=torch.float32, device=g3.device)
    sq_n, sq_m = math.sqrt(n), math.sqrt(m)
    for _ in range(iters):
        K._sinkgd_sums_kernel[(K.triton.cdiv(m, rbm), tn, b)](
            g3, r, c, part_r, m, n, g3.stride(0), g3.stride(1), AXIS=0, BM=rbm, BN=rbn, num_warps=rw)
        K._sinkgd_scale_kernel[(K.triton.cdiv(m, K.SCALE_BLOCK), b)](
            part_r, r, m, tn, sq_n, eps, BLOCK=K.SCALE_BLOCK)
        K._sinkgd_sums_kernel[(tm, K.triton.cdiv(n, cbn), b)](
            g3, r, c, part_c, m, n, g3.stride(0), g3.stride(1), AXIS=1, BM=cbm, BN=cbn, num_warps=cw)
        K._sinkgd_scale_kernel[(K.triton.cdiv(n, K.SCALE_BLOCK), b)](
            part_c, c, n, tm, sq_m, eps, BLOCK=K.SCALE_BLOCK)
    return r, c


def _update_triton(w3, g3, r, c, coef_x, coef_w, stochastic, seed, salt):
    from ..kernels import sinkgd as K

    b, m, n = w3.shape
    bm, bn, warps = K.UPD_TILE
    K._sinkgd_update_kernel[(K.triton.cdiv(m, bm), K.triton.cdiv(n, bn), b)](
        w3, g3, r, c, coef_x, coef_w, m, n, g3.stride(0), g3.stride(1), w3.stride(0), w3.stride(1), seed, salt,
        STOCHASTIC=stochastic, BM=bm, BN=bn, num_warps=warps)


def _step(params, grads, spectral_vecs, lr, lr_scale, weight_decay, eps, sinkhorn_iters, spectral_norm,
          spectral_target, spectral_iters, base_width, width_exponent, stochastic_round, seed, use_triton):
    meta.check_sinkgd(params, grads, spectral_vecs, lr, sinkhorn_iters, spectral_norm, spectral_target,
                      spectral_iters, eps, seed)
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.numel() == 0:
            continue
        w3 = _as3d(p)  # a view: p is contiguous
        g3 = _as3d(g.contiguous())
        b, m, n = w3.shape
        triton_ok = use_triton and p.dtype != torch.float64
        if triton_ok:
            r, c = _scales_triton(g3, sinkhorn_iters, eps)
        else:
            r, c = reference.sinkgd_scales(g3, sinkhorn_iters, eps)
        if spectral_norm:
            target = 1.0 if spectral_target == "unit" else math.sqrt(m / n)
            s = reference.sinkgd_spectral_scale(g3, r, c, spectral_vecs[i], spectral_iters, target, eps)
        else:
            s = torch.ones(b, dtype=torch.float32, device=p.device)
        coef_x, coef_w = _coefs(lr.to(p.device), n, lr_scale, weight_decay, base_width, width_exponent, s)
        if triton_ok:
            sr = bool(stochastic_round) and p.dtype == torch.bfloat16
            _update_triton(w3, g3, r, c, coef_x, coef_w, sr, seed.to(p.device), i)
        else:
            reference.sinkgd_update_(w3, g3, r, c, coef_x, coef_w)


@torch.library.custom_op(f"{NAMESPACE}::sinkgd_step", mutates_args=("params", "spectral_vecs"))
def sinkgd_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    spectral_vecs: list[torch.Tensor],
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
    _step(params, grads, spectral_vecs, lr, lr_scale, weight_decay, eps, sinkhorn_iters, spectral_norm,
          spectral_target, spectral_iters, base_width, width_exponent, stochastic_round, seed, False)


def _sinkgd_step_triton(params, grads, spectral_vecs, lr, lr_scale, weight_decay, eps, sinkhorn_iters,
                        spectral_norm, spectral_target, spectral_iters, base_width, width_exponent,
                        stochastic_round, seed):
    _step(params, grads, spectral_vecs, lr, lr_scale, weight_decay, eps, sinkhorn_iters, spectral_norm,
          spectral_target, spectral_iters, base_width, width_exponent, stochastic_round, seed, True)


sinkgd_step.register_fake(meta.sinkgd_step_fake)
if TRITON_DEVICES:
    sinkgd_step.register_kernel(TRITON_DEVICES)(_sinkgd_step_triton)
