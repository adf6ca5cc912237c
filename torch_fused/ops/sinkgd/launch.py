"""The kernel launches of a SinkGD step: per Sinkhorn iteration the row and column passes, per
power iteration the spectral passes, then the update, over every group of a plan; a pass's
launches over different row-width classes as parallel CUDA-graph branches under capture."""

from __future__ import annotations

import functools

import torch

from ...settings import current as settings


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
    from ...kernels import sinkgd as K

    r, c, part_r, part_c = bufs.r, bufs.c, bufs.part_r, bufs.part_c
    fns = [functools.partial(K._sinkgd_rows_kernel[(grid,)], t_meta, t_first, n_mats, gdt, r, c, part_c, eps,
                             ONES_R=first, ONES_C=first, BLOCK_N=block_n, RB=rb, BM=bm, ALIGN=align, EVEN_N=even,
                             PIPE=K.rows_pipe(block_n, rb, gdt.element_size(), plan.tiles), num_warps=warps)
           for (block_n, rb, bm, warps), align, even, (t_meta, t_first, n_mats, grid) in plan.fused]
    if plan.wide is not None:
        fns.append(functools.partial(_wide_rows, plan, r, c, part_r, part_c, gdt, eps, first))
    _branches(fns, r.device)


def _wide_rows(plan, r, c, part_r, part_c, gdt, eps, first):
    """The two-pass path's launches of one Sinkhorn iteration (rows wider than max_fused_n)."""
    from ...kernels import sinkgd as K

    rbm, rbn, rw = plan.tiles.row_tile
    cbm, cbn, cw = plan.tiles.col_tile
    align, ((m_s, f_s, n_s, g_s), (m_r, f_r, n_r, g_r), (m_c, f_c, n_c, g_c)) = plan.wide
    K._sinkgd_sums_kernel[(g_s,)](m_s, f_s, n_s, gdt, r, c, part_r, AXIS=0, BM=rbm, BN=rbn,
                                  ONES_R=first, ONES_C=first, ALIGN=align, num_warps=rw)
    K._sinkgd_scale_kernel[(g_r,)](m_r, f_r, n_r, r, part_r, eps, AXIS=0, PART_TILE=rbn, BLOCK=plan.tiles.scale_block,
                                   PARTS=plan.tiles.scale_parts, ONES=first, SUMMED=False)
    K._sinkgd_sums_kernel[(g_c,)](m_c, f_c, n_c, gdt, r, c, part_c, AXIS=1, BM=cbm, BN=cbn,
                                  ONES_R=False, ONES_C=first, ALIGN=align, num_warps=cw)


def _col_stage(plan, bufs, eps, first, sums=None):
    """The column scale c from the column partials, or (``sums``) from the finished sums."""
    from ...kernels import sinkgd as K

    t_meta, t_first, n_mats, grid = plan.cscale
    K._sinkgd_scale_kernel[(grid,)](t_meta, t_first, n_mats, bufs.c, bufs.part_c if sums is None else sums, eps,
                                    AXIS=1, PART_TILE=plan.tiles.col_tile[0], BLOCK=plan.tiles.scale_block, PARTS=plan.tiles.scale_parts,
                                    ONES=first, SUMMED=sums is not None)


def _colsum_stage(plan, bufs, sums, with_u):
    """Sharded rows: the local column (and |u|^2) sums into the sums buffer, for the all-reduce."""
    from ...kernels import sinkgd as K

    t_meta, t_first, n_mats, grid = plan.cscale
    K._sinkgd_colsum_kernel[(grid,)](t_meta, t_first, n_mats, bufs.part_c, bufs.part_u if with_u else bufs.part_c,
                                     sums, WITH_U=with_u, BLOCK=plan.tiles.scale_block, PARTS=plan.tiles.scale_parts)


def _power_stage(plan, bufs, gdt):
    """One power iteration's pass over G: the column partials of X^T u and the |u|^2 partials."""
    from ...kernels import sinkgd as K

    r, c, part_r, part_c, part_u = bufs.r, bufs.c, bufs.part_r, bufs.part_c, bufs.part_u
    fns = [functools.partial(K._sinkgd_power_rows_kernel[(grid,)], t_meta, t_first, n_mats, gdt, r, c, part_c,
                             part_u, BLOCK_N=block_n, RB=rb, BM=bm, ALIGN=align, EVEN_N=even,
                             PIPE=K.rows_pipe(block_n, rb, gdt.element_size(), plan.tiles), num_warps=warps)
           for (block_n, rb, bm, warps), align, even, (t_meta, t_first, n_mats, grid) in plan.fused]
    if plan.wide is not None:
        fns.append(functools.partial(_wide_power, plan, r, c, part_r, part_c, part_u, gdt))
    _branches(fns, r.device)


def _wide_power(plan, r, c, part_r, part_c, part_u, gdt):
    """The power pass's two launches for rows wider than max_fused_n."""
    from ...kernels import sinkgd as K

    rbm, rbn, rw = plan.tiles.row_tile
    cbm, cbn, cw = plan.tiles.col_tile
    align, ((m_s, f_s, n_s, g_s), _, (m_c, f_c, n_c, g_c)) = plan.wide
    K._sinkgd_power_tiles_kernel[(g_s,)](m_s, f_s, n_s, gdt, r, c, part_r, part_c, part_u, AXIS=0,
                                         BM=rbm, BN=rbn, PART_TILE=rbn, ALIGN=align, num_warps=rw)
    K._sinkgd_power_tiles_kernel[(g_c,)](m_c, f_c, n_c, gdt, r, c, part_r, part_c, part_u, AXIS=1,
                                         BM=cbm, BN=cbn, PART_TILE=rbn, ALIGN=align, num_warps=cw)


def _power_finish(plan, bufs, eps, spectral_target, sums=None):
    """w = X^T u / |u| into v, then v = w / |w| and the spectral scale, from the partials or
    (``sums``) the finished sums."""
    from ...kernels import sinkgd as K

    t_meta, t_first, n_mats, grid = plan.cscale
    part, upart = (bufs.part_c, bufs.part_u) if sums is None else (sums, sums)
    K._sinkgd_power_cols_kernel[(grid,)](t_meta, t_first, n_mats, bufs.c, part, upart, bufs.part_w, eps,
                                         BLOCK=plan.tiles.scale_block, PARTS=plan.tiles.scale_parts, SUMMED=sums is not None)
    K._sinkgd_power_norm_kernel[(grid,)](t_meta, t_first, n_mats, bufs.part_w, bufs.spec, eps,
                                         MUON=spectral_target == "muon", BLOCK=plan.tiles.scale_block, PARTS=plan.tiles.scale_parts)


def _update_stage(plan, bufs, gdt, wdt, lr_d, seed_d, weight_decay, stochastic, spectral_norm):
    from ...kernels import sinkgd as K

    ubm, ubn, uw = plan.tiles.upd_tile
    for align, (t_meta, t_first, n_mats, grid) in plan.update:
        K._sinkgd_update_kernel[(grid,)](t_meta, t_first, n_mats, gdt, wdt, bufs.r, bufs.c, lr_d, plan.fac,
                                         bufs.spec, float(weight_decay), seed_d, STOCHASTIC=stochastic,
                                         HAS_SPEC=spectral_norm, BM=ubm, BN=ubn, ALIGN=align,
                                         num_warps=uw)


def _run_stages(work, eps, iters, spectral_norm, spectral_target, spectral_iters, lr_d, seed_d, weight_decay,
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


def _group_launches(plan, ps, gs, vecs, lr, weight_decay, eps, iters, spectral_norm, spectral_target,
                    spectral_iters, stochastic, seed):
    """The launches of one step of a matrix group (see _group_step). Every buffer is made
    here, per call: under a capture they belong to the graph's pool and nothing keeps them."""
    dev = ps[0].device
    # gs[0], ps[0]: dtype carriers (the addresses come from the tables)
    work = [(plan, _Buffers(plan, iters, spectral_norm, dev), gs[0], ps[0], stochastic)]
    _run_stages(work, eps, iters, spectral_norm, spectral_target, spectral_iters, lr.to(dev, torch.float32),
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
    _run_stages(work, eps, iters, spectral_norm, spectral_target, spectral_iters, lr.to(dev, torch.float32),
                seed.to(dev), weight_decay, reduce, sums)


