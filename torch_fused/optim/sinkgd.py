"""``torch_fused.optim.SinkGD``: a stateless SR-Sinkhorn optimizer on fused::sinkgd_step, with
AdamW for the parameters SinkGD does not take (ndim < 2: biases, norms)."""

from __future__ import annotations

import functools

import torch
from torch.optim import Optimizer

from ..ops.sinkgd import sinkgd_step_eager

_FALLBACKS = ("adamw",)


def _functional_adamw():
    """PyTorch's functional AdamW: Adam with decoupled weight decay in newer releases, the
    separate ``adamw`` function in older ones."""
    import inspect

    from torch.optim import adam

    if "decoupled_weight_decay" in inspect.signature(adam.adam).parameters:
        return lambda *a, **k: adam.adam(*a, decoupled_weight_decay=True, **k)
    from torch.optim import adamw

    return adamw.adamw


_ADAMW = _functional_adamw()


def _warm_start(p: torch.Tensor) -> torch.Tensor:
    """A fixed, non-degenerate unit vector per matrix [B, n] to start the power iteration from
    (no random generator: the same on every run and traceable by torch.compile)."""
    n = p.shape[-1]
    b = p.numel() // (p.shape[-2] * n)
    v = torch.cos(0.5 + 2.399963 * torch.arange(n, dtype=torch.float32, device=p.device))
    v = v / v.norm()
    return v.expand(b, n).clone()


class SinkGD(Optimizer):
    """SinkGD (Scetbon et al., "Gradient Multi-Normalization for Stateless and Scalable LLM
    Training", arXiv 2502.06742). The exact algorithm: docs/SINKGD.md.

    Parameters with ndim >= 2 (a matrix, or a batch of matrices [..., m, n]) get the SinkGD
    update through ``fused::sinkgd_step``, keeping no state except, with ``spectral_norm``, one
    warm-start vector per matrix. Parameters with ndim < 2 get the fallback (PyTorch's AdamW,
    fused where available) with ``fallback_kwargs`` (default lr: the group's lr, betas (0.9,
    0.999), eps 1e-8, weight decay 0). Use :func:`sinkgd_param_groups` to also route embeddings
    and the output head to the fallback.

    ``lr`` may be a float or a 0-dim tensor; under ``torch.compile`` pass a tensor (and change it
    in place with ``fill_``) so a schedule never recompiles the step. A parameter without a
    gradient is skipped. Sparse or non-contiguous matrix parameters raise a clear error.
    ``stochastic_round`` rounds bf16 parameters stochastically (on CUDA); the bits are a
    function of the step count, so runs repeat exactly.
    """

    def __init__(self, params, lr=1e-3, *, sinkhorn_iters=5, lr_scale=0.05, weight_decay=0.0, eps=1e-8,
                 spectral_norm=False, spectral_target="unit", spectral_iters=1, base_width=None,
                 width_exponent=1.0, stochastic_round=False, fallback="adamw", fallback_kwargs=None):
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError(f"lr: expected a float or a 1-element tensor, got shape {tuple(lr.shape)}")
        elif not lr >= 0:
            raise ValueError(f"lr: expected >= 0, got {lr}")
        if sinkhorn_iters < 0:
            raise ValueError(f"sinkhorn_iters: expected >= 0, got {sinkhorn_iters}")
        if spectral_target not in ("unit", "muon"):
            raise ValueError(f"spectral_target: expected 'unit' or 'muon', got {spectral_target!r}")
        if fallback not in _FALLBACKS:
            raise ValueError(f"fallback: expected one of {_FALLBACKS}, got {fallback!r}")
        if not eps > 0:
            raise ValueError(f"eps: expected > 0, got {eps}")
        defaults = dict(lr=lr, sinkhorn_iters=sinkhorn_iters, lr_scale=lr_scale, weight_decay=weight_decay,
                        eps=eps, spectral_norm=spectral_norm, spectral_target=spectral_target,
                        spectral_iters=spectral_iters, base_width=base_width, width_exponent=width_exponent,
                        stochastic_round=stochastic_round, fallback=fallback,
                        fallback_kwargs=dict(fallback_kwargs or {}), use_fallback=False)
        super().__init__(params, defaults)

    def _fallback_step(self, group, params, lr):
        kw = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        kw.update(group["fallback_kwargs"])
        f_lr = kw.pop("lr", lr)
        grads, m1, m2, steps = [], [], [], []
        for p in params:
            st = self.state[p]
            if "exp_avg" not in st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads.append(p.grad)
            m1.append(st["exp_avg"])
            m2.append(st["exp_avg_sq"])
            steps.append(st["step"])
        on_cuda = all(p.is_cuda for p in params)
        compiling = torch.compiler.is_compiling()
        fused = on_cuda and not compiling
        _ADAMW(
            params, grads, m1, m2, [], steps, amsgrad=False, beta1=kw["betas"][0], beta2=kw["betas"][1],
            lr=f_lr, weight_decay=kw["weight_decay"], eps=kw["eps"], maximize=False,
            foreach=None if fused else False, fused=True if fused else None,
            capturable=on_cuda and compiling,  # step counts stay on the device: no sync in a graph
            differentiable=False, has_complex=False)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = group["lr"]
            mats, grads, vecs, small = [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() < 2 or group["use_fallback"]:
                    small.append(p)
                    continue
                mats.append(p)
                grads.append(p.grad)
                if group["spectral_norm"]:
                    st = self.state[p]
                    if "spectral_v" not in st:
                        st["spectral_v"] = _warm_start(p)
                    vecs.append(self.state[p]["spectral_v"])
            if mats:
                st0 = self.state[mats[0]]
                if "step" not in st0:  # drives the stochastic-rounding seed; float32 like torch's
                    st0["step"] = torch.zeros((), dtype=torch.float32, device=mats[0].device)
                st0["step"].add_(1)
                lr_t = lr if isinstance(lr, torch.Tensor) else torch.tensor(lr, dtype=torch.float32)
                # eager: the op's implementation without torch.library's per-call wrapper (see
                # ops/sinkgd.py::sinkgd_step_eager); compiled: the op, traced as one node
                compiling = torch.compiler.is_compiling()
                step_fn = torch.ops.fused.sinkgd_step if compiling else functools.partial(sinkgd_step_eager, graphs=True)
                step_fn(
                    mats, grads, vecs, lr_t.reshape(()).to(mats[0].device), float(group["lr_scale"]),
                    float(group["weight_decay"]), float(group["eps"]), int(group["sinkhorn_iters"]),
                    bool(group["spectral_norm"]), group["spectral_target"], int(group["spectral_iters"]),
                    None if group["base_width"] is None else float(group["base_width"]),
                    float(group["width_exponent"]), bool(group["stochastic_round"]), st0["step"])
            if small:
                self._fallback_step(group, small, lr)
        return loss


def sinkgd_param_groups(model: torch.nn.Module, **fallback_group):
    """Two param groups for SinkGD, as the paper's setup: the matrices of the model's hidden
    layers (SinkGD), and everything else (the fallback): ndim < 2 params, embeddings and the
    output head (names containing ``embed``, ``lm_head``, ``wte``, ``wpe``, ``output``, modules
    that are ``nn.Embedding``, and any parameter tied to one of those). Extra keyword arguments
    go into the fallback group (e.g. ``weight_decay=0.0``)."""
    head_like = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, torch.nn.Embedding):
            for p in mod.parameters(recurse=False):
                head_like.add(id(p))
    keys = ("embed", "lm_head", "wte", "wpe", "output")
    for name, p in model.named_parameters(remove_duplicate=False):
        if any(k in name.lower() for k in keys):
            head_like.add(id(p))
    sink, rest, seen = [], [], set()
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue  # a tied weight appears once, in the fallback if any of its names is head-like
        seen.add(id(p))
        (rest if p.dim() < 2 or id(p) in head_like else sink).append(p)
    groups = [{"params": sink}]
    if rest:
        groups.append(dict(params=rest, use_fallback=True, **fallback_group))
    return groups
