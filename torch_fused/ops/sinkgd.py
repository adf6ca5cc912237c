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
"""

from __future__ import annotations

import collections
import functools
import math
import threading

import torch

from .._library import NAMESPACE, TRITON_DEVICES, acc_dtype, cdiv, n_sm
from ..settings import current as settings
from .. import reference
from ..meta import sinkgd as meta


def _as3d(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 3:  # as given (a rank's shard may have no rows: -1 below could not be inferred)
        return t
    m, n = t.shape[-2], t.shape[-1]
    return t.reshape(-1, m, n)


def _lr_factor(n, lr_scale, base_width, width_exponent) -> float:
    """eta / lr = lr_scale * (base_width / n) ** width_exponent (the last factor only if set)."""
    return lr_scale * ((base_width / n) ** width_exponent if base_width is not None else 1.0)


def _spectral_target(spectral_target, m, n) -> float:
    return 1.0 if spectral_target == "unit" else math.sqrt(m / n)


def _coefs(lr, n, lr_scale, weight_decay, base_width, width_exponent, spectral_scale, dtype=torch.float32):
    """eta = lr * _lr_factor(...); returns (eta * s [B], eta * wd) as device tensors of dtype
    (float32; float64 for a float64 step): no host sync, and a tensor lr that changes never
    recompiles."""
    eta = lr.to(dtype) * _lr_factor(n, lr_scale, base_width, width_exponent)
    return eta * spectral_scale.to(dtype), (eta * weight_decay).reshape(1)


class _Plan:
    """What a step of one matrix group needs beyond the tensors themselves: the work tables on
    the device (one (meta, first) pair per launch), the grid sizes and buffer lengths, and the
    per-matrix lr factors. It depends only on the matrices' addresses, shapes and dtypes, the
    lr-shape hyperparameters and the kernels' tile settings (module constants of
    kernels/sinkgd.py), so a SinkGDCache reuses it while the first two stay the same (the
    parameters never move; the caching allocator hands a re-created gradient the same address
    in a steady training loop). A step then does no host-to-device copy and no Python work per
    matrix beyond its key. Code that changes the tile constants (a sweep) uses a fresh cache.

    Launches: ``fused`` [(rows_config, align, even, launch)] one per (row width bucket,
    alignment, rows exactly BLOCK_N long or not) for matrices with n <= MAX_FUSED_N; ``wide``
    (align, (row sums, row scale, column sums)) for the rest, or None; ``cscale`` over every
    matrix; ``update`` [(align, launch)]. A launch is (meta, first, n_mats, grid); align is the
    kernels' ALIGN (kernels/sinkgd.py): 16 bytes of the narrower dtype where n is a multiple of
    it and G and W are 16-byte aligned, else 1.

    ``shard`` (optim/sharded.py: the local rows of sharded matrices): per matrix a dict of the
    meta columns ``SHARD_FIELDS`` of kernels/sinkgd.py (MG, EOFF, SALT, S_OFF, SU_OFF) that
    place the local block in the whole matrix and its finished sums in the step's sums buffer. Without it every matrix
    is whole: MG = m, EOFF = 0, SALT its index among the list's matrices of its load class, in
    list order (the update launches list them in the row passes' order)."""

    def __init__(self, ps, gs, lr_scale, base_width, width_exponent, vecs=(), shard=None):
        from ..kernels import sinkgd as K

        dev = ps[0].device
        rbm, rbn, _ = K.ROW_TILE
        cbm, cbn, _ = K.COL_TILE
        ubm, ubn, _ = K.UPD_TILE
        sb = K.SCALE_BLOCK
        rows, shapes, buckets, wide, upd, salts = [], [], {}, [], {}, {}
        r_off = c_off = pr_off = pc_off = coef_off = u_off = wq_off = 0
        factors_b, self.spans = [], []
        self.graphs: dict = {}  # CUDA graphs of this plan's launches, per scalars (_triton_group)
        self.graph_seen: dict = {}
        vec = 16 // min(ps[0].element_size(), gs[0].element_size())
        v_ptrs = [v.data_ptr() for v in vecs] if vecs else [0] * len(ps)
        # the one-read row pass's launches: one per (row tile, alignment); each launch's rows per
        # program (BM) shrink until it has programs for every SM (K.rows_bm)
        key_of, bucket_rows, bucket_m = [], {}, {}
        for p, g in zip(ps, gs):
            b, m, n = _as3d(p).shape
            align = vec if n % vec == 0 and p.data_ptr() % 16 == 0 and g.data_ptr() % 16 == 0 else 1
            if v_ptrs[len(key_of)] % 16:
                align = 1  # the power pass loads v with the same vector width
            key = (K.rows_config(n), align) if n <= K.MAX_FUSED_N else None
            if key is not None and n != key[0][0]:
                key = key + ("uneven",)  # EVEN_N launches: rows exactly BLOCK_N long
            key_of.append((key, align))
            if key is not None:
                bucket_rows[key] = bucket_rows.get(key, 0) + b * m
                bucket_m[key] = max(bucket_m.get(key, 0), m)
        sms = n_sm(dev)
        cfgs = {key: key[0][:2] + (K.rows_bm(rows_, key[0][1], sms, bucket_m[key]),) + key[0][3:]
                for key, rows_ in bucket_rows.items()}
        for i, (p, g) in enumerate(zip(ps, gs)):
            b, m, n = _as3d(p).shape
            key, align = key_of[i]
            salt = salts[align] = salts.get(align, -1) + 1  # the matrix's index in its class, in list order
            place = dict(MG=m, EOFF=0, SALT=salt, S_OFF=0, SU_OFF=0) if shard is None else shard[i]
            if key is not None:
                cfg = cfgs[key]
                buckets.setdefault((cfg, align, len(key) == 2), []).append(i)
                n_pr, n_pc = 0, cdiv(m, cfg[2])
            else:
                wide.append((i, align))
                n_pr, n_pc = cdiv(n, rbn), cdiv(m, cbm)
            rows.append(K.meta_row(G_PTR=g.data_ptr(), W_PTR=p.data_ptr(), M=m, N=n, R_OFF=r_off, C_OFF=c_off,
                                   PR_OFF=pr_off, PC_OFF=pc_off, COEF_OFF=coef_off, N_PC=n_pc, V_PTR=v_ptrs[i],
                                   U_OFF=u_off, WQ_OFF=wq_off, **place))
            shapes.append((b, m, n))
            self.spans.append((r_off, c_off, b, m, n))
            f = _lr_factor(n, lr_scale, base_width, width_exponent)
            factors_b += [f] * b
            r_off += b * m
            c_off += cdiv(b * n, 4) * 4  # c and column partials start 16-byte aligned
            pr_off += b * n_pr * m
            pc_off += cdiv(b * n_pc * n, 4) * 4
            coef_off += b
            u_off += b * n_pc
            wq_off += b * cdiv(n, sb)
        packed: list[int] = []

        def launch(idx, programs):
            """Append the meta rows and program starts of one launch over matrices idx."""
            first = [0]
            for i in idx:
                first.append(first[-1] + programs(*shapes[i]))
            at = len(packed)
            for i in idx:
                packed.extend(rows[i])
            packed.extend(first)
            return (at, len(idx), first[-1])

        specs = {"fused": [(cfg, align, even, launch(idx, lambda b, m, n, bm=cfg[2]: b * cdiv(m, bm)))
                           for (cfg, align, even), idx in buckets.items()]}
        if wide:
            idx = [i for i, _ in wide]
            specs["wide"] = (min(a for _, a in wide),
                             (launch(idx, lambda b, m, n: b * cdiv(m, rbm) * cdiv(n, rbn)),
                              launch(idx, lambda b, m, n: b * cdiv(m, sb)),
                              launch(idx, lambda b, m, n: b * cdiv(m, cbm) * cdiv(n, cbn))))
            # power pass AXIS=0 uses the row sums' launch, AXIS=1 the column sums'
        specs["cscale"] = launch(range(len(ps)), lambda b, m, n: b * cdiv(n, sb))
        # the update walks the matrices in the row passes' order
        for i in [i for idx in buckets.values() for i in idx] + [i for i, _ in wide]:
            upd.setdefault(key_of[i][1], []).append(i)
        specs["update"] = [(align, launch(idx, lambda b, m, n: b * cdiv(m, ubm) * cdiv(n, ubn)))
                           for align, idx in upd.items()]
        table = _device_tensor(packed, torch.int64, dev)
        cols = int(K.META_COLS)

        def views(spec):
            at, n_mats, grid = spec
            end = at + n_mats * cols
            return table[at:end], table[end:end + n_mats + 1], n_mats, grid

        self.fused = [(cfg, align, even, views(sp)) for cfg, align, even, sp in specs["fused"]]
        self.wide = (specs["wide"][0], tuple(views(sp) for sp in specs["wide"][1])) if wide else None
        self.cscale = views(specs["cscale"])
        self.update = [(align, views(sp)) for align, sp in specs["update"]]
        self.lens = (r_off, c_off, pr_off, pc_off, u_off, wq_off)
        self.n_coef = coef_off
        # lr factors: one per batch entry (coef_x and coef_w); never empty (a placeholder pointer
        # of the kernels' too)
        self.fac = _device_tensor(factors_b or [0.0], torch.float32, dev)


def _tile_settings() -> tuple:
    """The kernels' tile constants a plan is built from (kernels/sinkgd.py): part of every plan
    key, so that code changing them (a sweep, the interpreter run) never meets a stale plan."""
    from ..kernels import sinkgd as K

    return (K.MAX_FUSED_N, K.ROW_TILE, K.COL_TILE, K.UPD_TILE, K.SCALE_BLOCK, K.ROWS_ELEMS, K.ROWS_MAX_WARPS,
            K.ROWS_BM, K.ROWS_MIN_PROGRAMS, K.ROWS_MAX_PARTIALS, K.ROWS_RB, K.ROWS_PIPE, K.ROWS_PIPE_BYTES, K.SCALE_PARTS)


def _plan_key(ps, gs, lr_scale, base_width, width_exponent, vecs=(), shard=None) -> tuple:
    shard = None if shard is None else tuple(tuple(sorted(cols.items())) for cols in shard)  # hashable
    return (lr_scale, base_width, width_exponent, _tile_settings(), tuple(v.data_ptr() for v in vecs), shard,
            tuple((p.data_ptr(), g.data_ptr(), p.shape, p.dtype, g.dtype, p.device) for p, g in zip(ps, gs)))


def _call_key(params, grads, vecs, lr_scale, base_width, width_exponent):
    """What makes two calls of _step the same for its checks, grouping and plans: every
    tensor's address, shape, dtype, device and contiguity, the lr-shape settings and the tile
    constants. None where a tensor has no storage (a sparse one: the full checks name it)."""
    try:
        return (tuple([(p.data_ptr(), g.data_ptr(), p.shape, g.shape, p.dtype, g.dtype, p.device, g.device,
                        g.is_contiguous(), p.is_contiguous()) for p, g in zip(params, grads)]),
                tuple([(v.data_ptr(), v.shape, v.dtype, v.device, v.is_contiguous()) for v in vecs]),
                len(params), len(grads), len(vecs), lr_scale, base_width, width_exponent, _tile_settings())
    except RuntimeError:
        return None


class _HostStaging:
    """Pinned host memory for the work tables of plans built while a CUDA graph is captured.
    The capture records each table's copy as a memcpy node that reads this memory again at
    every replay, so a table's slice is written once and never reused or freed (the arenas live
    as long as the process; a table captured again reuses its slice). Arenas are allocated
    outside captures (``reserve``, called whenever a plan is built outside one), so that a
    capture normally allocates no pinned memory."""

    ARENA_BYTES = 1 << 20

    def __init__(self):
        self.arenas: list[torch.Tensor] = []  # uint8, pinned
        self.used = 0  # bytes used of the last arena
        self.slices: dict = {}

    def reserve(self) -> None:
        if not self.arenas or self.used > self.ARENA_BYTES // 2:
            self.arenas.append(torch.empty(self.ARENA_BYTES, dtype=torch.uint8, pin_memory=True))
            self.used = 0

    def table(self, host: torch.Tensor) -> torch.Tensor:
        key = (host.dtype, tuple(host.tolist()))
        out = self.slices.get(key)
        if out is None:
            nbytes = host.numel() * host.element_size()
            start = -(-self.used // 16) * 16
            if not self.arenas or start + nbytes > self.arenas[-1].numel():
                self.arenas.append(torch.empty(max(self.ARENA_BYTES, nbytes), dtype=torch.uint8, pin_memory=True))
                start = 0
            out = self.arenas[-1][start:start + nbytes].view(host.dtype)
            out.copy_(host)
            self.used = start + nbytes
            self.slices[key] = out
        return out


_STAGING = _HostStaging()


def _device_tensor(values, dtype, dev) -> torch.Tensor:
    """A device tensor of host values (a plan's work table or lr factors).

    - Under CUDA-graph capture (torch.compile's mode="reduce-overhead", or a user's capture):
      copied without a host sync from pinned memory that stays allocated (_HostStaging); the
      device tensor belongs to the call (the capture's pool) and is never cached.
    - otherwise, on CUDA (a plan a cache keeps): allocated and filled by a helper thread.
      torch.compile's CUDA-graph warm-up runs the step with every allocation of the calling
      thread routed into the graphs' memory pool, and a tensor kept from there breaks its
      checks; another thread's allocations go to the ordinary pool. The tensor is then marked
      as used by the calling thread's current stream."""
    host = torch.tensor(values, dtype=dtype)
    if dev.type != "cuda":
        return host.to(dev)
    if torch.cuda.is_current_stream_capturing():
        out = torch.empty(len(values), dtype=dtype, device=dev)
        out.copy_(_STAGING.table(host), non_blocking=True)
        return out
    _STAGING.reserve()
    made: list = []

    def copy():
        try:
            with torch.cuda.device(dev):
                made.append(host.to(dev))  # a synchronous copy: done when it returns
        except BaseException as e:  # raised again in the calling thread
            made.append(e)

    worker = threading.Thread(target=copy)
    worker.start()
    worker.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    out = made[0]
    out.record_stream(torch.cuda.current_stream(dev))
    return out


class SinkGDCache:
    """What repeated SinkGD steps over the same tensors reuse: the plans of the matrix groups
    seen (the ``max_plans`` most recently used) and, with ``cuda_graphs``, each plan's CUDA
    graphs (see _triton_group). ``torch_fused.optim.SinkGD`` owns one; ``sinkgd_step_eager``
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
        # _step); dropped whenever a plan is evicted, so every plan here is one of self.plans
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


# The op's own plans (calls without a SinkGDCache: torch.compile'd steps, the keyword function
# without ``cache``), reused while the same tensors come back; never CUDA graphs of its own (a
# compiled step may run inside torch.compile's). Plans hold only addresses, shapes and lr
# factors: a plan found under a key is valid for any tensors with that key.
_OP_CACHE = SinkGDCache(max_plans=16, cuda_graphs=False)

# Replay a step's launches from a CUDA graph once the same plan and scalars come back
# (GRAPH_AFTER calls): the step's device work is unchanged, its host work drops from ~17 Triton
# launches to one replay. The sinkgd_graphs setting (TORCH_FUSED_SINKGD_GRAPHS=0) turns it off.

GRAPH_AFTER = 2
_MAX_GRAPHS = 4  # graphs per plan (per distinct scalars and lr / seed tensors)
_MAX_SEEN = 64  # keys counted per plan before the counts start over


def _triton_group(ps, gs, vecs, lr, lr_scale, weight_decay, eps, iters, spectral_norm, spectral_target,
                  spectral_iters, base_width, width_exponent, stochastic, seed, cache=None):
    """One SinkGD step for matrices sharing a (param dtype, grad dtype) pair: per iteration one
    row pass per row-width bucket and one column scale launch (plus three launches for rows
    wider than MAX_FUSED_N), then, with the spectral step, per power iteration one power pass
    per bucket and two small launches (plus two for wide rows), then the update, whatever the
    number of matrices.

    The plan comes from ``cache`` (a SinkGDCache), else from the op's own _OP_CACHE. With a
    cache whose ``cuda_graphs`` is set (the eager optimizer step; never the op, which may run
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
    plan = (cache if cache is not None else _OP_CACHE).plan(ps, gs, lr_scale, base_width, width_exponent, held)
    _run_group(plan, ps, gs, vecs, held, lr, weight_decay, eps, iters, spectral_norm, spectral_target,
               spectral_iters, stochastic, seed, cache)
    return plan


def _run_group(plan, ps, gs, vecs, held, lr, weight_decay, eps, iters, spectral_norm, spectral_target,
               spectral_iters, stochastic, seed, cache):
    """_triton_group's launches (or graph replay) with its plan found; ``held``: the spectral
    vectors as the kernels update them (contiguous), ``vecs`` the caller's."""
    args = (ps, gs, held, lr, weight_decay, eps, iters, spectral_norm, spectral_target, spectral_iters,
            stochastic, seed)
    dev = ps[0].device
    if not (cache is not None and cache.cuda_graphs and settings.sinkgd_graphs and dev.type == "cuda"
            and all(h is v for h, v in zip(held, vecs)) and not torch.cuda.is_current_stream_capturing()):
        _launch_group(plan, *args)
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
            _launch_group(plan, *args)  # also compiles the kernels before any capture
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(dev):
            with torch.cuda.graph(graph):
                _launch_group(plan, *args)
        plan.graphs[key] = graph
    with torch.cuda.device(dev):
        graph.replay()


# A pass's launches over different row-width buckets (and the wide path) touch different
# matrices: under a CUDA graph capture they become parallel branches of the graph (the first
# on the capturing stream, the rest on a side stream, forked and joined by events), so that one
# launch's tail of programs overlaps the next launch instead of leaving SMs idle.
# The sinkgd_branches setting (TORCH_FUSED_SINKGD_BRANCHES=0) keeps them in one stream.

_SIDE_STREAMS: dict = {}


def _branches(fns, dev) -> None:
    """Calls the launch closures ``fns``: as parallel graph branches while a CUDA graph is being
    captured (the sinkgd_branches setting), else one after another on the current stream."""
    if len(fns) < 2 or not settings.sinkgd_branches or dev.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        for fn in fns:
            fn()
        return
    cur = torch.cuda.current_stream(dev)
    side = _SIDE_STREAMS.get(dev)
    if side is None:
        side = _SIDE_STREAMS[dev] = torch.cuda.Stream(dev)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for fn in fns[1:]:
            fn()
    fns[0]()
    cur.wait_stream(side)


class _Buffers:
    """A step's scale vectors and partials for one plan (fp32, made per call: under a capture
    they belong to the graph's pool and nothing keeps them)."""

    def __init__(self, plan, iters, spectral_norm, dev):
        r_len, c_len, pr_len, pc_len, u_len, wq_len = plan.lens
        self.r = torch.empty(r_len, dtype=torch.float32, device=dev)
        self.c = torch.empty(c_len, dtype=torch.float32, device=dev)
        self.part_r = torch.empty(max(pr_len, 1), dtype=torch.float32, device=dev)
        self.part_c = torch.empty(pc_len, dtype=torch.float32, device=dev)
        if iters == 0:
            self.r.fill_(1.0)
            self.c.fill_(1.0)
        self.spec = plan.fac  # a placeholder pointer unless the spectral scale is on
        if spectral_norm:
            self.part_u = torch.empty(max(u_len, 1), dtype=torch.float32, device=dev)
            self.part_w = torch.empty(max(wq_len, 1), dtype=torch.float32, device=dev)
            self.spec = torch.empty(plan.n_coef, dtype=torch.float32, device=dev)


def _row_stage(plan, bufs, gdt, eps, first):
    """One Sinkhorn iteration's passes over G: r finished, the column partials written."""
    from ..kernels import sinkgd as K

    r, c, part_r, part_c = bufs.r, bufs.c, bufs.part_r, bufs.part_c
    fns = [functools.partial(K._sinkgd_rows_kernel[(grid,)], t_meta, t_first, n_mats, gdt, r, c, part_c, eps,
                             ONES_R=first, ONES_C=first, BLOCK_N=block_n, RB=rb, BM=bm, ALIGN=align, EVEN_N=even,
                             PIPE=K.rows_pipe(block_n, rb, gdt.element_size()), num_warps=warps)
           for (block_n, rb, bm, warps), align, even, (t_meta, t_first, n_mats, grid) in plan.fused]
    if plan.wide is not None:
        fns.append(functools.partial(_wide_rows, plan, r, c, part_r, part_c, gdt, eps, first))
    _branches(fns, r.device)


def _wide_rows(plan, r, c, part_r, part_c, gdt, eps, first):
    """The two-pass path's launches of one Sinkhorn iteration (rows wider than MAX_FUSED_N)."""
    from ..kernels import sinkgd as K

    rbm, rbn, rw = K.ROW_TILE
    cbm, cbn, cw = K.COL_TILE
    align, ((m_s, f_s, n_s, g_s), (m_r, f_r, n_r, g_r), (m_c, f_c, n_c, g_c)) = plan.wide
    K._sinkgd_sums_kernel[(g_s,)](m_s, f_s, n_s, gdt, r, c, part_r, AXIS=0, BM=rbm, BN=rbn,
                                  ONES_R=first, ONES_C=first, ALIGN=align, num_warps=rw)
    K._sinkgd_scale_kernel[(g_r,)](m_r, f_r, n_r, r, part_r, eps, AXIS=0, PART_TILE=rbn, BLOCK=K.SCALE_BLOCK,
                                   PARTS=K.SCALE_PARTS, ONES=first, SUMMED=False)
    K._sinkgd_sums_kernel[(g_c,)](m_c, f_c, n_c, gdt, r, c, part_c, AXIS=1, BM=cbm, BN=cbn,
                                  ONES_R=False, ONES_C=first, ALIGN=align, num_warps=cw)


def _col_stage(plan, bufs, eps, first, sums=None):
    """The column scale c from the column partials, or (``sums``) from the finished sums."""
    from ..kernels import sinkgd as K

    t_meta, t_first, n_mats, grid = plan.cscale
    K._sinkgd_scale_kernel[(grid,)](t_meta, t_first, n_mats, bufs.c, bufs.part_c if sums is None else sums, eps,
                                    AXIS=1, PART_TILE=K.COL_TILE[0], BLOCK=K.SCALE_BLOCK, PARTS=K.SCALE_PARTS,
                                    ONES=first, SUMMED=sums is not None)


def _colsum_stage(plan, bufs, sums, with_u):
    """Sharded rows: the local column (and |u|^2) sums into the sums buffer, for the all-reduce."""
    from ..kernels import sinkgd as K

    t_meta, t_first, n_mats, grid = plan.cscale
    K._sinkgd_colsum_kernel[(grid,)](t_meta, t_first, n_mats, bufs.part_c, bufs.part_u if with_u else bufs.part_c,
                                     sums, WITH_U=with_u, BLOCK=K.SCALE_BLOCK, PARTS=K.SCALE_PARTS)


def _power_stage(plan, bufs, gdt):
    """One power iteration's pass over G: the column partials of X^T u and the |u|^2 partials."""
    from ..kernels import sinkgd as K

    r, c, part_r, part_c, part_u = bufs.r, bufs.c, bufs.part_r, bufs.part_c, bufs.part_u
    fns = [functools.partial(K._sinkgd_power_rows_kernel[(grid,)], t_meta, t_first, n_mats, gdt, r, c, part_c,
                             part_u, BLOCK_N=block_n, RB=rb, BM=bm, ALIGN=align, EVEN_N=even,
                             PIPE=K.rows_pipe(block_n, rb, gdt.element_size()), num_warps=warps)
           for (block_n, rb, bm, warps), align, even, (t_meta, t_first, n_mats, grid) in plan.fused]
    if plan.wide is not None:
        fns.append(functools.partial(_wide_power, plan, r, c, part_r, part_c, part_u, gdt))
    _branches(fns, r.device)


def _wide_power(plan, r, c, part_r, part_c, part_u, gdt):
    """The power pass's two launches for rows wider than MAX_FUSED_N."""
    from ..kernels import sinkgd as K

    rbm, rbn, rw = K.ROW_TILE
    cbm, cbn, cw = K.COL_TILE
    align, ((m_s, f_s, n_s, g_s), _, (m_c, f_c, n_c, g_c)) = plan.wide
    K._sinkgd_power_tiles_kernel[(g_s,)](m_s, f_s, n_s, gdt, r, c, part_r, part_c, part_u, AXIS=0,
                                         BM=rbm, BN=rbn, PART_TILE=rbn, ALIGN=align, num_warps=rw)
    K._sinkgd_power_tiles_kernel[(g_c,)](m_c, f_c, n_c, gdt, r, c, part_r, part_c, part_u, AXIS=1,
                                         BM=cbm, BN=cbn, PART_TILE=rbn, ALIGN=align, num_warps=cw)


def _power_finish(plan, bufs, eps, spectral_target, sums=None):
    """w = X^T u / |u| into v, then v = w / |w| and the spectral scale, from the partials or
    (``sums``) the finished sums."""
    from ..kernels import sinkgd as K

    t_meta, t_first, n_mats, grid = plan.cscale
    part, upart = (bufs.part_c, bufs.part_u) if sums is None else (sums, sums)
    K._sinkgd_power_cols_kernel[(grid,)](t_meta, t_first, n_mats, bufs.c, part, upart, bufs.part_w, eps,
                                         BLOCK=K.SCALE_BLOCK, PARTS=K.SCALE_PARTS, SUMMED=sums is not None)
    K._sinkgd_power_norm_kernel[(grid,)](t_meta, t_first, n_mats, bufs.part_w, bufs.spec, eps,
                                         MUON=spectral_target == "muon", BLOCK=K.SCALE_BLOCK, PARTS=K.SCALE_PARTS)


def _update_stage(plan, bufs, gdt, wdt, lr_d, seed_d, weight_decay, stochastic, spectral_norm):
    from ..kernels import sinkgd as K

    ubm, ubn, uw = K.UPD_TILE
    for align, (t_meta, t_first, n_mats, grid) in plan.update:
        K._sinkgd_update_kernel[(grid,)](t_meta, t_first, n_mats, gdt, wdt, bufs.r, bufs.c, lr_d, plan.fac,
                                         bufs.spec, float(weight_decay), seed_d, STOCHASTIC=stochastic,
                                         HAS_SPEC=spectral_norm, BM=ubm, BN=ubn, ALIGN=align,
                                         num_warps=uw)


def _run_step(work, eps, iters, spectral_norm, spectral_target, spectral_iters, lr_d, seed_d, weight_decay,
              reduce=None, sums=None):
    """The stages of one step over ``work`` [(plan, buffers, grad dtype carrier, param dtype
    carrier, stochastic)]: per Sinkhorn iteration the row passes, then the column scales; per
    power iteration the power passes, then w, v and the spectral scale; then the updates. With
    ``reduce`` (sharded rows), each pass is followed by the column (and |u|^2) sums into
    ``sums`` and ``reduce(sums, spectral=...)``, and the scales read the sums."""
    for it in range(iters):
        first = it == 0  # r and c are still all ones: the kernels neither read nor need them
        for plan, bufs, gdt, _, _ in work:
            _row_stage(plan, bufs, gdt, eps, first)
            if reduce is not None:
                _colsum_stage(plan, bufs, sums, with_u=False)
        if reduce is not None:
            reduce(sums, spectral=False)
        for plan, bufs, _, _, _ in work:
            _col_stage(plan, bufs, eps, first, sums)
    if spectral_norm:
        # power iteration on X = diag(r) G diag(c), never formed: per iteration one pass over G
        # (u = X v and the column partials of X^T u), then w = X^T u / |u| into v, then
        # v = w / |w| and the scale target / |w| (docs/SINKGD.md)
        for _ in range(spectral_iters):
            for plan, bufs, gdt, _, _ in work:
                _power_stage(plan, bufs, gdt)
                if reduce is not None:
                    _colsum_stage(plan, bufs, sums, with_u=True)
            if reduce is not None:
                reduce(sums, spectral=True)
            for plan, bufs, _, _, _ in work:
                _power_finish(plan, bufs, eps, spectral_target, sums)
    for plan, bufs, gdt, wdt, stochastic in work:
        _update_stage(plan, bufs, gdt, wdt, lr_d, seed_d, weight_decay, stochastic, spectral_norm)


def _launch_group(plan, ps, gs, vecs, lr, weight_decay, eps, iters, spectral_norm, spectral_target,
                  spectral_iters, stochastic, seed):
    """The launches of one step of a matrix group (see _triton_group). Every buffer is made
    here, per call: under a capture they belong to the graph's pool and nothing keeps them."""
    dev = ps[0].device
    # gs[0], ps[0]: dtype carriers (the addresses come from the tables)
    work = [(plan, _Buffers(plan, iters, spectral_norm, dev), gs[0], ps[0], stochastic)]
    _run_step(work, eps, iters, spectral_norm, spectral_target, spectral_iters, lr.to(dev, torch.float32),
              seed.to(dev), weight_decay)


def launch_sharded(groups, sums_len, reduce, *, lr, lr_scale, weight_decay, eps, iters, spectral_norm,
                   spectral_target, spectral_iters, base_width, width_exponent, seed, cache):
    """One SinkGD step of the local blocks of sharded matrices (optim/sharded.py) through the
    kernels. ``groups``: [(params, grads, vecs, shard, stochastic)], one per (param dtype, grad
    dtype), of 3-D local views; ``shard`` the per-matrix meta columns (see _Plan) that place
    each block in its whole matrix and its finished sums in one fp32 buffer of ``sums_len``
    elements. Per Sinkhorn iteration: the row passes of every group, each rank's column sums
    into the buffer, ``reduce(sums, spectral=False)`` (the caller's all-reduces of the regions
    of row-sharded matrices), the column scales from the sums; per power iteration the same
    with the |u|^2 sums (``spectral=True``); then the updates. No CUDA graph: the collectives
    run between the launches. ``cache``: a SinkGDCache for the plans."""
    dev = groups[0][0][0].device
    work = []
    for ps, gs, vecs, shard, stochastic in groups:
        plan = cache.plan(ps, gs, lr_scale, base_width, width_exponent, vecs, shard)
        work.append((plan, _Buffers(plan, iters, spectral_norm, dev), gs[0], ps[0], stochastic))
    sums = torch.zeros(max(sums_len, 1), dtype=torch.float32, device=dev)
    _run_step(work, eps, iters, spectral_norm, spectral_target, spectral_iters, lr.to(dev, torch.float32),
              seed.to(dev), weight_decay, reduce, sums)


def _step(params, grads, spectral_vecs, lr, lr_scale, weight_decay, eps, sinkhorn_iters, spectral_norm,
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
                _run_group(plan, ps, [grads[i] for i in idx], vs, vs, lr, weight_decay, eps, sinkhorn_iters,
                           spectral_norm, spectral_target, spectral_iters,
                           bool(stochastic_round) and pdt == torch.bfloat16, seed, cache)
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
        plan = _triton_group([params[i] for i in idx], [grads[i] for i in idx],
                             [spectral_vecs[i] for i in idx] if spectral_norm else [], lr, lr_scale, weight_decay,
                             eps, sinkhorn_iters, spectral_norm, spectral_target, spectral_iters, base_width,
                             width_exponent, bool(stochastic_round) and pdt == torch.bfloat16, seed, cache)
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
    """The positional schema of one SinkGD step; ``torch_fused.optim.sinkgd_step`` is the keyword
    entry point and documents every argument (``seed`` is its ``step``). This body is the CPU
    (reference) implementation."""
    _step(params, grads, spectral_vecs, lr, lr_scale, weight_decay, eps, sinkhorn_iters, spectral_norm,
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
    _step(params, grads, spectral_vecs, lr, lr_scale, weight_decay, eps, sinkhorn_iters, spectral_norm,
          spectral_target, spectral_iters, base_width, width_exponent, stochastic_round, seed, use_triton,
          cache)


sinkgd_step.register_fake(meta.sinkgd_step_fake)
if TRITON_DEVICES:
    sinkgd_step.register_kernel(TRITON_DEVICES)(sinkgd_step_eager)
