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


def _lr_factor(n, lr_scale, base_width, width_exponent) -> float:
    """eta / lr = lr_scale * (base_width / n) ** width_exponent (the last factor only if set)."""
    return lr_scale * ((base_width / n) ** width_exponent if base_width is not None else 1.0)


def _spectral_target(spectral_target, m, n) -> float:
    return 1.0 if spectral_target == "unit" else math.sqrt(m / n)


def _coefs(lr, n, lr_scale, weight_decay, base_width, width_exponent, spectral_scale):
    """eta = lr * _lr_factor(...); returns (eta * s [B], eta * wd) as fp32 device tensors: no
    host sync, and a tensor lr that changes never recompiles."""
    eta = lr.to(torch.float32) * _lr_factor(n, lr_scale, base_width, width_exponent)
    return eta * spectral_scale, (eta * weight_decay).reshape(1)


def _cdiv(a, b):
    return -(-a // b)


def _triton_group(ps, gs, vecs, lr, lr_scale, weight_decay, eps, iters, spectral_norm, spectral_target,
                  spectral_iters, base_width, width_exponent, stochastic, seed):
    """One SinkGD step for matrices sharing a (param dtype, grad dtype) pair: 4L + 1 launches of
    the multi-tensor kernels, whatever the number of matrices."""
    from ..kernels import sinkgd as K

    dev = ps[0].device
    w3s = [_as3d(p) for p in ps]
    g3s = [_as3d(g.contiguous()) for g in gs]
    rbm, rbn, rw = K.ROW_TILE
    cbm, cbn, cw = K.COL_TILE
    ubm, ubn, uw = K.UPD_TILE
    sb = K.SCALE_BLOCK
    meta, firsts = [], [[0] for _ in range(K.N_KERNELS)]
    r_off = c_off = pr_off = pc_off = coef_off = 0
    factors_b, factors_m, spans = [], [], []
    for w3, g3 in zip(w3s, g3s):
        b, m, n = w3.shape
        tn, tm = _cdiv(n, rbn), _cdiv(m, cbm)
        # row order = kernels/sinkgd.py's meta columns
        meta += [g3.data_ptr(), w3.data_ptr(), m, n, r_off, c_off, pr_off, pc_off, coef_off]
        progs = (b * _cdiv(m, rbm) * tn, b * tm * _cdiv(n, cbn), b * _cdiv(m, sb), b * _cdiv(n, sb),
                 b * _cdiv(m, ubm) * _cdiv(n, ubn))
        for k, pr in enumerate(progs):
            firsts[k].append(firsts[k][-1] + pr)
        spans.append((r_off, c_off, b, m, n))
        f = _lr_factor(n, lr_scale, base_width, width_exponent)
        factors_b += [f] * b
        factors_m.append(f)
        r_off += b * m
        c_off += b * n
        pr_off += b * tn * m
        pc_off += b * tm * n
        coef_off += b
    n_mats = len(w3s)
    table = torch.tensor(meta + [x for row in firsts for x in row], dtype=torch.int64).to(dev, non_blocking=True)
    t_meta, t_first = table[: len(meta)], table[len(meta):]
    r = torch.ones(r_off, dtype=torch.float32, device=dev)
    c = torch.ones(c_off, dtype=torch.float32, device=dev)
    part_r = torch.empty(pr_off, dtype=torch.float32, device=dev)
    part_c = torch.empty(pc_off, dtype=torch.float32, device=dev)
    gdt, wdt = g3s[0], w3s[0]
    for _ in range(iters):
        K._sinkgd_sums_kernel[(firsts[0][-1],)](t_meta, t_first, n_mats, gdt, r, c, part_r,
                                                AXIS=0, BM=rbm, BN=rbn, num_warps=rw)
        K._sinkgd_scale_kernel[(firsts[2][-1],)](t_meta, t_first, n_mats, r, part_r, eps,
                                                 AXIS=0, PART_TILE=rbn, BLOCK=sb)
        K._sinkgd_sums_kernel[(firsts[1][-1],)](t_meta, t_first, n_mats, gdt, r, c, part_c,
                                                AXIS=1, BM=cbm, BN=cbn, num_warps=cw)
        K._sinkgd_scale_kernel[(firsts[3][-1],)](t_meta, t_first, n_mats, c, part_c, eps,
                                                 AXIS=1, PART_TILE=cbm, BLOCK=sb)
    fac = torch.tensor(factors_b + factors_m, dtype=torch.float32).to(dev, non_blocking=True)
    eta_b, eta_m = lr.to(dev, torch.float32) * fac[:coef_off], lr.to(dev, torch.float32) * fac[coef_off:]
    if spectral_norm:
        s_all = []
        for i, (ro, co, b, m, n) in enumerate(spans):
            target = _spectral_target(spectral_target, m, n)
            s_all.append(reference.sinkgd_spectral_scale(
                g3s[i], r[ro:ro + b * m].view(b, m), c[co:co + b * n].view(b, n), vecs[i], spectral_iters, target, eps))
        eta_b = eta_b * torch.cat(s_all)
    coef_w = eta_m * weight_decay
    K._sinkgd_update_kernel[(firsts[4][-1],)](t_meta, t_first, n_mats, gdt, wdt, r, c, eta_b, coef_w,
                                              seed.to(dev), STOCHASTIC=stochastic, BM=ubm, BN=ubn, num_warps=uw)


def _step(params, grads, spectral_vecs, lr, lr_scale, weight_decay, eps, sinkhorn_iters, spectral_norm,
          spectral_target, spectral_iters, base_width, width_exponent, stochastic_round, seed, use_triton):
    meta.check_sinkgd(params, grads, spectral_vecs, lr, sinkhorn_iters, spectral_norm, spectral_target,
                      spectral_iters, eps, seed)
    groups: dict = {}
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.numel() == 0:
            continue
        if use_triton and torch.float64 not in (p.dtype, g.dtype):
            groups.setdefault((p.dtype, g.dtype), []).append(i)
            continue
        # the reference path (CPU, and float64 anywhere)
        w3 = _as3d(p)  # a view: p is contiguous
        g3 = _as3d(g.contiguous())
        b, m, n = w3.shape
        r, c = reference.sinkgd_scales(g3, sinkhorn_iters, eps)
        if spectral_norm:
            target = _spectral_target(spectral_target, m, n)
            s = reference.sinkgd_spectral_scale(g3, r, c, spectral_vecs[i], spectral_iters, target, eps)
        else:
            s = torch.ones(b, dtype=torch.float32, device=p.device)
        coef_x, coef_w = _coefs(lr.to(p.device), n, lr_scale, weight_decay, base_width, width_exponent, s)
        reference.sinkgd_update_(w3, g3, r, c, coef_x, coef_w)
    for (pdt, _), idx in groups.items():
        _triton_group([params[i] for i in idx], [grads[i] for i in idx],
                      [spectral_vecs[i] for i in idx] if spectral_norm else [], lr, lr_scale, weight_decay, eps,
                      sinkhorn_iters, spectral_norm, spectral_target, spectral_iters, base_width, width_exponent,
                      bool(stochastic_round) and pdt == torch.bfloat16, seed)


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
