"""``torch_fused.optim.SinkGD``: a stateless SR-Sinkhorn optimizer on fused::sinkgd_step, with
AdamW for the parameters SinkGD does not take (ndim < 2: biases, norms); ``sinkgd_step``: one
SinkGD update of a list of matrices, with keyword arguments."""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from collections.abc import Mapping

import torch
from torch.optim import Optimizer

from ..meta.sinkgd import _all_valid, check_param_grad
from ..ops.sinkgd import SinkGDCache, sinkgd_step_eager
from . import sharded
from .. import reference
from .._library import is_dtensor


def sinkgd_step(params, grads, *, lr, spectral_vecs=None, lr_scale=0.05, weight_decay=0.0, eps=1e-8,
                sinkhorn_iters=5, spectral_norm=False, spectral_target="unit", spectral_iters=1,
                base_width=None, width_exponent=1.0, stochastic_round=False, step=None,
                cache: SinkGDCache | None = None) -> None:
    """One in-place SinkGD update of the matrices ``params`` (each ``[..., m, n]``, leading dims
    independent matrices) from their gradients ``grads``: ``fused::sinkgd_step`` with keyword
    arguments. The exact formula: docs/SINKGD.md.

    - ``lr``: a float or a 0-dim tensor (a tensor changed in place never recompiles a compiled
      step). The step applied is ``eta * X`` with ``eta = lr * lr_scale * (base_width / n) **
      width_exponent`` (the last factor only if ``base_width`` is set) and X the normalized
      gradient, whose entries have RMS 1: see "Choosing lr" in docs/SINKGD.md.
    - ``sinkhorn_iters``: SR-Sinkhorn iterations (rows to l2 norm sqrt(n), then columns to sqrt(m)).
    - ``weight_decay``: decoupled, ``W -= eta * weight_decay * W``.
    - ``eps``: the floor of every norm divided by.
    - ``spectral_norm``: also divide X by its largest singular value (``spectral_iters`` power
      iterations) times ``spectral_target`` ("unit": 1, "muon": sqrt(m / n)); needs
      ``spectral_vecs``, one float32 ``[B, n]`` warm-start vector per matrix, updated in place.
    - ``stochastic_round``: round bf16 parameters stochastically (Triton path; the CPU reference
      rounds to nearest), with bits seeded by ``step``.
    - ``step``: a 0-dim tensor, the step count that seeds stochastic rounding (None: 0).
    - ``cache``: a ``SinkGDCache`` that keeps the kernels' work plans (and on CUDA graphs of
      repeated steps) for the next call with the same tensors; ``SinkGD`` passes its own. Used
      in eager calls only: without it, or under torch.compile, this calls the op, which reuses
      plans from a cache of its own (never CUDA graphs of its own).

    Returns None; ``params`` (and ``spectral_vecs``) are updated in place.
    """
    dev = params[0].device if params else torch.device("cpu")
    if isinstance(lr, torch.Tensor):
        lr = lr.reshape(()).to(dev)
    else:  # float64 where a float64 matrix is stepped (its step is float64 throughout)
        try:  # a number, a numpy scalar or 0-dim array; not a string ("1e-3") or a bool
            value = None if isinstance(lr, (bool, str, bytes)) else float(lr)
        except (TypeError, ValueError):
            value = None
        if value is None or not 0 <= value < math.inf:
            raise ValueError(f"lr: expected a finite float >= 0 or a 0-dim tensor, got {lr!r}")
        wide = any(p.dtype == torch.float64 for p in params)
        lr = torch.tensor(float(lr), dtype=torch.float64 if wide else torch.float32, device=dev)
    if step is None:
        step = torch.zeros((), dtype=torch.float32, device=dev)
    args = (list(params), list(grads), [] if spectral_vecs is None else list(spectral_vecs), lr, float(lr_scale),
            float(weight_decay), float(eps), int(sinkhorn_iters), bool(spectral_norm), spectral_target,
            int(spectral_iters), None if base_width is None else float(base_width), float(width_exponent),
            bool(stochastic_round), step)
    if cache is not None and not torch.compiler.is_compiling():
        # the op's implementation without torch.library's per-call wrapper (see
        # ops/sinkgd/__init__.py::sinkgd_step_eager), reusing the cache's plans
        sinkgd_step_eager(*args, cache=cache)
    else:
        torch.ops.fused.sinkgd_step(*args)


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


def _check_group(group) -> None:
    """A param group's settings (the optimizer's defaults filled in), each error naming its
    argument; a tensor lr is read here once, never in a step."""
    _check_lr(group["lr"], "lr")
    it = _count(group["sinkhorn_iters"])
    if it is None or it < 0:
        raise ValueError(f"sinkhorn_iters: expected an int >= 0, got {group['sinkhorn_iters']!r}")
    wd = _finite_float(group["weight_decay"])
    if wd is None or wd < 0:
        raise ValueError(f"weight_decay: expected a finite float >= 0, got {group['weight_decay']!r}")
    if group["base_width"] is not None:
        width = _finite_float(group["base_width"])
        if width is None or not width > 0:
            raise ValueError(f"base_width: expected None or a finite float > 0, got {group['base_width']!r}")
    _check_fallback_kwargs(group["fallback_kwargs"])
    target = group["spectral_target"]
    if not (isinstance(target, str) and target in ("unit", "muon")):
        raise ValueError(f"spectral_target: expected 'unit' or 'muon', got {target!r}")
    eps = _finite_float(group["eps"])
    if eps is None or not eps > 0:
        raise ValueError(f"eps: expected a finite float > 0, got {group['eps']!r}")
    scale = _finite_float(group["lr_scale"])
    if scale is None or scale < 0:
        raise ValueError(f"lr_scale: expected a finite float >= 0, got {group['lr_scale']!r}")
    if _finite_float(group["width_exponent"]) is None:
        raise ValueError(f"width_exponent: expected a finite float, got {group['width_exponent']!r}")
    for key in ("spectral_norm", "stochastic_round", "use_fallback"):
        if _flag(group[key]) is None:
            raise ValueError(f"{key}: expected True or False, got {group[key]!r}")
    it, least = _count(group["spectral_iters"]), 1 if group["spectral_norm"] else 0
    if it is None or it < least:
        raise ValueError(f"spectral_iters: expected an int >= {least}"
                         f"{' with spectral_norm=True' if least else ''}, got {group['spectral_iters']!r}")
    _check_adamw_settings(group["fallback_kwargs"] or {}, "fallback_kwargs")
    own = group.get("adamw_keys", ())
    if own:  # a use_fallback group's own AdamW settings
        _check_adamw_settings({k: group[k] for k in own}, "param group")


def _check_lr(lr, name: str) -> None:
    """An lr as SinkGD (and its AdamW) takes it: a finite number >= 0 (a Python or NumPy number,
    not a bool) or a 0-dim floating-point tensor holding one (read here once: a tensor changed
    in place later is the scheduler's business). ``name`` is the argument named in the error."""
    if isinstance(lr, torch.Tensor):
        if lr.dim() != 0 or not lr.is_floating_point():
            raise ValueError(f"{name}: expected a float or a 0-dim floating-point tensor, got a tensor of shape "
                             f"{tuple(lr.shape)} and dtype {lr.dtype}")
        value = float(lr)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}: expected a finite value >= 0, got a tensor holding {value}")
        return
    value = _finite_float(lr)
    if value is None or value < 0:
        raise ValueError(f"{name}: expected a finite float >= 0 or a 0-dim floating-point tensor, got {lr!r}")


def _check_fallback_kwargs(kw) -> None:
    """fallback_kwargs: None or a dict of AdamW settings (ADAMW_GROUP_KEYS); the values are
    checked by _check_adamw_settings."""
    if kw is None:
        return
    if not isinstance(kw, Mapping):
        raise ValueError(f"fallback_kwargs: expected None or a dict of AdamW settings "
                         f"({', '.join(ADAMW_GROUP_KEYS)}), got {kw!r}")
    bad = sorted(map(str, set(kw) - set(ADAMW_GROUP_KEYS)))
    if bad:
        raise ValueError(f"fallback_kwargs: SinkGD's AdamW takes {', '.join(ADAMW_GROUP_KEYS)}; got {', '.join(bad)}")


def _finite_float(value):
    """``value`` as a finite float (a Python or NumPy number or 0-dim NumPy array, not a bool; a
    0-dim floating-point tensor, read here once), else None."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not value.is_floating_point():
            return None
        value = float(value)  # read once, here (the step takes it as a float too)
    elif type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and value.dtype.kind in "fiu":
        value = value.item()  # a 0-dim NumPy array (a NumPy scalar is a numbers.Real already)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _count(value):
    """``value`` as an int (a Python or NumPy integer, not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return operator.index(value)


def _flag(value):
    """``value`` as a bool (a Python or NumPy bool), else None: a string such as "False" or a
    number is refused, not taken by its truth value."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and value.dtype.kind == "b":
        return bool(value)
    return None


def _check_adamw_settings(kw, where: str) -> None:
    """The values of AdamW settings (lr, weight_decay, eps, betas) as torch.optim.AdamW takes
    them, each error naming the setting and where it was given."""
    if "lr" in kw:
        _check_lr(kw["lr"], f"{where} lr")
    for key in ("weight_decay", "eps"):
        if key in kw:
            value = _finite_float(kw[key])
            if value is None or value < 0:
                raise ValueError(f"{where} {key}: expected a finite float >= 0 for SinkGD's AdamW, got {kw[key]!r}")
    if "betas" in kw:
        b = kw["betas"]
        vals = [_finite_float(x) for x in b] if isinstance(b, (tuple, list)) else []
        if not (len(vals) == 2 and all(v is not None and 0.0 <= v < 1.0 for v in vals)):
            raise ValueError(f"{where} betas: expected two floats in [0, 1) for SinkGD's AdamW, got {b!r}")


# the keys of a use_fallback group that set its AdamW (SinkGD.add_param_group)
ADAMW_GROUP_KEYS = ("lr", "weight_decay", "eps", "betas")


def _eager(fn):
    """``fn`` outside torch.compile's tracing (a graph break where it is called)."""
    return torch.compiler.disable(fn, recursive=True)


def _warm_start(p: torch.Tensor) -> torch.Tensor:
    """A fixed, non-degenerate unit vector per matrix [B, n] to start the power iteration from
    (no random generator: the same on every run and traceable by torch.compile)."""
    n = p.shape[-1]
    b = math.prod(p.shape[:-2])  # (an empty matrix has m * n = 0)
    v = reference.spectral_restart(n, p.device)
    v = v / v.norm()
    v = v.expand(b, n).clone()
    if is_dtensor(p) and sharded.warm_start_is_sharded(p):
        return sharded.shard_like(v.view(*p.shape[:-2], n), p)  # a Shard(0) batch: sharded like it
    return v  # plain, the same on every rank for a DTensor parameter


class SinkGD(Optimizer):
    """SinkGD (Scetbon et al., "Gradient Multi-Normalization for Stateless and Scalable LLM
    Training", arXiv 2502.06742). The exact algorithm: docs/SINKGD.md.

    Parameters with ndim >= 2 (a matrix, or a batch of matrices [..., m, n]) get the SinkGD
    update through ``fused::sinkgd_step``, keeping no state except a step count per param group
    (the stochastic-rounding seed, held by the group's first matrix) and, with
    ``spectral_norm``, one warm-start vector per matrix. Parameters with ndim < 2, and the groups made with
    ``use_fallback=True``, get PyTorch's AdamW (fused where available) with ``fallback_kwargs``
    (default lr: the group's lr, which is SinkGD's: constructing such a group without an AdamW
    lr, its own or ``fallback_kwargs["lr"]``, warns; betas (0.9, 0.999), eps 1e-8, weight decay 0). A
    ``use_fallback`` group's own ``lr``, ``weight_decay``, ``eps`` and ``betas``, where the group
    gives them, are its AdamW's and take precedence over ``fallback_kwargs``. Use
    :func:`sinkgd_param_groups` to also route embeddings and the output head to AdamW.

    ``lr`` is not AdamW's lr: the step is ``eta * X`` with ``eta = lr * lr_scale`` (0.05 by
    default) times ``(base_width / n) ** width_exponent`` if ``base_width`` is set, and X, the
    normalized gradient, has entries of RMS 1. AdamW moves an entry by about its lr where the
    gradient's sign is steady, so the same ``lr`` here gives steps about 20 times smaller. Start
    from ``eta`` between about 0.2x and 1x the AdamW lr (``lr`` 4 to 20 times it at the default
    ``lr_scale``) and tune: docs/SINKGD.md, "Choosing lr". The AdamW parameters of a group use its
    ``lr``, or ``fallback_kwargs["lr"]`` scaled as the group's lr moves away from the value it had
    when the group was added (an lr scheduler's factor, a hand-set lr: set the lr you train with
    before constructing, or give it to the constructor; for a warm-up schedule, its peak).
    ``fallback_kwargs`` takes ``lr``, ``weight_decay``, ``eps`` and ``betas``. ``OneCycleLR`` and
    ``CyclicLR`` need ``cycle_momentum=False`` (SinkGD has no momentum to cycle): docs/SINKGD.md.

    ``lr`` may be a float or a 0-dim tensor; under ``torch.compile`` pass a tensor (and change it
    in place with ``fill_``) so a schedule never recompiles the step. A parameter without a
    gradient is skipped. Sparse or non-contiguous matrix parameters raise a clear error.
    ``stochastic_round`` rounds bf16 parameters stochastically (on CUDA); the bits are a
    function of the step count, so runs repeat exactly.

    The optimizer owns a ``SinkGDCache`` (``plan_cache``): the kernels' work plans for its
    parameters and, on CUDA, graphs of repeated eager steps. A compiled step calls the op.

    DTensor parameters (``fully_shard`` / FSDP2: ``Shard(0)`` rows, uneven splits included; a
    ``Shard(0)`` batch of matrices; ``Replicate()``; on a 1-D mesh) get the step of the whole
    matrices from their local shards (optim/sharded.py), with one all-reduce of O(columns)
    floats per Sinkhorn iteration and per power iteration; other placements raise ValueError.
    Under ``torch.compile`` their steps run eagerly (graph breaks). See docs/SINKGD.md,
    "Sharded parameters".
    """

    def __init__(self, params, lr=1e-3, *, sinkhorn_iters=5, lr_scale=0.05, weight_decay=0.0, eps=1e-8,
                 spectral_norm=False, spectral_target="unit", spectral_iters=1, base_width=None,
                 width_exponent=1.0, stochastic_round=False, fallback_kwargs=None):
        # every group's settings, these defaults filled in, are checked in add_param_group
        _check_fallback_kwargs(fallback_kwargs)  # before it is copied into a dict
        defaults = dict(lr=lr, sinkhorn_iters=sinkhorn_iters, lr_scale=lr_scale, weight_decay=weight_decay,
                        eps=eps, spectral_norm=spectral_norm, spectral_target=spectral_target,
                        spectral_iters=spectral_iters, base_width=base_width, width_exponent=width_exponent,
                        stochastic_round=stochastic_round, fallback_kwargs=dict(fallback_kwargs or {}),
                        use_fallback=False)
        super().__init__(params, defaults)
        self.plan_cache = SinkGDCache()

    def __setstate__(self, state):
        super().__setstate__(state)
        self.plan_cache = SinkGDCache()  # never pickled or copied: plans hold device addresses

    def load_state_dict(self, state_dict):
        # Optimizer.load_state_dict casts floating state to the parameter's dtype; the
        # warm-start vectors stay float32 (the power iteration's precision). They are taken from
        # the state_dict as the load pre-hooks leave it (a hook registered last, for this load
        # only) and put back before the post-hooks run (one registered first).
        final = {}
        bases = [g.get("fallback_lr_base") for g in self.param_groups]  # the constructed groups'

        def take(_, sd):
            final["sd"] = sd

        def restore(_):
            sd = final["sd"]
            for group, base in zip(self.param_groups, bases):
                if base is not None and "fallback_lr_base" not in group:  # saved before it was recorded
                    group["fallback_lr_base"] = base
            saved = {k: st["spectral_v"] for k, st in sd["state"].items() if isinstance(st, dict) and "spectral_v" in st}
            ids = [i for g in sd["param_groups"] for i in g["params"]]
            params = [p for g in self.param_groups for p in g["params"]]
            for i, p in zip(ids, params):
                if i in saved:
                    self.state[p]["spectral_v"] = saved[i].to(device=p.device, dtype=torch.float32).clone()
                st = self.state.get(p)
                if st and isinstance(st.get("step"), torch.Tensor) and st["step"].device != p.device:
                    # step counts on the parameter's device, as they were made (Optimizer leaves them
                    # where the checkpoint was loaded, e.g. the CPU): the seed is read on the device,
                    # inside CUDA graphs too, and fused AdamW takes its counts there
                    st["step"] = st["step"].to(device=p.device, dtype=torch.float32)

        handles = (self.register_load_state_dict_pre_hook(take),
                   self.register_load_state_dict_post_hook(restore, prepend=True))
        try:
            super().load_state_dict(state_dict)
        finally:
            for h in handles:
                h.remove()

    def add_param_group(self, param_group):
        # an AdamW group (use_fallback=True) takes the AdamW settings it names itself; recorded
        # here, since the defaults fill every key in a moment (see _fallback_step)
        if isinstance(param_group, dict) and param_group.get("use_fallback"):
            param_group = dict(param_group)
            param_group.setdefault("adamw_keys", tuple(k for k in ADAMW_GROUP_KEYS if k in param_group))
        if isinstance(param_group, dict) and "fallback_kwargs" in param_group and param_group["fallback_kwargs"] is None:
            param_group = {**param_group, "fallback_kwargs": {}}  # None: no AdamW settings, as the constructor's
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_group(group)
        if "lr" in group["fallback_kwargs"] and "lr" not in group.get("adamw_keys", ()):
            # the group's lr that a fallback_kwargs lr is relative to, where no scheduler records
            # its initial_lr (ReduceLROnPlateau, an lr set by hand): see _fallback_step
            group["fallback_lr_base"] = float(group["lr"])
        if group["stochastic_round"] and not group["use_fallback"]:
            from .._library import TRITON_DEVICES

            elsewhere = sorted({str(p.device) for p in group["params"]
                                if p.dim() >= 2 and p.dtype == torch.bfloat16 and p.device.type not in TRITON_DEVICES})
            if elsewhere:
                warnings.warn(
                    f"SinkGD: stochastic_round=True has no effect on bf16 parameters on {', '.join(elsewhere)}: the "
                    "step there (the PyTorch reference) rounds to nearest; stochastic rounding runs in the Triton "
                    "kernels (CUDA)", UserWarning, stacklevel=3)
        # SinkGD's lr is typically 4-20x an AdamW lr (spectral: ~1000x): never apply it to AdamW silently
        if "lr" in group["fallback_kwargs"] or "lr" in group.get("adamw_keys", ()):
            return
        if group["use_fallback"]:
            what = f"a use_fallback group ({len(group['params'])} parameter(s): embeddings, head, vectors) goes"
        else:
            small = sum(p.dim() < 2 for p in group["params"])
            if not small:
                return
            what = f"{small} parameter(s) with fewer than 2 dims (biases, norms) go"
        warnings.warn(
            f"SinkGD: {what} to AdamW at this group's lr={group['lr']!r}, which is SinkGD's lr (typically 4-20x an "
            "AdamW lr, ~1000x with spectral_norm). Set AdamW's lr with fallback_kwargs={'lr': ...}, or build the "
            "groups with sinkgd_param_groups(model, lr=adamw_lr)", UserWarning, stacklevel=3)

    def _fallback_step(self, group, params, adamw_state, lr):
        """AdamW on ``params`` (``adamw_state``: their gradients, moments and step counts, as
        _init_group lists them): betas (0.9, 0.999), eps 1e-8, weight decay 0, lr the group's;
        then the group's ``fallback_kwargs``; then, in a ``use_fallback`` group, the AdamW
        settings the group itself was given (``ADAMW_GROUP_KEYS``: its lr, weight_decay, eps,
        betas), read at each step (a scheduler's lr applies). A ``fallback_kwargs`` lr follows the
        group's lr: it is scaled by the group's lr over its lr when the group was added
        (``fallback_lr_base``), so an lr scheduler's factor (ReduceLROnPlateau included) and a
        hand-set lr apply to it alike; a group loaded from a state_dict saved without that record
        takes the constructed group's (load_state_dict), else the ``initial_lr`` a scheduler
        recorded."""
        kw = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        kw.update(group["fallback_kwargs"])
        own = group.get("adamw_keys", ())
        for key in own:
            kw[key] = group[key]
        f_lr = kw.pop("lr", lr)
        if "lr" not in own and "lr" in group["fallback_kwargs"]:
            # fallback_kwargs' lr follows the group's lr by the same factor: group lr / its lr
            # when added (else / the lr a scheduler started from; neither: the lr as given)
            start = group.get("fallback_lr_base", group.get("initial_lr"))
            if start is not None and not (isinstance(start, (int, float)) and start == 0):
                f_lr = f_lr * (group["lr"] / start)
        grads, m1, m2, steps = adamw_state
        on_cuda = all(p.is_cuda for p in params)
        compiling = torch.compiler.is_compiling()
        fused = on_cuda and not compiling
        _ADAMW(
            params, grads, m1, m2, [], steps, amsgrad=False, beta1=kw["betas"][0], beta2=kw["betas"][1],
            lr=f_lr, weight_decay=kw["weight_decay"], eps=kw["eps"], maximize=False,
            foreach=None if fused else False, fused=True if fused else None,
            capturable=on_cuda and compiling,  # step counts stay on the device: no sync in a graph
            differentiable=False, has_complex=False)

    def _init_group(self, group, mats, grads, vecs, small, steps, small_grads, exp_avgs, exp_avg_sqs, small_steps):
        """Sorts the group's parameters that have a gradient into mats, grads and vecs (SinkGD;
        steps: the group's step count) and small (AdamW; small_grads, exp_avgs, exp_avg_sqs,
        small_steps: their gradients, moments and step counts), creating the state they lack.
        Under torch.compile this runs eagerly (as torch.optim's own ``_init_group``), so the
        state tensors are ordinary allocations with static addresses, not outputs of a compiled
        graph, which inductor's CUDA graphs would keep in their memory pool. The step reads the
        state only through these lists: a traced read or write of ``self.state`` would be
        replayed by torch.compile over the entries made here (a lost step count). Every output is
        a list argument of its own: torch.compile carries the lists' new items back into the
        trace, not those of a list inside another argument."""
        state, fallback, spectral = self.state, group["use_fallback"], group["spectral_norm"]
        for p in group["params"]:  # host work per parameter per step: kept to a few lookups
            g = p.grad
            if g is None:
                continue
            if fallback or p.dim() < 2:
                small.append(p)
                st = state[p]
                if "exp_avg" not in st:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                small_grads.append(g)
                exp_avgs.append(st["exp_avg"])
                exp_avg_sqs.append(st["exp_avg_sq"])
                small_steps.append(st["step"])
                continue
            mats.append(p)
            grads.append(g)
            if spectral:
                st = state[p]
                v = st.get("spectral_v")
                if v is None:
                    v = st["spectral_v"] = _warm_start(p)
                vecs.append(v)
        if mats:
            # the group's step count lives with its first matrix, whichever matrices have a
            # gradient in this step (a count that moved would restart the seed)
            st0 = self.state[next(p for p in group["params"] if p.dim() >= 2)]
            if "step" not in st0:  # drives the stochastic-rounding seed; float32 like torch's
                st0["step"] = torch.zeros((), dtype=torch.float32, device=mats[0].device)
            steps.append(st0["step"])
        return False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for gi, group in enumerate(self.param_groups):
            mats, grads, vecs, small, steps = [], [], [], [], []
            adamw_state = ([], [], [], [])  # the AdamW parameters' gradients, moments, step counts
            self._init_group(group, mats, grads, vecs, small, steps, *adamw_state)
            # checked before any group updates: never a half-applied step
            for p in small:
                if p.grad.is_sparse:
                    raise ValueError(f"params: a parameter of shape {tuple(p.shape)} that goes to SinkGD's AdamW has a "
                                     "sparse gradient, which AdamW does not take (use a dense embedding, or another "
                                     "optimizer for it)")
            # a later group's matrices: checked here, since earlier groups would have moved when
            # its own step rejected them (a group's own step checks the first group's; the
            # common layouts, sinkgd_param_groups', have SinkGD matrices in one group only, so
            # no pass of this per step: it would cost host time per matrix)
            plain = [(p, g) for p, g in zip(mats, grads) if not is_dtensor(p)] if gi and mats else ()
            if plain and not _all_valid(*zip(*plain)):  # one cheap pass; names the culprit only on failure
                where = {id(p): j for j, p in enumerate(group["params"])}
                for p, g in plain:
                    name = f"param_groups[{gi}]['params'][{where[id(p)]}]"
                    check_param_grad(p, g, name, f"the gradient of {name}")
            work.append((group, mats, grads, vecs, small, steps, adamw_state))
        for group, mats, grads, vecs, small, steps, adamw_state in work:
            lr = group["lr"]
            if mats:
                steps[0].add_(1)
                kw = dict(lr=lr, lr_scale=group["lr_scale"], weight_decay=group["weight_decay"], eps=group["eps"],
                          sinkhorn_iters=group["sinkhorn_iters"], spectral_norm=group["spectral_norm"],
                          spectral_target=group["spectral_target"], spectral_iters=group["spectral_iters"],
                          base_width=group["base_width"], width_exponent=group["width_exponent"],
                          stochastic_round=group["stochastic_round"], step=steps[0])
                dt = [is_dtensor(p) for p in mats]
                if any(dt):  # sharded matrices (FSDP2, DTensor): optim/sharded.py, a few small all-reduces
                    salts = sharded.update_salts(mats, grads)  # the seeds' salts the whole group would get
                    sel = [k for k, d in enumerate(dt) if d]
                    sharded.sinkgd_step_sharded(
                        [mats[k] for k in sel], [grads[k] for k in sel],
                        spectral_vecs=[vecs[k] for k in sel] if vecs else None, salts=[salts[k] for k in sel],
                        **kw)
                    keep = [k for k, d in enumerate(dt) if not d]
                    mats, grads = [mats[k] for k in keep], [grads[k] for k in keep]
                    vecs = [vecs[k] for k in keep] if vecs else vecs
                if mats:
                    # eager: with the optimizer's cache, the op's implementation called directly;
                    # compiled: the op, traced as one node
                    cache = None if torch.compiler.is_compiling() else self.plan_cache
                    sinkgd_step(mats, grads, spectral_vecs=vecs, cache=cache, **kw)
            if small:
                if any(is_dtensor(p) for p in small):
                    # DTensors run eagerly under torch.compile (uneven shards trip traced AdamW)
                    _eager(self._fallback_step)(group, small, adamw_state, lr)
                else:
                    self._fallback_step(group, small, adamw_state, lr)
        return loss


HEAD_NAMES = ("lm_head",)  # conventional output-head module names, used without get_output_embeddings


def _head_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's input and output embeddings, found by module identity (see
    sinkgd_param_groups)."""
    embeddings = [mod for mod in model.modules() if isinstance(mod, torch.nn.Embedding)]
    heads = list(embeddings)
    getter = getattr(model, "get_output_embeddings", None)
    out = getter() if callable(getter) else None
    if isinstance(out, torch.nn.Module):
        heads.append(out)
    else:
        heads += [mod for name, mod in model.named_modules() if name.rsplit(".", 1)[-1] in HEAD_NAMES]
    emb_weights = {id(mod.weight) for mod in embeddings}
    heads += [mod for mod in model.modules()
              if isinstance(mod, torch.nn.Linear) and id(mod.weight) in emb_weights]  # a tied head
    return heads


def sinkgd_param_groups(model: torch.nn.Module, **fallback_group):
    """Two param groups for SinkGD, as in the paper's setup: the matrices of the model's hidden
    layers (SinkGD), and everything else (AdamW, through ``use_fallback=True``). Extra keyword
    arguments go into the AdamW group and set its AdamW (``lr``, ``weight_decay``, ``eps``,
    ``betas``, checked here: another keyword raises ValueError; e.g. ``lr=3e-4, weight_decay=0.1``).

    AdamW gets every parameter with ndim < 2 and every parameter of the model's embeddings and
    output head, found by module identity, never by a substring of a parameter's name:

    - every ``nn.Embedding`` module of the model;
    - the output head: ``model.get_output_embeddings()`` where the model has it and it returns
      a module (transformers models); otherwise any submodule named exactly ``lm_head``;
    - any ``nn.Linear`` whose weight is an embedding's weight (a tied output head);
    - any parameter tied to one of those (the same tensor object), under whatever name.

    So ``attention.output.dense.weight`` of a BERT layer stays with SinkGD. A tied weight
    appears once, in the AdamW group.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    bad = sorted(set(fallback_group) - set(ADAMW_GROUP_KEYS))
    if bad:
        raise ValueError(f"sinkgd_param_groups: the AdamW group takes {', '.join(ADAMW_GROUP_KEYS)}; "
                         f"got {', '.join(bad)}")
    _check_adamw_settings(fallback_group, "sinkgd_param_groups")
    head = {id(p) for mod in _head_modules(model) for p in mod.parameters()}
    sink, rest = [], []
    for p in model.parameters():  # each tensor once: a tied weight is one object
        (rest if p.dim() < 2 or id(p) in head else sink).append(p)
    groups = [{"params": sink}]
    if rest:
        groups.append(dict(params=rest, use_fallback=True, **fallback_group))
    return groups
