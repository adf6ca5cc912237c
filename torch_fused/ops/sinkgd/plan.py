"""The plan of a SinkGD step over one matrix group: the kernels' work tables (one meta row per
matrix, kernels/sinkgd.py), grid sizes, buffer lengths and lr factors, and the keys a cache
finds plans and checked calls under."""

from __future__ import annotations

import math

import torch

from ..._library import cdiv, n_sm
from .staging import _device_tensor


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
    alignment, rows exactly BLOCK_N long or not) for matrices with n <= max_fused_n; ``wide``
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
        from ...kernels import sinkgd as K

        dev = ps[0].device
        self.tiles = tiles = K.tiles()  # the launches read the plan's tiles
        rbm, rbn, _ = tiles.row_tile
        cbm, cbn, _ = tiles.col_tile
        ubm, ubn, _ = tiles.upd_tile
        sb = tiles.scale_block
        rows, shapes, buckets, wide, upd, salts = [], [], {}, [], {}, {}
        r_off = c_off = pr_off = pc_off = coef_off = u_off = wq_off = 0
        factors_b, self.spans = [], []
        self.graphs: dict = {}  # CUDA graphs of this plan's launches, per scalars (_group_step)
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
            key = (K.rows_config(n), align) if n <= tiles.max_fused_n else None
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


def _tile_settings():
    """The kernels' tiles a plan is built from (kernels/sinkgd.tiles(), a frozen dataclass): part
    of every plan key, so that a change of them (a sweep, the interpreter run) never meets a stale plan."""
    from ...kernels import sinkgd as K

    return K.tiles()


def _plan_key(ps, gs, lr_scale, base_width, width_exponent, vecs=(), shard=None) -> tuple:
    shard = None if shard is None else tuple(tuple(sorted(cols.items())) for cols in shard)  # hashable
    return (lr_scale, base_width, width_exponent, _tile_settings(), tuple(v.data_ptr() for v in vecs), shard,
            tuple((p.data_ptr(), g.data_ptr(), p.shape, p.dtype, g.dtype, p.device) for p, g in zip(ps, gs)))


def _call_key(params, grads, vecs, lr_scale, base_width, width_exponent):
    """What makes two calls of _step_impl the same for its checks, grouping and plans: every
    tensor's address, shape, dtype, device and contiguity, the lr-shape settings and the tile
    constants. None where a tensor has no storage (a sparse one: the full checks name it)."""
    try:
        return (tuple([(p.data_ptr(), g.data_ptr(), p.shape, g.shape, p.dtype, g.dtype, p.device, g.device,
                        g.is_contiguous(), p.is_contiguous()) for p, g in zip(params, grads)]),
                tuple([(v.data_ptr(), v.shape, v.dtype, v.device, v.is_contiguous()) for v in vecs]),
                len(params), len(grads), len(vecs), lr_scale, base_width, width_exponent, _tile_settings())
    except RuntimeError:
        return None


