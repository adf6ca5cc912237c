"""Vocabulary-parallel (tensor-parallel) log-probs, entropy and fused lm_head on DTensors.

When tensor parallelism splits the lm_head, each rank holds a slice of the vocabulary: the logits
are a DTensor ``Shard(-1)`` (as ``ColwiseParallel(use_local_output=False)`` leaves them and as
``loss_parallel`` expects them), or the head's weight is a DTensor ``Shard(0)``. The public
functions of ``torch_fused`` send such inputs here (a cheap type check; this module, and with it
``torch.distributed.tensor``, is imported only when a DTensor arrives).

Forward. Each rank runs the single-device ops on its shard: the log-prob forward kernel over the
logits shard, or the fused head's vocabulary-chunk loop over its weight rows. The index is made
local (an id of another shard reads column 0, and that value is discarded). This gives per-row
partial statistics of the slice: the row max m_r, log2 s_r with s_r = sum 2^((x - m_r) c),
c = log2(e) / T, the slice's entropy H_r and the log-probs lp_r of the ids against the slice
alone. ONE all-gather of these [rows, 2 (+1 entropy) (+K ids)] partials (O(rows) elements; the
logits never move) gives every rank the world's partials. Every rank merges them in rank order
with the same O(rows) arithmetic, so all ranks hold identical results:

    M = max of m_r over the slices with s_r > 0,    a_r = log2 s_r + (m_r - M) c,
    log2 S = log2 sum_r 2^a_r,                      w_r = 2^(a_r - log2 S) (slice r's probability),
    H = sum_r w_r (H_r - (a_r - log2 S) ln 2)       (the entropy of a mixture of disjoint supports),
    logp_k = lp_{o,k} + (a_o - log2 S) ln 2         (o: the slice that holds index k).

Every term is a sum of non-negative parts (no cancellation). (M, log2 S) are the whole rows'
statistics in the kernels' convention, which makes the backward local: the log-prob backward
kernel with v_off = the slice's first id and v_total = V turns the shard into its own d logits
(G counts every id of the row, the scatter only the slice's own) with no collective. The fused
head's backward recomputes its slice's logits chunk by chunk (d weight stays sharded) and sums
the ranks' partial d hidden with ONE all-reduce (fp32, rounded once to the hidden dtype).

(m_r - M) c is formed as the kernels form their shifts: a difference of the rounded products
m c on the GPU (the sums are relative to round(m c)), exactly in the interpreter and the
reference.

The pieces that touch no process group (``logits_partials``, ``merge_partials``,
``logits_backward``, ``linear_partials``, ``linear_backward``) are also what
``torch_fused.bench.vocab_parallel`` times as one rank's local work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import reference
from ._library import TRITON_DEVICES, acc_dtype, check, kernel_temperature, traced_constants
from .meta import linear_logprobs as meta_ll
from .meta.linear_logprobs import HeadOptions
from .meta import logprobs as meta_lp
from .meta.logprobs import LogprobOptions, row_shape
from .ops import linear_logprobs as LL
from .ops import logprobs as lp_ops


# ---------------------------------------------------------------------------------------------
# Placements
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VocabLayout:
    """How the vocabulary (size ``v``) is split: slice r holds ids starts[r] .. starts[r] +
    sizes[r] - 1 (torch.chunk's split, as DTensor's Shard; trailing slices may be empty), this
    rank holds slice ``rank``; the slices are gathered over the process group ``group_name``
    (the ranks of one mesh dim)."""

    mesh: object
    mesh_dim: int
    group_name: str
    world: int
    rank: int
    v: int
    starts: tuple
    sizes: tuple

    @property
    def v_off(self) -> int:
        return self.starts[self.rank]

    @property
    def v_local(self) -> int:
        return self.sizes[self.rank]

    @property
    def step(self) -> int:
        """Ids per slice but the last ones (slice r starts at r * step)."""
        return self.sizes[0]


def chunk_split(v: int, world: int) -> tuple[tuple, tuple]:
    """(starts, sizes) of torch.chunk's split of v ids into ``world`` slices, which is how
    DTensor's Shard places an uneven dim (ceil(v / world) per slice; trailing slices may be
    short or empty). A pure function of the global size: no collective."""
    step = -(-v // world) if v else 0
    starts = tuple(min(r * step, v) for r in range(world))
    sizes = tuple(min(v, s + step) - s for s in starts)
    return starts, sizes


def _fmt(placements) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ("," if len(placements) == 1 else "") + ")"


def _mesh_dim(mesh, mesh_dim, what: str, expected: str, placements) -> int:
    if mesh_dim is None:
        if mesh.ndim != 1:
            raise ValueError(
                f"{what}: expected placement {expected} on a 1-D mesh (or pass mesh_dim, the mesh dim that "
                f"shards the vocabulary); got {_fmt(placements)} on a {mesh.ndim}-D mesh")
        return 0
    if isinstance(mesh_dim, str):
        names = tuple(mesh.mesh_dim_names or ())
        if mesh_dim not in names:
            raise ValueError(f"mesh_dim: {mesh_dim!r} is not a dim name of the mesh of {what} (names {names})")
        return names.index(mesh_dim)
    if not isinstance(mesh_dim, int) or not -mesh.ndim <= mesh_dim < mesh.ndim:
        raise ValueError(f"mesh_dim: expected an int in [{-mesh.ndim}, {mesh.ndim}) or a dim name for the "
                         f"{mesh.ndim}-D mesh of {what}, got {mesh_dim!r}")
    return mesh_dim % mesh.ndim


def vocab_layout(t: DTensor, what: str, shard_dim: int, mesh_dim=None) -> VocabLayout:
    """The layout of DTensor ``t`` whose dim ``shard_dim`` is the vocabulary: it must be
    ``Shard(shard_dim)`` on ``mesh_dim`` (default: the only dim of a 1-D mesh) and
    ``Replicate()`` on every other mesh dim; anything else raises ValueError naming the
    placements."""
    mesh, placements, ndim = t.device_mesh, tuple(t.placements), t.dim()
    shown = "Shard(-1)" if shard_dim == -1 else f"Shard({shard_dim})"
    dim = _mesh_dim(mesh, mesh_dim, what, shown, placements)
    want = shard_dim % ndim
    p = placements[dim]
    # is_shard(), not type(p) is Shard: inside Dynamo's trace (torch 2.11) an intermediate
    # DTensor's placement may be the C++ base class; _StridedShard is not is_shard()
    if not p.is_shard() or getattr(p, "split_factor", 1) != 1 or p.dim % ndim != want:  # (Partial, Replicate, other dims)
        where = "on a 1-D mesh" if mesh.ndim == 1 else f"on mesh dim {dim}"
        raise ValueError(f"{what}: expected placement {shown} {where}, got {_fmt(placements)}")
    for i, q in enumerate(placements):
        if i != dim and not q.is_replicate():
            raise ValueError(f"{what}: expected Replicate() on every mesh dim but the vocabulary's ({dim}), "
                             f"got {_fmt(placements)}")
    world = mesh.size(dim)
    rank = mesh.get_local_rank(dim)
    group = mesh.get_group(dim)
    import torch.distributed as dist

    if dist.get_rank(group) != rank:
        raise NotImplementedError(f"{what}: a mesh whose order along dim {dim} differs from its process "
                                  f"group's rank order is not supported")
    v = t.shape[shard_dim]
    starts, sizes = chunk_split(v, world)
    with torch.no_grad():
        local = t.to_local().shape[shard_dim]
    if local != sizes[rank]:
        raise NotImplementedError(
            f"{what}: local shard holds {local} of {v} vocabulary entries on rank {rank} of {world}; expected "
            f"torch.chunk's split ({sizes[rank]})")
    return VocabLayout(mesh, dim, group.group_name, world, rank, v, starts, sizes)


class _LocalShard(torch.autograd.Function):
    """``t.to_local()`` whose gradient comes back as a DTensor with exactly ``t``'s mesh,
    placements, shape and stride. torch's own to_local backward derives the gradient's global
    stride from the local shard's, which for a vocabulary that does not divide evenly is not the
    logits' stride (37 columns over 2 ranks: (38, 1) on rank 0 for a [rows, 37] tensor of stride (37, 1));
    torch 2.11's gradient accumulation then copies that gradient into a Replicate tensor of the
    full shape, an all-gather of d logits and a leaf whose gradient is no longer Shard(-1)."""

    @staticmethod
    def forward(ctx, t):
        ctx.spec = (t.device_mesh, tuple(t.placements), t.shape, t.stride())
        local = t.to_local()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, g):
        mesh, placements, shape, stride = ctx.spec
        return DTensor.from_local(g, mesh, placements, run_check=False, shape=shape, stride=stride)


def _local_shard(t):
    return None if t is None else _LocalShard.apply(t)


def _replicated_local(t, what: str, layout: VocabLayout, ref_what: str):
    """A plain tensor as is; a DTensor must be Replicate() on the same mesh: its local tensor
    (differentiable: its gradient comes back Replicate)."""
    if t is None or not isinstance(t, DTensor):
        return t
    if t.device_mesh != layout.mesh:
        raise ValueError(f"{what}: expected a plain tensor or a DTensor on the mesh of {ref_what} "
                         f"({layout.mesh}), got a DTensor on {t.device_mesh}")
    if not all(p.is_replicate() for p in t.placements):
        raise ValueError(f"{what}: expected a plain tensor (the same on every rank) or a Replicate() DTensor, "
                         f"got placements {_fmt(t.placements)}")
    return t.to_local()


def _float_temperature(temperature) -> float:
    if temperature is None:
        return 1.0
    if isinstance(temperature, torch.Tensor):
        raise ValueError("temperature: a tensor temperature is not supported with DTensor inputs (its "
                         "gradient would need a collective); pass a float")
    return float(temperature)


# ---------------------------------------------------------------------------------------------
# Collectives (the c10d functional ops: what DTensor uses; traceable, visible to dispatch modes)
# ---------------------------------------------------------------------------------------------
def _all_gather(parts: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    """[n, C] per rank -> [world, n, C] in rank order."""
    out = torch.ops._c10d_functional.all_gather_into_tensor(parts.contiguous(), layout.world, layout.group_name)
    out = torch.ops._c10d_functional.wait_tensor(out)
    return out.view(layout.world, *parts.shape)


def _all_reduce_sum(t: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_reduce(t.contiguous(), "sum", layout.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


# ---------------------------------------------------------------------------------------------
# Local pieces (no process group)
# ---------------------------------------------------------------------------------------------
def _triton_path(t: torch.Tensor) -> bool:
    return t.device.type in TRITON_DEVICES


def _checks_index(t: torch.Tensor) -> bool:
    """Whether an out-of-range index raises here, as on the single-device CPU reference path
    (reading it is free there). Not while torch.compile traces: that is data-dependent control
    flow (such an index then gives NaN, as on CUDA)."""
    return t.device.type == "cpu" and not _triton_path(t) and not torch.compiler.is_compiling()


def _exact_shift(t: torch.Tensor, dt: torch.dtype, c: float) -> bool:
    """Whether the local statistics of t's device are relative to the exact shift m c
    (ops.logprobs.shift_is_exact)."""
    return lp_ops.shift_is_exact(_triton_path(t), dt, c)


def local_index(index2: torch.Tensor, v_off: int, v_local: int) -> torch.Tensor:
    """Ids of this slice as columns (0 .. v_local - 1); every other id (another slice's,
    ignore_index, out of range) reads column 0, whose value the merge discards."""
    return (index2 - v_off).masked_fill_((index2 < v_off) | (index2 >= v_off + v_local), 0)


def _parts_from(stats2, ent, lp2, dt, n):
    cols = [stats2[:, :1], stats2[:, 1:2]]
    if ent is not None:
        cols.append(ent.reshape(n, 1))
    if lp2 is not None:
        cols.append(lp2)
    return torch.cat([c.to(dt) for c in cols], 1)


def _empty_parts(n: int, k: int | None, has_ent: bool, dt, device) -> torch.Tensor:
    """The partials of an empty slice (no columns): s = 0, so it weighs nothing in the merge."""
    cols = 2 + int(has_ent) + (k or 0)
    p = torch.zeros(n, cols, dtype=dt, device=device)
    p[:, 1].fill_(float("-inf"))
    return p


def _index_rows(index: torch.Tensor | None, n: int, lead) -> torch.Tensor | None:
    if index is None:
        return None
    return index.reshape(n, index.shape[-1]) if index.dim() == len(lead) + 1 else index.reshape(n, 1)


def logits_partials(x: torch.Tensor, index: torch.Tensor | None, v_off: int, temperature: float,
                    want_ent: bool, shift: bool) -> torch.Tensor:
    """Per-row partial statistics [n, 2 (+1) (+K)] = (m, log2 s, (H), (lp_k)) of the logits
    slice x [..., V_local] (ids v_off ..) from one read of it: the log-prob forward op on the
    shard (Triton kernel or reference, as the device has). ``index``: the global ids, [...] or
    [..., K], or None."""
    lead = row_shape(x, shift)
    n = math.prod(lead)
    dt = acc_dtype(x.dtype)
    idx2 = _index_rows(index, n, lead)
    k = None if idx2 is None else idx2.shape[1]
    if x.shape[-1] == 0:
        return _empty_parts(n, k, want_ent, dt, x.device)
    loc = None if idx2 is None else local_index(idx2, v_off, x.shape[-1]).reshape(index.shape)
    lp, ent, stats = torch.ops.fused._logprobs_entropy_forward(
        x, loc, None, *LogprobOptions(temperature, -1, want_ent, shift).values())
    return _parts_from(stats.reshape(n, 2), ent if want_ent else None,
                       None if idx2 is None else lp.reshape(n, k), dt, n)


def merge_partials(parts: torch.Tensor, index2: torch.Tensor | None, ignore_index: int, step: int, v: int,
                   c: float, exact: bool, has_ent: bool):
    """The world's partials [W, n, 2 (+1) (+K)] (rank order) -> (logp [n, K] or None, entropy [n] or
    None, stats [n, 2]) of the whole rows; the same arithmetic on every rank. Slice r holds ids
    r * step .. (r + 1) * step - 1 (torch.chunk's split; ``step`` = ceil(V / W)); ``v``: the
    vocabulary size.

    O(n W) elementwise work in a few dozen small launches, none of which waits for the device:
    no tensor is made from host values here (a host-to-device copy would synchronize the stream
    and leave every launch after it exposed)."""
    ninf = float("-inf")
    ln2 = traced_constants()[1]
    m_r, l2s_r = parts[..., 0], parts[..., 1]
    empty = l2s_r == ninf  # s_r = 0: no columns, or only -inf logits (a NaN stays NaN)
    # each rank's (m, s, t) from its (m, log2 s, H): t = s (log2 s - H / ln 2); merged in rank order
    s_r = torch.exp2(l2s_r)
    t_r = s_r * (l2s_r - parts[..., 2] * (1.0 / ln2)) if has_ent else torch.zeros_like(s_r)
    t_r = t_r.masked_fill(empty, 0.0)
    big, s, t, _, da = lp_ops.merge_row_stats(m_r, s_r, t_r, c, exact, 0)
    l2s = s.log2()
    rel = l2s_r + da - l2s  # [W, n]: log2 of rank r's share of the row's probability (-inf if empty)
    stats = torch.stack([big, l2s], 1)
    ent = None
    if has_ent:
        ent = ((l2s - t / s) * ln2).masked_fill_(l2s == ninf, float("nan"))
    logp = None
    if index2 is not None:
        lp_r = parts[..., 2 + int(has_ent):]  # [W, n, K]
        owner = torch.div(index2, step, rounding_mode="floor").clamp_(0, parts.shape[0] - 1).long()
        val = lp_r.gather(0, owner[None]).squeeze(0) + rel.t().gather(1, owner) * ln2
        # the owner's slice of the row is all -inf: so is the id's logit (-inf, or NaN for a row of only -inf)
        val = torch.where(empty.t().gather(1, owner), ninf - l2s[:, None], val)
        val = val.masked_fill_((index2 < 0) | (index2 >= v), float("nan"))
        logp = val.masked_fill_(index2 == ignore_index, 0.0)
    return logp, ent, stats


def logits_backward(g_logp, g_ent, x, index, stats, ent, temperature: float, ignore_index: int, shift: bool,
                    v_off: int, v_total: int) -> torch.Tensor:
    """d logits of the slice x (ids v_off .. of v_total) from the whole rows' stats and entropy:
    the log-prob backward op's implementation for the device, no collective."""
    if x.shape[-1] == 0 or (g_logp is None and g_ent is None):
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    return torch.ops.fused._logprobs_entropy_slice_backward(
        g_logp, g_ent, x, index if g_logp is not None else None, stats, ent,
        *LogprobOptions(temperature, ignore_index, True, shift).values(), v_off=v_off, v_total=v_total)


def linear_partials(hidden, weight, index, bias, opts: HeadOptions, v_off: int):
    """Per-row partial statistics [n, 3 + K] = (m, log2 s, H, lp_k) of the vocabulary slice held in
    weight [V_local, H] (ids v_off ..): the fused head's forward op on the local weight."""
    lead = row_shape(hidden, opts.shift)
    n = math.prod(lead)
    dt = acc_dtype(hidden.dtype)
    idx2 = _index_rows(index, n, lead)
    if weight.shape[0] == 0:
        return _empty_parts(n, idx2.shape[1], True, dt, hidden.device)
    loc = local_index(idx2, v_off, weight.shape[0]).reshape(index.shape)
    lp, ent, stats = torch.ops.fused._linear_logprobs_entropy_forward(
        hidden, weight, loc, bias, *replace(opts, ignore_index=-1).values())
    return _parts_from(stats.reshape(n, 2), ent, lp.reshape(n, idx2.shape[1]), dt, n)


def linear_backward(g_logp, g_ent, hidden, weight, index, bias, stats, ent, opts: HeadOptions, v_off: int,
                    v_total: int, hidden_grad: bool = True, weight_grad: bool = True):
    """(partial d hidden rows [n, H] in fp32 (fp64), d weight [V_local, H], d bias) of the slice:
    the fused head's backward chunks with the whole rows' stats; d hidden still to be summed
    over the ranks. Without hidden_grad (weight_grad) that gradient is an empty tensor and its
    GEMMs are skipped (a frozen head)."""
    return torch.ops.fused._linear_logprobs_slice_backward(
        g_logp, g_ent, hidden, weight, index, bias, stats, ent, *opts.values(), v_off=v_off, v_total=v_total,
        hidden_grad=hidden_grad, weight_grad=weight_grad)


# ---------------------------------------------------------------------------------------------
# Autograd (on local tensors; the DTensor wrapping is done by to_local / from_local around it)
# ---------------------------------------------------------------------------------------------
def _finish(parts_world, index, lead, ignore_index, layout, c, exact, has_ent, dt):
    n = math.prod(lead)
    idx2 = _index_rows(index, n, lead)
    lp2, ent, stats = merge_partials(parts_world, idx2, ignore_index, layout.step, layout.v, c, exact, has_ent)
    logp = lp2.reshape(index.shape) if lp2 is not None else torch.empty(0, dtype=dt, device=parts_world.device)
    ent = ent.reshape(lead) if ent is not None else torch.empty(0, dtype=dt, device=parts_world.device)
    return logp, ent, stats.reshape(*lead, 2)


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, layout, temperature, ignore_index, want_ent, shift):
        dt = acc_dtype(x.dtype)
        lead = row_shape(x, shift)
        if index is not None and _checks_index(x):
            reference.check_index_range(index, layout.v, ignore_index)  # as the single-device CPU path
        parts = logits_partials(x, index, layout.v_off, temperature, want_ent, shift)
        world = _all_gather(parts, layout) if parts.numel() else parts.new_empty(layout.world, *parts.shape)
        c = traced_constants()[0] / kernel_temperature(temperature)
        logp, ent, stats = _finish(world, index, lead, ignore_index, layout, c, _exact_shift(x, dt, c), want_ent, dt)
        ctx.set_materialize_grads(False)
        ctx.args = (layout, temperature, ignore_index, want_ent, shift)
        ctx.save_for_backward(x, index, stats, ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        x, index, stats, ent = ctx.saved_tensors
        layout, temperature, ignore_index, want_ent, shift = ctx.args
        if index is None:
            g_logp = None
        if not want_ent:
            g_ent = None
        dx = logits_backward(g_logp, g_ent, x, index, stats, ent, temperature, ignore_index, shift,
                             layout.v_off, layout.v) if ctx.needs_input_grad[0] else None
        return (dx,) + (None,) * (len(ctx.needs_input_grad) - 1)


class _VocabParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, index, bias, layout, opts):
        dt = acc_dtype(hidden.dtype)
        lead = row_shape(hidden, opts.shift)
        if _checks_index(hidden):
            reference.check_index_range(index, layout.v, opts.ignore_index)
        parts = linear_partials(hidden, weight, index, bias, opts, layout.v_off)
        world = _all_gather(parts, layout) if parts.numel() else parts.new_empty(layout.world, *parts.shape)
        c = traced_constants()[0] / LL.effective_temperature(opts)
        logp, ent, stats = _finish(world, index, lead, opts.ignore_index, layout, c, _exact_shift(hidden, dt, c), True,
                                   dt)
        ctx.set_materialize_grads(False)
        ctx.args = (layout, opts)
        ctx.save_for_backward(hidden, weight, index, bias, stats, ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, index, bias, stats, ent = ctx.saved_tensors
        layout, opts = ctx.args
        need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
        n_in = len(ctx.needs_input_grad)  # one gradient (or None) per forward argument
        if not (need_h or need_w or need_b):
            return (None,) * n_in
        dh, dw, db = linear_backward(g_logp, g_ent, hidden, weight, index, bias, stats, ent, opts, layout.v_off,
                                     layout.v, hidden_grad=bool(need_h), weight_grad=bool(need_w))
        if need_h:  # the one collective of the backward: the ranks' partial d hidden, summed in fp32
            dh = LL.hidden_grad_from_rows(_all_reduce_sum(dh, layout) if dh.numel() else dh, hidden, opts.shift)
        grads = (dh if need_h else None, dw if need_w else None, None, db if (need_b and bias is not None) else None)
        return grads + (None,) * (n_in - len(grads))


# ---------------------------------------------------------------------------------------------
# Entry points (called by torch_fused's public functions when an input is a DTensor)
# ---------------------------------------------------------------------------------------------
def _replicate(t: torch.Tensor, mesh) -> DTensor:
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def logprobs_entropy(logits, index, *, temperature=None, ignore_index: int = -100, shift: bool = False,
                     mesh_dim=None, want_logp: bool = True, want_ent: bool = True):
    """(logp, entropy) as Replicate DTensors (None for the one not wanted) from DTensor logits
    sharded on the vocabulary, ``Shard(-1)``; the logits' gradient is ``Shard(-1)`` too."""
    if not isinstance(logits, DTensor):
        raise ValueError(f"logits: expected a DTensor with placement Shard(-1), got {type(logits).__name__}")
    layout = vocab_layout(logits, "logits", -1, mesh_dim)
    t = _float_temperature(temperature)
    idx = _replicated_local(index, "index", layout, "logits") if want_logp else None
    x = _local_shard(logits)
    meta_lp.check_logits_index(logits, idx, t, None, shift)  # global shapes (the DTensor's), as single-device
    check(idx is None or idx.device == x.device,
          lambda: f"index: expected device {x.device} (the logits' device), got {idx.device}")
    logp, ent = _VocabParallelLogprobs.apply(x, idx, layout, t, ignore_index, want_ent, shift)
    return (_replicate(logp, layout.mesh) if want_logp else None,
            _replicate(ent, layout.mesh) if want_ent else None)


def linear_logprobs_and_entropy(hidden, weight, index, *, bias=None, mesh_dim=None, **options):
    """The fused head with a vocabulary-sharded weight: a DTensor ``Shard(0)`` [V, H] (bias, if
    any, a DTensor ``Shard(0)`` [V] on the same mesh); hidden and index plain tensors (the same on
    every rank) or Replicate DTensors. Returns Replicate DTensors; d weight (and d bias) stay
    ``Shard(0)``, d hidden is summed over the ranks once. ``options``: the fields of
    meta.linear_logprobs.HeadOptions (temperature, ignore_index, ...)."""
    if not isinstance(weight, DTensor):
        raise ValueError("weight: expected a DTensor with placement Shard(0) (a vocabulary-sharded lm_head) when "
                         f"hidden is a DTensor, got {type(weight).__name__}")
    layout = vocab_layout(weight, "weight", 0, mesh_dim)
    if bias is not None:
        if not isinstance(bias, DTensor) or bias.device_mesh != layout.mesh or tuple(bias.placements) != tuple(
                weight.placements):
            got = _fmt(bias.placements) if isinstance(bias, DTensor) else f"a plain {type(bias).__name__}"
            raise ValueError(f"bias: expected a DTensor placed as the weight, {_fmt(weight.placements)} on its mesh, "
                             f"got {got}")
    opts = HeadOptions(**options)
    opts = replace(opts, temperature=_float_temperature(opts.temperature))
    h = _replicated_local(hidden, "hidden", layout, "weight")
    idx = _replicated_local(index, "index", layout, "weight")
    meta_ll.check_linear(h, weight, idx, bias, opts)  # global weight / bias shapes
    w = _local_shard(weight)
    b = _local_shard(bias)
    logp, ent = _VocabParallelLinear.apply(h, w, idx, b, layout, opts)
    return _replicate(logp, layout.mesh), _replicate(ent, layout.mesh)
