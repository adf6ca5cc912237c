"""One matrix group's step: its plan's launches, or the replay of a CUDA graph of them once the
same plan and scalars come back."""

from __future__ import annotations

import torch

from ...settings import current as settings
from .launch import _group_launches


# Replay a step's launches from a CUDA graph once the same plan and scalars come back
# (GRAPH_AFTER calls): the step's device work is unchanged, its host work drops from ~17 Triton
# launches to one replay. The sinkgd_graphs setting (TORCH_FUSED_SINKGD_GRAPHS=0) turns it off.

GRAPH_AFTER = 2
_MAX_GRAPHS = 4  # graphs per plan (per distinct scalars and lr / seed tensors)
_MAX_SEEN = 64  # keys counted per plan before the counts start over


def _group_step(ps, gs, vecs, lr, lr_scale, weight_decay, eps, iters, spectral_norm, spectral_target,
                spectral_iters, base_width, width_exponent, stochastic, seed, cache=None):
    """One SinkGD step for matrices sharing a (param dtype, grad dtype) pair: per iteration one
    row pass per row-width bucket and one column scale launch (plus three launches for rows
    wider than max_fused_n), then, with the spectral step, per power iteration one power pass
    per bucket and two small launches (plus two for wide rows), then the update, whatever the
    number of matrices.

    The plan comes from ``cache`` (a SinkGDCache: the optimizer's, or the op's own _OP_CACHE).
    With a cache whose ``cuda_graphs`` is set (the eager optimizer step; never the op, which may run
    inside torch.compile's own CUDA graphs), on CUDA and outside another capture, the launches
    of a (plan, scalars, lr and seed tensors) seen GRAPH_AFTER times are captured into a CUDA
    graph kept on the plan, and later steps replay it. The graph reads the tensors at the
    addresses the plan was built for (the spectral vectors too: they are part of the plan's
    key), exactly like the plan's work tables, and lr and the seed at theirs (their values are
    read on the device at replay, so a changed lr takes effect); r, c and the partials live in
    the graph's memory pool for as long as the plan is cached (the step's extra memory, held
    instead of re-allocated)."""
    gs = [g if g.is_contiguous() else g.contiguous() for g in gs]
    held = [v if v.is_contiguous() else v.contiguous() for v in vecs]
    plan = cache.plan(ps, gs, lr_scale, base_width, width_exponent, held)
    _group_replay_or_launch(plan, ps, gs, vecs, held, lr, weight_decay, eps, iters, spectral_norm, spectral_target,
                            spectral_iters, stochastic, seed, cache)
    return plan


def _group_replay_or_launch(plan, ps, gs, vecs, held, lr, weight_decay, eps, iters, spectral_norm, spectral_target,
                            spectral_iters, stochastic, seed, cache):
    """_group_step's launches (or graph replay) with its plan found; ``held``: the spectral
    vectors as the kernels update them (contiguous), ``vecs`` the caller's."""
    args = (ps, gs, held, lr, weight_decay, eps, iters, spectral_norm, spectral_target, spectral_iters,
            stochastic, seed)
    dev = ps[0].device
    if not (cache is not None and cache.cuda_graphs and settings.sinkgd_graphs and dev.type == "cuda"
            and all(h is v for h, v in zip(held, vecs)) and not torch.cuda.is_current_stream_capturing()):
        _group_launches(plan, *args)
        for h, v in zip(held, vecs):
            if h is not v:  # a non-contiguous vector was updated in a contiguous copy
                v.copy_(h)
        return
    key = (iters, stochastic, float(weight_decay), float(eps), lr.data_ptr(), lr.dtype, lr.device,
           seed.data_ptr(), seed.dtype, seed.device, spectral_target, spectral_iters, spectral_norm)
    graph = plan.graphs.get(key)
    if graph is None:
        if len(plan.graph_seen) >= _MAX_SEEN:  # keys that never repeat (an lr re-made every step)
            plan.graph_seen.clear()
        seen = plan.graph_seen[key] = plan.graph_seen.get(key, 0) + 1
        if seen < GRAPH_AFTER or len(plan.graphs) >= _MAX_GRAPHS:
            _group_launches(plan, *args)  # also compiles the kernels before any capture
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(dev):
            with torch.cuda.graph(graph):
                _group_launches(plan, *args)
        plan.graphs[key] = graph
    with torch.cuda.device(dev):
        graph.replay()


