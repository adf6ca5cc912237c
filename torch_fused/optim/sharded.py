"""SinkGD on sharded parameters: DTensors with ``Shard(0)`` placement on a 1-D mesh, as
``torch.distributed.fsdp.fully_shard`` (FSDP2) leaves every parameter. ``SinkGD.step`` sends
its DTensor matrices here; the algorithm is docs/SINKGD.md's, and so is the result (the step of
the whole matrix), computed from the local shards with a few small all-reduces.

X = diag(r) G diag(c). With the rows of a matrix split over the ranks (``Shard(0)`` of a 2-D
``[m, n]`` weight, ``Shard(ndim - 2)`` in general), each rank holds its rows' r and a copy of c:

- row step: r_i <- r_i sqrt(n) / max(||row i of X||, eps): local (a row is whole on its rank);
- column step: c_j <- c_j sqrt(m) / max(sqrt(sum over ALL rows of (r_i G_ij c_j)^2), eps), m the
  global row count: every rank sums its rows' terms into column partials [B, n], and ONE
  all-reduce per iteration sums the partials of every row-sharded matrix of the step (one flat
  fp32 buffer), after which every rank holds the same c;
- spectral step (optional), per power iteration: u = X v over the local rows, |u|^2 and
  X^T u summed over the ranks in ONE all-reduce (every matrix's [B, n] partials and [B]
  scalars), w = (X^T u) / max(|u|, eps), sigma = |w|, v = w / sigma (the restart vector where
  sigma = 0: reference.spectral_vector_and_scale). The warm-start
  vector v [B, n] is the same on every rank (a plain tensor in the optimizer's state);
- update: W <- W - eta (X + weight_decay W) on the local rows, fp32 math, stored in W's dtype.

So a step's collectives carry (sinkhorn_iters + spectral_iters) * sum(B n) + spectral_iters *
sum(B) fp32 elements: O(columns), never a parameter or a gradient. A batch of matrices
``[B, ..., m, n]`` sharded on dim 0 (``Shard(0)`` with ndim >= 3) holds whole matrices on each
rank: no collective; its warm-start vectors are a DTensor ``[B, ..., n]`` with the same
placement. ``Replicate()`` on a 1-D mesh is the whole matrix on every rank: computed locally, no
collective. Every other placement raises ValueError naming it.

Two implementations of the same step:

- on a Triton device (CUDA; the CPU under ``TRITON_INTERPRET=1``) the single-device op's
  kernels run on the local rows (``ops/sinkgd/launch.py::launch_sharded``): per Sinkhorn iteration the
  row pass writes column partials, ``_sinkgd_colsum_kernel`` finishes each rank's column sums
  into one fp32 buffer, the all-reduce sums that buffer's row-sharded region, and the column
  scale kernel reads the summed columns; the power iteration likewise. The update kernel keys
  its stochastic rounding by each element's index in the whole parameter (meta columns MG,
  EOFF, SALT), so the random bits are the unsharded step's. A world of 1 is bitwise the fused
  step; larger worlds sum the column partials in another order (fp32 rounding).
- elsewhere (the CPU, a call with any float64 matrix, or the sinkgd_sharded_fused setting off) PyTorch ops: fp32
  math on the scale vectors (float64 for a float64 matrix), the gradient read in row chunks of about ``CHUNK_ELEMS`` elements (no fp32 copy of
  a whole gradient). Stochastic rounding of bf16 parameters (where the single-device op does
  it: a Triton device) reproduces the update kernel's random bits: Philox (Triton's
  ``tl.randint4x``, 10 rounds) keyed by the seed ``step * 1000003 + matrix index``, one call
  per eight elements of the WHOLE parameter (``sr_noise``, ``update_salts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops.sinkgd import SinkGDCache, launch_sharded
from ..reference import spectral_vector_and_scale
from ..settings import current as settings
from .._library import SCALE_MAX, SQRT_FP32_MAX, SR_SEED_STRIDE, is_dtensor

CHUNK_ELEMS = 1 << 22  # gradient elements per row chunk of the local passes

_M32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Placements
# ---------------------------------------------------------------------------------------------


def _fmt(placements) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ("," if len(placements) == 1 else "") + ")"


@dataclass(frozen=True)
class ShardInfo:
    """How one DTensor matrix parameter is split. kind: "rows" (each matrix's rows split over
    the ranks: column sums need an all-reduce), "batch" (whole matrices per rank) or "whole"
    (Replicate: everything local). Global sizes b (matrices), m, n; local b_loc, m_loc; the
    local block starts at matrix b_off, row row_off of the whole parameter."""

    kind: str
    group_name: str | None
    b: int
    m: int
    n: int
    b_loc: int
    m_loc: int
    b_off: int
    row_off: int


def _local_offset(p, mesh, placements):
    """(local shape, global offset) of this rank's shard of ``p`` (torch.chunk's split, as
    DTensor's Shard and FSDP2 place an uneven dim)."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - older releases
        compute_local_shape_and_global_offset = None
    if compute_local_shape_and_global_offset is not None:
        shape, off = compute_local_shape_and_global_offset(p.shape, mesh, placements)
        return tuple(shape), tuple(off)
    d = placements[0].dim % p.dim()
    world, rank = mesh.size(0), mesh.get_local_rank(0)
    size = p.shape[d]
    step = -(-size // world) if size else 0
    lo, hi = min(rank * step, size), min(size, (rank + 1) * step)
    shape = list(p.shape)
    shape[d] = hi - lo
    off = [0] * p.dim()
    off[d] = lo
    return tuple(shape), tuple(off)


_SPLITS: dict = {}  # (shape, id(mesh), placements) -> (mesh, what _split returns)


def _split(shape, mesh, placements):
    """(local shape, global offset, process group name) of this rank's shard of a DTensor of
    ``shape``: fixed for a (shape, mesh object, placements), so computed once (a step asks for
    every parameter's). Keyed by the mesh's identity: a mesh made again after a new process
    group compares equal to the old one but names another group."""
    key = (shape, id(mesh), placements)
    hit = _SPLITS.get(key)
    if hit is not None and hit[0] is mesh:
        return hit[1]
    local_shape, off = _local_offset(torch.empty(shape, device="meta"), mesh, placements)
    if len(_SPLITS) >= 4096:
        _SPLITS.clear()
    _SPLITS[key] = (mesh, (local_shape, off, mesh.get_group(0).group_name))
    return _SPLITS[key][1]


def shard_info(p, g, i: int) -> ShardInfo:
    """Validate DTensor parameter ``params[i]`` and its gradient and describe its split; an
    unsupported placement raises ValueError naming it."""
    from torch.distributed.tensor import DTensor

    what = f"params[{i}]"
    mesh, placements, nd = p.device_mesh, tuple(p.placements), p.dim()
    shape = tuple(p.shape)
    if mesh.ndim != 1:
        raise ValueError(
            f"{what}: SinkGD supports DTensor parameters on a 1-D mesh with placement Shard(0) (rows; "
            f"Shard({nd - 2}) of a [..., m, n] parameter, or Shard(0) of a batch of matrices) or Replicate(); "
            f"got placements {_fmt(placements)} on a {mesh.ndim}-D mesh, shape {shape}")
    pl = placements[0]
    if not isinstance(g, DTensor):
        raise ValueError(f"grads[{i}]: the parameter is a DTensor with placements {_fmt(placements)}; expected its "
                         f"gradient to be a DTensor with the same placements, got a {type(g).__name__}")
    if g.device_mesh != mesh or tuple(g.placements) != placements:
        raise ValueError(f"grads[{i}]: expected the parameter's placements {_fmt(placements)} on its mesh, got "
                         f"{_fmt(g.placements)}" + ("" if g.device_mesh == mesh else " on another mesh"))
    if tuple(g.shape) != shape:
        raise ValueError(f"grads[{i}]: shape {tuple(g.shape)} does not match its parameter's {shape}")
    m, n = shape[-2], shape[-1]
    b = math.prod(shape[:-2])
    if pl.is_replicate():
        return ShardInfo("whole", None, b, m, n, b, m, 0, 0)
    if type(pl).__name__ != "Shard":  # Partial, _StridedShard, other placements
        raise ValueError(f"{what}: SinkGD supports DTensor placements Shard(0) (rows of a matrix, or a batch "
                         f"of matrices) and Replicate() on a 1-D mesh; got {_fmt(placements)}, shape {shape}")
    d = pl.dim % nd
    if d == nd - 2:
        kind = "rows"
    elif d == 0:  # nd >= 3: a batch of whole matrices
        kind = "batch"
    else:
        part = "columns (the last dim)" if d == nd - 1 else f"leading dim {d}"
        raise ValueError(
            f"{what}: SinkGD supports Shard({nd - 2}) (rows) or Shard(0) of a [..., m, n] parameter; got "
            f"{_fmt(placements)}, which shards its {part}, shape {shape}")
    local_shape, off, group_name = _split(shape, mesh, placements)
    with torch.no_grad():
        lp = p.to_local()
    if tuple(lp.shape) != local_shape:
        raise NotImplementedError(
            f"{what}: local shard of shape {tuple(lp.shape)} on rank {mesh.get_local_rank(0)}; expected "
            f"torch.chunk's split of {shape} ({local_shape})")
    if kind == "rows":
        return ShardInfo(kind, group_name, b, m, n, b, local_shape[-2], 0, off[-2])
    inner = math.prod(shape[1:-2])
    return ShardInfo(kind, group_name, b, m, n, local_shape[0] * inner, m, off[0] * inner, 0)


# ---------------------------------------------------------------------------------------------
# The update kernel's random bits, in PyTorch ops
# ---------------------------------------------------------------------------------------------
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57


def _mul32(a: int, b: torch.Tensor):
    """(high, low) 32-bit words of a * b for a uint32 constant ``a`` and int64 tensor ``b`` of
    uint32 values, without leaving int64: a = a1 2^16 + a0, every partial product < 2^48."""
    t1 = b * (a >> 16)
    t0 = b * (a & 0xFFFF)
    hi = (t1 + (t0 >> 16)) >> 16
    lo = (((t1 & 0xFFFF) << 16) + t0) & _M32
    return hi, lo


def philox_words(seed: torch.Tensor, offset: torch.Tensor, rounds: int = 10):
    """Triton's ``tl.randint4x(seed, offset)`` for an int32 seed (a 0-dim int64 tensor holding
    it, possibly negative) and uint32 offsets (an int64 tensor of values in [0, 2^32)): the four
    words of Philox-4x32 with counter (offset, 0, 0, 0) and key (the seed as uint64: low word,
    high word). Returns four int64 tensors of values in [0, 2^32)."""
    k0 = seed & _M32
    k1 = torch.where(seed < 0, _M32, 0)  # int32 -> uint64 sign-extends
    c0, c1, c2, c3 = offset, torch.zeros_like(offset), torch.zeros_like(offset), torch.zeros_like(offset)
    for _ in range(rounds):
        hi_b, lo_b = _mul32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul32(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _M32
        k1 = (k1 + _PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def sr_noise(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The update kernel's 16 random bits of the elements at ``index`` (int64, their indices in
    the whole parameter): the Philox words at counter index >> 3 (mod 2^32), word
    (index >> 1) & 3, its low half for an even index and its high half for an odd one.
    Returns int64 values in [0, 2^16)."""
    words = philox_words(seed, (index >> 3) & _M32)
    sel = (index >> 1) & 3
    word = torch.where(sel == 0, words[0], torch.where(sel == 1, words[1], torch.where(sel == 2, words[2], words[3])))
    return torch.where((index & 1) == 0, word & 0xFFFF, word >> 16)


def sr_seed(step: torch.Tensor, salt: int) -> torch.Tensor:
    """The update kernel's int32 seed ``int32(step) * 1000003 + salt`` (wrapping), as a 0-dim
    int64 tensor on step's device (no host sync)."""
    s = step.reshape(()).to(torch.int64) * SR_SEED_STRIDE + salt
    return ((s + (1 << 31)) & _M32) - (1 << 31)


def stochastic_round_bf16(new: torch.Tensor, seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """fp32 ``new`` with 16 random bits (Philox at ``index``, the elements' indices in the whole
    parameter) added below bf16's mantissa and truncated, as the update kernel does; non-finite
    values are left to round to nearest. Returns fp32 values exact in bf16 (or non-finite)."""
    noise = sr_noise(seed, index)
    bits = new.view(torch.int32).to(torch.int64) & _M32
    rounded = (bits + noise) & 0xFFFF0000
    rounded = torch.where(rounded >= (1 << 31), rounded - (1 << 32), rounded).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(new), rounded, new)


def update_salts(params, grads) -> list[int | None]:
    """The matrix index that salts each parameter's stochastic-rounding seed in the unsharded
    op (ops/sinkgd/__init__.py: parameters grouped by (device, param dtype, grad dtype), then by the
    update kernel's alignment class: 16-byte loads where n is a multiple of 16 bytes' worth of
    the narrower dtype, the whole tensors taken as 16-byte aligned, as separately allocated
    parameters are). None where the op takes the float64 reference path or skips the
    parameter. Global shapes for DTensors."""
    counts: dict = {}
    out: list[int | None] = []
    for p, g in zip(params, grads):
        if p.numel() == 0 or torch.float64 in (p.dtype, g.dtype):
            out.append(None)
            continue
        vec = 16 // min(p.element_size(), g.element_size())
        key = (p.device, p.dtype, g.dtype, p.shape[-1] % vec == 0)
        out.append(counts.get(key, 0))
        counts[key] = counts.get(key, 0) + 1
    return out


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------
class _Mat:
    """One matrix parameter's local view [b_loc, m_loc, n], its gradient's, and its scales."""

    def __init__(self, w, g, info: ShardInfo, v, scales: bool = True):
        self.w = w
        self.g = g
        # the PyTorch-op path's arithmetic: fp32, float64 where W or G is float64
        self.dt = torch.float64 if torch.float64 in (w.dtype, g.dtype) else torch.float32
        self.info = info
        self.v = v
        self.chunk = max(1, CHUNK_ELEMS // max(1, info.b_loc * info.n))
        if scales:
            self.init_scales()

    def init_scales(self):
        """r and c all ones (the PyTorch-op path's, in its arithmetic's dtype; the fused path
        keeps its own)."""
        dev = self.w.device
        self.r = torch.ones(self.info.b_loc, self.info.m_loc, dtype=self.dt, device=dev)
        self.c = torch.ones(self.info.b_loc, self.info.n, dtype=self.dt, device=dev)

    def chunks(self):
        for a in range(0, self.info.m_loc, self.chunk):
            yield a, min(self.info.m_loc, a + self.chunk)


def _all_reduce(buf: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum over the group (the c10d functional op: traceable, seen by dispatch modes)."""
    out = torch.ops._c10d_functional.all_reduce(buf, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _reduce_groups(mats, parts):
    """Sum ``parts[k]`` (fp32 tensors, one per matrix; float64 for a float64 matrix) over the
    ranks for every row-sharded matrix: ONE all-reduce per process group, of the parts
    concatenated (float64 if any is); others stay as they are. Returns the list of summed
    parts, each in its own dtype."""
    out = list(parts)
    by_group: dict = {}
    for k, mat in enumerate(mats):
        if mat.info.kind == "rows":
            by_group.setdefault(mat.info.group_name, []).append(k)
    for name, idx in by_group.items():
        flat = torch.cat([parts[k].reshape(-1) for k in idx])
        flat = _all_reduce(flat, name)
        at = 0
        for k in idx:
            size = parts[k].numel()
            out[k] = flat[at:at + size].view(parts[k].shape).to(parts[k].dtype)
            at += size
    return out


def _row_pass(mat: _Mat, eps: float) -> torch.Tensor:
    """Row step on the local rows (r updated in place); returns the column partials [b_loc, n]
    sum_i (r_i G_ij c_j)^2 over the local rows."""
    info = mat.info
    fn = _chunk_fn(_row_values, mat.w.device)
    part = torch.zeros(info.b_loc, info.n, dtype=mat.dt, device=mat.w.device)
    for a, e in mat.chunks():
        r_new, p = fn(mat.g[:, a:e], mat.c, mat.r[:, a:e], eps)
        mat.r[:, a:e] = r_new
        part += p
    return part


def _mv(mat: _Mat, x: torch.Tensor) -> torch.Tensor:
    """diag(r) G x over the local rows: [b_loc, m_loc] from [b_loc, n] (mat.dt, chunked). Each
    chunk is scaled by r before the products, so that the sums stay finite for entries near the
    fp32 maximum (G x alone overflows there)."""
    out = torch.empty(mat.info.b_loc, mat.info.m_loc, dtype=mat.dt, device=mat.w.device)
    for a, e in mat.chunks():
        out[:, a:e] = torch.einsum("bmn,bn->bm", mat.r[:, a:e, None] * mat.g[:, a:e].to(mat.dt), x.to(mat.dt))
    return out


def _mv_t(mat: _Mat, y: torch.Tensor) -> torch.Tensor:
    """(diag(r) G)^T y over the local rows: [b_loc, n] partials from [b_loc, m_loc] (r applied to
    each chunk, as in _mv)."""
    out = torch.zeros(mat.info.b_loc, mat.info.n, dtype=mat.dt, device=mat.w.device)
    for a, e in mat.chunks():
        out += torch.einsum("bmn,bm->bn", mat.r[:, a:e, None] * mat.g[:, a:e].to(mat.dt), y[:, a:e].to(mat.dt))
    return out


def _update_values(w, g, r, c, coef_x, coef_w, seed, rows, cols):
    """The new values of a chunk of rows w [b, s, n] (in w's dtype): the update kernel's fp32
    operations in its order, then its stochastic rounding where ``seed`` is given (``rows``
    [b, s] and ``cols`` [n]: the elements' rows and columns in the whole parameter). The math
    in r's dtype (fp32; float64 for a float64 matrix)."""
    wf = w.to(r.dtype)
    x = g.to(r.dtype) * r[:, :, None] * c[:, None, :]
    new = wf - coef_x[:, None, None] * x - coef_w * wf
    if seed is not None:
        new = stochastic_round_bf16(new, seed, rows[:, :, None] * cols.shape[0] + cols)
    return new.to(w.dtype)


def _row_values(g, c, r_old, eps: float):
    """Row step of a chunk of rows g [b, s, n]: (new r [b, s], column partials [b, n]), in c's
    dtype (fp32; float64 for a float64 matrix)."""
    target = math.sqrt(g.shape[-1])  # from the shape: one compiled graph for every n
    # x = (r_old G_ij) c_j, X's row before this step: bounded, where G c alone overflows for
    # entries near the fp32 maximum (one temporary in c's dtype)
    x = g.to(c.dtype) * r_old[:, :, None] * c[:, None, :]
    # scaled by each row's largest |x| (a) before squaring, so that no finite gradient overflows;
    # the row norm a s (s = |x / a| in [1, sqrt(n)]) is never formed: it overflows there too
    a = x.abs().amax(2)
    live = a > 0
    q = x.div_(torch.where(live, a, 1.0)[:, :, None]).square_()
    s = torch.where(live, q.sum(2).sqrt(), 1.0)
    ratio = (target / s) / torch.maximum(a, eps / s)  # r_new / r_old
    r_new = (r_old * ratio).clamp_max(SCALE_MAX)
    # (r_new G c)^2 = (a r_new / r_old)^2 q; a zero row's r_new = 1e30 meets q = 0 (and a = 0):
    # kept finite (as the kernels do)
    coef = (r_new / r_old * a).clamp_max(SQRT_FP32_MAX)
    return r_new, torch.einsum("bmn,bm->bn", q, coef.square())


# On CUDA the chunk functions run compiled (torch.compile, dynamic shapes): each becomes a few
# fused kernels instead of a dozen PyTorch passes over the chunk (the Philox rounds alone are
# ~200 elementwise int64 ops). the sinkgd_sharded_compile setting (TORCH_FUSED_SINKGD_SHARDED_COMPILE=0) keeps them eager.

_COMPILED: dict = {}


def _chunk_fn(fn, dev: torch.device):
    if not (settings.sinkgd_sharded_compile and dev.type == "cuda"):
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def _update(mat: _Mat, coef_x: torch.Tensor, coef_w: torch.Tensor, seed) -> None:
    """W <- W - coef_x[b] (r_i G_ij c_j) - coef_w W on the local rows, fp32 math (float64 for a
    float64 matrix), stored in W's dtype (stochastically rounded to bf16 where ``seed`` is given), in the update kernel's
    operation order."""
    info = mat.info
    dev = mat.w.device
    fn = _chunk_fn(_update_values, dev)
    cols = torch.arange(info.n, dtype=torch.int64, device=dev)
    bs = torch.arange(info.b_loc, dtype=torch.int64, device=dev)[:, None]
    for a, e in mat.chunks():
        rows = (bs + info.b_off) * info.m + info.row_off + torch.arange(a, e, dtype=torch.int64, device=dev)
        w = mat.w[:, a:e]
        w.copy_(fn(w, mat.g[:, a:e], mat.r[:, a:e], mat.c, coef_x, coef_w, seed, rows, cols))


def check_sharded_vecs(params, vecs) -> None:
    """Each warm-start vector: float32 [B, n] (a plain tensor) for a row-sharded or replicated
    matrix, a DTensor [*lead, n] with the parameter's placement for a batch-sharded one."""
    for i, (p, v) in enumerate(zip(params, vecs)):
        lead = tuple(p.shape[:-2])
        batch = warm_start_is_sharded(p)
        if batch:
            want = lead + (p.shape[-1],)
            ok = is_dtensor(v) and tuple(v.shape) == want and tuple(v.placements) == tuple(p.placements)
        else:
            want = (math.prod(lead), p.shape[-1])
            ok = not is_dtensor(v) and tuple(v.shape) == want
        if not ok or v.dtype != torch.float32:
            shown = (f"a float32 DTensor of shape {want} with placements {_fmt(p.placements)}" if batch
                     else f"a float32 plain tensor of shape {want} (the same on every rank)")
            got = f"{type(v).__name__} {v.dtype} {tuple(v.shape)}"
            if is_dtensor(v):
                got += f" {_fmt(v.placements)}"
            raise ValueError(f"spectral_vecs[{i}]: expected {shown}, got {got}")


@torch.compiler.disable(recursive=True)
@torch.no_grad()
def sinkgd_step_sharded(params, grads, *, lr, spectral_vecs=None, lr_scale=0.05, weight_decay=0.0, eps=1e-8,
                        sinkhorn_iters=5, spectral_norm=False, spectral_target="unit", spectral_iters=1,
                        base_width=None, width_exponent=1.0, stochastic_round=False, step=None,
                        salts=None) -> None:
    """One in-place SinkGD update of DTensor matrices (``Shard(0)`` rows, a ``Shard(0)`` batch
    of matrices, or ``Replicate()``, on a 1-D mesh), equal to the step of the whole matrices
    (``torch_fused.optim.sinkgd_step``'s arguments; the module docstring says how). Every rank
    of the mesh must call it with the same parameters in the same order.

    ``spectral_vecs``: per matrix, a float32 plain tensor [B, n] (row-sharded, replicated;
    the same on every rank) or, for a ``Shard(0)`` batch [B, ..., m, n], a DTensor [B, ..., n]
    with the same placement; updated in place. ``salts``: each matrix's stochastic-rounding
    salt (``update_salts`` over the whole param group; default: ``update_salts`` over
    ``params``). Stochastic rounding applies to bf16 parameters on the devices where the
    single-device op does it (Triton devices); elsewhere the op rounds to nearest, and so does
    this."""
    from .._library import TRITON_DEVICES
    from ..meta.sinkgd import check_matrix, check_settings

    vecs = list(spectral_vecs or [])
    check_settings(len(params), len(grads), len(vecs), sinkhorn_iters, eps, spectral_norm, spectral_target,
                   spectral_iters)
    if not params:
        return
    infos = []
    for i, (p, g) in enumerate(zip(params, grads)):
        if not is_dtensor(p):
            raise ValueError(f"params[{i}]: expected a DTensor, got a {type(p).__name__}")
        check_matrix(i, p)
        infos.append(shard_info(p, g, i))
    if spectral_norm:
        check_sharded_vecs(params, vecs)
    if salts is None:
        salts = update_salts(params, grads)
    mats = []
    for i, (p, g, info) in enumerate(zip(params, grads, infos)):
        if p.numel() == 0:
            continue
        w = p.to_local()
        if not w.is_contiguous():
            raise ValueError(f"params[{i}]: expected a contiguous local shard, got strides {tuple(w.stride())} "
                             f"for local shape {tuple(w.shape)}")
        gl = g.to_local()
        w3 = w.view(info.b_loc, info.m_loc, info.n)
        g3 = gl.contiguous().view(info.b_loc, info.m_loc, info.n)
        v = None
        if spectral_norm:
            v = vecs[i].to_local().view(info.b_loc, info.n) if is_dtensor(vecs[i]) else vecs[i]
        mat = _Mat(w3, g3, info, v, scales=False)
        mat.index = i
        mats.append(mat)
    if not mats:
        return
    dev = mats[0].w.device
    if isinstance(lr, torch.Tensor):
        lr_d = lr.reshape(()).to(device=dev, dtype=torch.float32)
    else:
        lr_d = torch.tensor(float(lr), dtype=torch.float32, device=dev)
    lr_wide = None  # a float64 matrix's lr, not rounded through fp32
    if any(m.dt == torch.float64 for m in mats):
        lr_wide = (lr.reshape(()).to(device=dev, dtype=torch.float64) if isinstance(lr, torch.Tensor)
                   else torch.tensor(float(lr), dtype=torch.float64, device=dev))
    if step is None:
        step = torch.zeros((), dtype=torch.float32, device=dev)
    kw = dict(lr_scale=lr_scale, weight_decay=weight_decay, eps=eps, sinkhorn_iters=sinkhorn_iters,
              spectral_norm=spectral_norm, spectral_target=spectral_target, spectral_iters=spectral_iters,
              base_width=base_width, width_exponent=width_exponent)
    if settings.sinkgd_sharded_fused and dev.type in TRITON_DEVICES and lr_wide is None:
        _fused_step(mats, salts, lr_d, step, stochastic_round, **kw)
    else:
        _torch_step(mats, salts, lr_d, step, stochastic_round, lr_wide=lr_wide, **kw)


def _torch_step(mats, salts, lr_d, step, stochastic_round, *, lr_scale, weight_decay, eps, sinkhorn_iters,
                spectral_norm, spectral_target, spectral_iters, base_width, width_exponent, lr_wide=None):
    """The step in PyTorch ops (CPU, float64, and the sinkgd_sharded_fused setting off): chunked passes over the
    local rows, the collectives of _reduce_groups. Each matrix's arithmetic in its _Mat.dt (a float64
    matrix's with ``lr_wide``, the lr in float64)."""
    from .._library import TRITON_DEVICES

    dev = mats[0].w.device
    for mat in mats:
        mat.init_scales()
    for _ in range(sinkhorn_iters):
        parts = _reduce_groups(mats, [_row_pass(mat, eps) for mat in mats])
        for mat, col in zip(mats, parts):
            mat.c = (mat.c * math.sqrt(mat.info.m) / col.sqrt().clamp_min(eps)).clamp_max(SCALE_MAX)
    scales = [None] * len(mats)
    if spectral_norm:
        for _ in range(spectral_iters):
            parts = []
            for mat in mats:
                u = _mv(mat, mat.c * mat.v)
                w = mat.c * _mv_t(mat, u)
                parts.append(torch.cat([w, u.square().sum(1, keepdim=True)], dim=1))
            parts = _reduce_groups(mats, parts)
            for k, (mat, part) in enumerate(zip(mats, parts)):
                w = part[:, :-1] / part[:, -1:].sqrt().clamp_min(eps)
                target = 1.0 if spectral_target == "unit" else math.sqrt(mat.info.m / mat.info.n)
                v, scales[k] = spectral_vector_and_scale(w, w.norm(dim=1), target, eps)
                mat.v.copy_(v)
    for k, mat in enumerate(mats):
        info = mat.info
        fac = lr_scale * ((base_width / info.n) ** width_exponent if base_width is not None else 1.0)
        # fp32 (the scalar rounded to fp32), as the kernel's lr * fac; float64 for a float64 matrix
        eta = (lr_d if mat.dt == torch.float32 else lr_wide) * fac
        coef_x = eta.expand(info.b_loc) if scales[k] is None else eta * scales[k]
        coef_w = eta * float(weight_decay)
        seed = None
        salt = salts[mat.index]
        if (stochastic_round and mat.w.dtype == torch.bfloat16 and mat.g.dtype != torch.float64
                and dev.type in TRITON_DEVICES and salt is not None):
            seed = sr_seed(step.to(dev), salt)
        _update(mat, coef_x, coef_w, seed)


# On a Triton device the step runs the single-device op's kernels on the local rows (ops/sinkgd/launch.py
# ``launch_sharded``), with the all-reduces between their launches; the sinkgd_sharded_fused
# setting off (TORCH_FUSED_SINKGD_SHARDED_FUSED=0) keeps the PyTorch ops everywhere.

_PLANS = SinkGDCache(cuda_graphs=False)  # the fused path's plans (no graphs: collectives run between launches)


def _fused_step(mats, salts, lr_d, step, stochastic_round, *, lr_scale, weight_decay, eps, sinkhorn_iters,
                spectral_norm, spectral_target, spectral_iters, base_width, width_exponent):
    """The step through the fused kernels: one plan per (param dtype, grad dtype), every
    matrix's finished column sums (and per power iteration its |u|^2 sums) in one fp32 buffer
    laid out the same on every rank from the global shapes: first, per process group, the
    row-split matrices' column sums then their |u|^2 sums (the region its all-reduces cover),
    then the whole matrices' (local: a batch shard, Replicate())."""
    regions: dict = {}  # group name -> [start, end of the column sums, end]
    layout: dict = {}  # mat position -> (S_OFF, SU_OFF)
    at = 0
    names = list(dict.fromkeys(mat.info.group_name for mat in mats if mat.info.kind == "rows"))
    for name in names:
        idx = [k for k, mat in enumerate(mats) if mat.info.kind == "rows" and mat.info.group_name == name]
        start = at
        for k in idx:
            layout[k] = [at]
            at += mats[k].info.b_loc * mats[k].info.n
        cols_end = at
        for k in idx:
            layout[k].append(at)
            at += mats[k].info.b_loc
        regions[name] = (start, cols_end, at)
    for k, mat in enumerate(mats):
        if mat.info.kind != "rows":
            layout[k] = [at, at + mat.info.b_loc * mat.info.n]
            at = layout[k][1] + mat.info.b_loc
    groups: dict = {}
    for k, mat in enumerate(mats):
        groups.setdefault((mat.w.dtype, mat.g.dtype), []).append(k)
    work = []
    for (wdt, _), idx in groups.items():
        shard = []
        for k in idx:
            info = mats[k].info
            salt = salts[mats[k].index]
            eoff = (info.b_off * info.m + info.row_off) * info.n  # the local block's first element
            s_off, su_off = layout[k]
            shard.append(dict(MG=info.m, EOFF=eoff, SALT=0 if salt is None else salt, S_OFF=s_off, SU_OFF=su_off))
        vecs = [mats[k].v for k in idx] if spectral_norm else []
        stochastic = bool(stochastic_round) and wdt == torch.bfloat16
        work.append(([mats[k].w for k in idx], [mats[k].g for k in idx], vecs, tuple(shard), stochastic))

    def reduce(sums, spectral):
        for name, (start, cols_end, end) in regions.items():
            part = sums[start:end if spectral else cols_end]
            part.copy_(_all_reduce(part, name))

    launch_sharded(work, at, reduce, lr=lr_d, lr_scale=lr_scale, weight_decay=weight_decay, eps=eps,
                   iters=sinkhorn_iters, spectral_norm=spectral_norm, spectral_target=spectral_target,
                   spectral_iters=spectral_iters, base_width=base_width, width_exponent=width_exponent,
                   seed=step, cache=_PLANS)


def warm_start_is_sharded(p) -> bool:
    """Whether DTensor ``p``'s warm-start vectors are sharded like it (a Shard(0) batch of
    matrices) rather than a plain tensor replicated on every rank."""
    pl = p.placements[0] if p.device_mesh.ndim == 1 else None
    return pl is not None and pl.is_shard() and p.dim() >= 3 and pl.dim % p.dim() == 0


def shard_like(full: torch.Tensor, p):
    """``full`` (the same on every rank, dim 0 the batch dim of DTensor ``p``) as a DTensor
    with ``p``'s mesh and placements, each rank keeping its slice (no collective)."""
    from torch.distributed.tensor import DTensor

    local_shape, off = _local_offset(full, p.device_mesh, tuple(p.placements))
    local = full.narrow(0, off[0], local_shape[0]).clone()
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=full.shape,
                              stride=full.stride())
