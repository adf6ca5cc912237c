"""SinkGDCache: the plans (and CUDA graphs) repeated steps reuse."""

from __future__ import annotations

import collections

import torch

from .plan import _Plan, _plan_key


class SinkGDCache:
    """What repeated SinkGD steps over the same tensors reuse: the plans of the matrix groups
    seen (the ``max_plans`` most recently used) and, with ``cuda_graphs``, each plan's CUDA
    graphs (see _group_step). ``torch_fused.optim.SinkGD`` owns one; ``sinkgd_step_eager``
    and ``torch_fused.optim.sinkgd_step`` take one as ``cache``. Dropping the cache (or
    ``clear()``) frees the graphs and the memory they hold. A plan built while a CUDA graph is
    being captured is used for that call only, never kept (its tensors live in the capture's
    memory pool)."""

    def __init__(self, max_plans: int = 16, cuda_graphs: bool = True):
        self.plans: collections.OrderedDict = collections.OrderedDict()
        self.max_plans = max_plans
        self.cuda_graphs = cuda_graphs
        # plans a capture found here: a graph made elsewhere (torch.compile's) reads their
        # tables at every replay, so they are never evicted (clear() drops them)
        self.captured: dict = {}
        # calls already checked and grouped: _call_key -> [(param dtype, indices, plan)] (see
        # _step_impl); dropped whenever a plan is evicted, so every plan here is one of self.plans
        self.calls: dict = {}

    def plan(self, ps, gs, lr_scale, base_width, width_exponent, vecs=(), shard=None) -> _Plan:
        key = _plan_key(ps, gs, lr_scale, base_width, width_exponent, vecs, shard)
        capturing = ps[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        plan = self.plans.get(key) or self.captured.get(key)
        if plan is None:
            if capturing:  # its tables belong to the capture's memory pool: used once, not kept
                return _Plan(ps, gs, lr_scale, base_width, width_exponent, vecs, shard)
            plan = self.plans[key] = _Plan(ps, gs, lr_scale, base_width, width_exponent, vecs, shard)
            if len(self.plans) > self.max_plans:
                self.plans.popitem(last=False)
                self.calls.clear()
        elif capturing:
            self.captured[key] = plan
        elif key in self.plans:
            self.plans.move_to_end(key)
        return plan

    def graph_held_bytes(self) -> int:
        """Device memory the cached CUDA graphs hold between steps: each graph's r, c, partial
        and spectral buffers (fp32), allocated in its private pool at capture and reused by
        every replay."""
        total = 0
        for plan in self.plans.values():
            r_len, c_len, pr_len, pc_len, u_len, wq_len = plan.lens
            per = r_len + c_len + max(pr_len, 1) + pc_len
            spec = max(u_len, 1) + max(wq_len, 1) + plan.n_coef
            total += 4 * sum(per + (spec if key[-1] else 0) for key in plan.graphs)
        return total

    def clear(self) -> None:
        self.plans.clear()
        self.captured.clear()
        self.calls.clear()


