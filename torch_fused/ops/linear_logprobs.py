"""The fused lm_head: ``fused::linear_logprobs_and_entropy``.

Log-probs at ``index`` and the entropy of ``softmax(z / T)``, z = softcap(logit_scale *
(hidden @ weight.T + bias)), without ever holding the [N, V] logits:

- Triton path, bf16 / fp16 weights without a softcap (the ``lm_head_fused_gemm`` setting): the logits never reach
  memory. Each GEMM tile z = hidden[rows] @ weight[cols]^T (fp32 accumulation; operands read
  by TMA on Hopper and later, one persistent program per multiprocessor) is consumed in its
  kernel's epilogue (kernels/lm_head.py). Forward: the tile's row statistics (max, sum of
  exponentials, entropy sum, the indexed logits), folded over the column tiles here.
  With more ids per row than the ``lm_head_epilogue_ids`` setting (a top-k teacher's k ids),
  the epilogues leave the ids out and a side kernel computes each id's logit as one dot product
  of its hidden row and weight row: its log-prob in the forward; in the backward its d logit,
  once for the call, written over each chunk's d logits at the id's column.
  Backward: the tile's d logits from the whole rows' statistics, stored once in the weight's
  dtype into a vocabulary chunk [N, v] (the ``lm_head_chunk_bytes`` setting, of fp32, so v is twice as wide in
  bf16) that the d weight and d hidden GEMMs (cuBLAS) read: the logits never make a round trip
  through memory in fp32 (``python -m torch_fused.bench --sweep --only lm_head`` compares it
  with cuBLAS GEMMs into fp32 chunks; figures in docs/BENCHMARKS.md).
- Otherwise, forward: vocabulary chunks over all N tokens (a token chunk would re-read the
  whole weight per chunk, which makes the forward memory-bound on the weight at large V). Each chunk's logits [N, v] come from one GEMM with fp32 output
  (``torch.mm(..., out_dtype=torch.float32)`` on CUDA) and go through one kernel
  (kernels/logprobs.py, _chunk_merge_kernel) that folds the chunk's row statistics (max, sum
  of exponentials, entropy sum, the indexed logit) into running ones, as the log-prob kernels
  fold their tile rows. Saved for the backward: the row max and log2 of the sum (the
  kernels' stats) and the entropy, O(N).
- Otherwise, backward: vocabulary chunks over all N tokens. A chunk's logits [N, v] are
  recomputed and the log-prob backward kernel turns them into d logits (rounded once to the
  weight's dtype, as a materialized path rounds them; on the Triton path written over their
  own fp32 chunk) with the whole rows' statistics.
- Both: d weight[v0:v1] = d logits^T @ hidden is one GEMM over all tokens, finished in one
  pass with fp32 accumulation inside the GEMM (no fp32 [V, H] accumulator); d hidden +=
  d logits @ weight[v0:v1] accumulates in an fp32 [N, H] buffer. A gradient autograd does not
  need (a frozen head's weight, the hidden states of a detached input) is not computed: no
  d weight GEMM, or no d hidden GEMM.
- ``logit_scale`` folds into the temperature (T / logit_scale) unless a softcap is set; the
  softcap c tanh(y / c) is applied to the fp32 chunk, and its derivative 1 - tanh^2 to d z.

Extra memory is the chunk buffer (the ``lm_head_chunk_bytes`` setting) plus the fp32 d hidden accumulator, and on
the fused path the forward's tile statistics (``lm_head_part_bytes`` at most). The same driver runs the
Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1) and the plain-PyTorch reference (every
other device).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from .._library import (INTERPRET, LIB, LN2, LOG2E, NAMESPACE, TRITON_DEVICES, acc_dtype, exact_shift, no_forward_mode,
                        kernel_temperature, new_output, traced_constants, under_forward_settings)
from .. import reference
from ..meta import linear_logprobs as meta
from ..meta.logprobs import LogprobOptions
from ..meta.logprobs import row_shape
from . import logprobs as lp_ops
from ..settings import current as settings

_FWD = f"{NAMESPACE}::_linear_logprobs_entropy_forward"
_BWD = f"{NAMESPACE}::_linear_logprobs_entropy_backward"

# The defaults of the lm_head_* settings (torch_fused/settings.py), and why.
# lm_head_chunk_bytes: bytes of chunk buffers per device type: fp32 logits [N, v] (on CUDA the backward writes d
# logits over them; elsewhere it takes a second buffer). On CUDA, 128 MiB keeps the extra memory
# at N = 8192, H = 4096, V = 151936 (chunk plus the 128 MiB d hidden accumulator) under an
# eighth of the bf16 logits (297 MiB).
# lm_head_min_cols: narrowest vocabulary chunk on CUDA. Every backward chunk reads and writes the fp32 [N, H] d
# hidden accumulator once, so narrow chunks cost that traffic many times over (N = 16384,
# H = 3584: 470 MB a chunk); at very many tokens the chunks grow past the budget instead
# (N = 32768: 2048 columns, 256 MiB).
# lm_head_dlogits_min_cols: the same for the fused backward's w.dtype d logits chunks, which hold no fp32
# logits: from 16384 tokens on its budget would give fewer than 8192 columns, and the d hidden
# traffic of the extra chunks cost more than the larger chunk (bf16: 256 MiB at N = 16384,
# 512 MiB at N = 32768; the budget's 8192 columns at N = 8192 are unchanged). The lm_head sweep
# (python -m torch_fused.bench --sweep --only lm_head; benchmarks/results/sweep_lm_head.json)
# compares 8192 columns with 2048.
# lm_head_fused_gemm: the passes ("forward", "backward") whose logits GEMMs run inside the Triton kernels
# (kernels/lm_head.py) for bf16 / fp16 weights without a softcap; the others: cuBLAS GEMMs
# into fp32 chunks, then the statistics / d logits kernels.
# lm_head_tma: the fused GEMMs' operands read through TMA on Hopper and later (see _use_tma).
# lm_head_part_bytes: bytes of the forward's per-tile statistics (3 floats per row and column
# tile) per launch.

_HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.addmm, "dtype_out")


def _chunk_cols(device: torch.device, n: int, bytes_per_elem: int, budget=None, min_cols: int = 1,
                invariant: bool = False) -> int:
    """Vocabulary columns per chunk for n tokens: the budget's (default: the lm_head_chunk_bytes setting), at
    least min_cols, in multiples of 128. ``invariant`` (the batch-invariant head): min_cols, or 128
    without one, whatever n is: a chunk's width decides the order of a row's sums."""
    if invariant:
        return max(min_cols, 128)
    budget = settings.lm_head_chunk_bytes if budget is None else budget
    step = max(1, budget.get(device.type, budget["cpu"]) // (bytes_per_elem * n), min_cols)
    return step - step % 128 if step > 128 else step


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 (or fp64) output and accumulation; a and b share a dtype. On CUDA the
    GEMM reads bf16/fp16 operands as they are; elsewhere (a reference path) they are upcast."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    if a.is_cuda and _HAS_MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool = False) -> None:
    """acc += a @ b (first: acc = a @ b, acc never read), acc fp32 (or fp64): on CUDA one GEMM
    that writes or adds into acc in place."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _HAS_MM_OUT_DTYPE:
        if first and hasattr(torch.ops.aten.mm, "dtype_out"):
            torch.ops.aten.mm.dtype_out(a, b, torch.float32, out=acc)
        elif first:
            acc.copy_(torch.mm(a, b, out_dtype=torch.float32))
        else:
            torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
    elif first:
        acc.copy_(_mm_f32(a, b))
    else:
        acc += _mm_f32(a, b)


def _invariant(path, *tensors) -> bool:
    """Whether this call's GEMMs run in the batch-invariant Triton GEMM (kernels/lm_head.py
    _matmul_kernel): the lm_head_batch_invariant setting, on the Triton path, for 16-bit and
    fp32 operands (float64 keeps cuBLAS)."""
    return (path.triton and settings.lm_head_batch_invariant
            and all(t.dtype in (torch.bfloat16, torch.float16, torch.float32) for t in tensors))


def _matmul_into(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """c (+)= a @ b in the batch-invariant Triton GEMM: c fp32 [M, N] with unit column stride, a
    [M, K] and b [K, N] of one dtype, any strides (operands in another dtype are cast)."""
    from ..kernels import lm_head as K

    if b.dtype != a.dtype:
        b = b.to(a.dtype)
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return
    if k == 0:
        if not accumulate:
            c.zero_()
        return
    wide = a.dtype == torch.float32
    bm, bn, bk, gm, warps, stages = _tiles("matmul32" if wide else "matmul", a.device)
    grid = (-(-m // bm) * -(-n // bn),)
    K._matmul_kernel[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
                           ACCUMULATE=accumulate, UPCAST=INTERPRET, IEEE=wide, PROMOTE=settings.lm_head_promote,
                           BM=bm, BN=bn, BK=bk, GROUP_M=gm, num_warps=warps, num_stages=stages)


def _gemm_operands(weight, h2, reference_path):
    """(weight, hidden rows) as the GEMMs read them: as they are, except that the CPU reference
    path upcasts bf16/fp16 once (its GEMMs would otherwise upcast per chunk)."""
    if reference_path and not weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16):
        return weight.float(), h2.float()
    return weight, h2


def _rows(hidden, index, shift):
    """hidden [..., L(+1), H] -> [N, H] rows (contiguous; a copy of the hidden states at most) and
    index -> [N] or [N, K]."""
    if shift:
        hidden = hidden[..., :-1, :]
    h = hidden.shape[-1]
    h2 = hidden.reshape(-1, h).contiguous()
    n = h2.shape[0]
    idx2 = index.reshape(n, index.shape[-1]) if index.dim() == hidden.dim() else index.reshape(n)
    return h2, idx2


def _logits_chunk(h2, w, bias, opts, invariant=False):
    """fp32 logits z of rows h2 against vocabulary rows w, one chunk buffer. With a softcap,
    z = c tanh(s y / c), computed in place (the backward's tanh is z / c); otherwise z = y (the
    scale is folded into the temperature by the caller). ``invariant``: the batch-invariant GEMM."""
    if invariant:
        z = torch.empty(h2.shape[0], w.shape[0], dtype=torch.float32, device=h2.device)
        _matmul_into(z, h2, w.t(), accumulate=False)
    else:
        z = _mm_f32(h2, w.t())
    if bias is not None:
        z += bias.to(z.dtype)
    if opts.softcap is not None:
        z.mul_(opts.logit_scale / opts.softcap).tanh_().mul_(opts.softcap)
    return z


def effective_temperature(opts: meta.HeadOptions) -> float:
    """The temperature the statistics kernels divide the chunk's logits by: T / logit_scale (the scale
    folded in), or T with a softcap (the chunk already holds the scaled, capped logits)."""
    t = opts.temperature
    return kernel_temperature(t if opts.softcap is not None else t / opts.logit_scale)


def _merge_reference(z, idx2, v0, first, run, u, m_own, t_eff, c):
    """Fold one chunk of logits z [N, v] (ids v0 ..) into the running row statistics run [N, 3] =
    (max m, s = sum 2^d, t = sum 2^d d against the shift m c) and, for the ids inside the chunk,
    u = their d against the chunk's shift and m_own = the chunk's max: the reference of
    kernels/logprobs.py's _chunk_merge_kernel."""
    loc = idx2 - v0
    inside = (loc >= 0) & (loc < z.shape[1])
    lp_c, ent_c, st_c = reference.logprobs_entropy_forward(z, torch.where(inside, loc, 0), None,
                                                           LogprobOptions(t_eff, -1, True, False))
    m_c, l2s_c = st_c[:, 0], st_c[:, 1]
    s_c = torch.exp2(l2s_c)
    t_c = torch.where(s_c > 0, s_c * (l2s_c - ent_c * (1.0 / LN2)), torch.zeros_like(s_c))
    u.copy_(torch.where(inside, lp_c * (1.0 / LN2) + l2s_c[:, None], u))
    m_own.copy_(torch.where(inside, m_c[:, None].expand_as(m_own), m_own))
    if first:
        run[:, 0], run[:, 1], run[:, 2] = m_c, s_c, t_c
        return
    # the running statistics and the chunk's as two parts of the row (a side with s == 0, only
    # -inf logits so far, holds the placeholder max 0: it neither sets the max nor weighs)
    parts = torch.stack([run, torch.stack([m_c, s_c, t_c], 1)], 2)  # [N, 3, 2]
    m_new, s_new, t_new, _, _ = lp_ops.merge_row_stats(parts[:, 0], parts[:, 1], parts[:, 2], c, True, 1)
    run[:, 0], run[:, 1], run[:, 2] = m_new, s_new, t_new


def _merge_triton(z, idx2, v0, first, run, u, m_own, t_eff, c):
    if run.dtype == torch.float64:
        return _merge_reference(z, idx2, v0, first, run, u, m_own, t_eff, c)
    from ..kernels import logprobs as K

    n, v = z.shape
    k = idx2.shape[1]
    block_v, warps = K.pick_block(v, 4, "fwd_ent")
    K._chunk_merge_kernel[(n,)](
        z, idx2, run, u, m_own, v, k, z.stride(0), v0, int(first), c,
        EXACT_SHIFT=exact_shift(c), BLOCK_V=block_v, BLOCK_K=max(2, K.triton.next_power_of_2(k)), EPT=4,
        num_warps=warps,
    )


def _fused_gemm(which: str, path, w, opts) -> bool:
    """Whether the logits GEMMs of pass ``which`` ("forward" / "backward") run inside the Triton
    kernels (kernels/lm_head.py): on the Triton path, for bf16 / fp16 weights without a softcap,
    where the ``lm_head_fused_gemm`` setting names the pass."""
    return (path.triton and which in settings.lm_head_fused_gemm and opts.softcap is None
            and w.dtype in (torch.bfloat16, torch.float16)
            and _tiles("stats" if which == "forward" else "dlogits", w.device) is not None)


def _has_tensor_descriptors() -> bool:
    global _TENSOR_DESCRIPTORS
    if _TENSOR_DESCRIPTORS is None:
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

            _TENSOR_DESCRIPTORS = True
        except ImportError:  # an older Triton: the pointer-load kernels
            _TENSOR_DESCRIPTORS = False
    return _TENSOR_DESCRIPTORS


_TENSOR_DESCRIPTORS = None


def _use_tma(h2, w) -> bool:
    """TMA operand loads (kernels/lm_head.py, the *_tma kernels): on a CUDA device of compute
    capability 9 or more (not under the interpreter), with a Triton that has tensor
    descriptors, unit last strides and 16-byte aligned rows and bases."""
    es = h2.element_size()
    return (settings.lm_head_tma and h2.is_cuda and not INTERPRET and torch.cuda.get_device_capability(h2.device)[0] >= 9
            and h2.stride(-1) == 1 and w.stride(-1) == 1
            and (h2.stride(0) * es) % 16 == 0 and (w.stride(0) * es) % 16 == 0 and (h2.shape[1] * es) % 16 == 0
            and h2.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and _has_tensor_descriptors())


def _smem_limit(device) -> int | None:
    """Shared memory per block a kernel may opt into on ``device`` (None off CUDA)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def _tiles(kernel, device):
    """kernels/lm_head.py's tiles for ``kernel`` on ``device`` (None: none fits its shared memory)."""
    from ..kernels import lm_head as K

    return K.pick_config(kernel, _smem_limit(device), settings.lm_head_promote)


def _launch_args(h2, w, kernel):
    from ..kernels import lm_head as K

    bm, bn, bk, gm, warps, stages = _tiles(kernel, h2.device)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    return K, h2, w, dict(BM=bm, BN=bn, BK=bk, GROUP_M=gm, num_warps=warps, num_stages=stages)


def _ids_in_epilogue(k: int) -> bool:
    """Whether the fused GEMMs' epilogues take a row's k ids themselves (else _ids_side does)."""
    return k <= settings.lm_head_epilogue_ids


def _ids_side(h2, w, bias, ids, coef, v_lo, c, g=None):
    """kernels/lm_head.py _ids_kernel over every row: [N, K] fp32, each id's d = z c - m c
    against the row max coef[0] (forward), or with g (backward) its d logit, which
    _scatter_ids writes into each chunk (ids of w: v_lo ..; others 0.0)."""
    from ..kernels import lm_head as K

    n, k = ids.shape
    out = torch.empty(n, k, dtype=torch.float32, device=h2.device)
    if n == 0 or k == 0:
        return out
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    small = settings.small_tiles
    block_k = 2 if small else min(16, max(2, K.triton.next_power_of_2(k)))
    K._ids_kernel[(n * -(-k // block_k),)](
        h2, w, bias.contiguous() if bias is not None else w, ids, g if g is not None else coef, coef, out,
        n, k, h2.shape[1], w.shape[0], h2.stride(0), w.stride(0), v_lo, c,
        HAS_BIAS=bias is not None, DLOGITS=g is not None, EXACT_SHIFT=exact_shift(c), BLOCK_K=block_k,
        BLOCK_H=16 if small else 128, BLOCK_J=2 if small else 64, num_warps=1 if small else 4)
    return out


def _scatter_ids(vals, ids, dz, v_lo):
    """The ids' d logits vals [N, K] (_ids_side) of the chunk's columns (ids v_lo ..) into dz."""
    from ..kernels import lm_head as K

    nk = ids.numel()
    if nk:
        block = 64 if settings.small_tiles else 1024
        K._scatter_ids_kernel[(-(-nk // block),)](vals, ids, dz, nk, ids.shape[1], dz.shape[1], dz.stride(0), v_lo,
                                                   BLOCK=block)


def _forward_fused_gemm(h2, w, bias, ids, run, u, m_own, c):
    """run, u and m_own of the whole rows (as the chunk merges leave them) from the GEMM-tile
    statistics of kernels/lm_head.py, folded over the column tiles here; rows in launches whose
    partials stay under the lm_head_part_bytes setting. Ids the epilogues leave out
    (_ids_in_epilogue): u and m_own are not used (the caller passes empty ones)."""
    tma = _use_tma(h2, w)
    K, h2, w, cfg = _launch_args(h2, w, "stats_tma" if tma else "stats")
    n, hd = h2.shape
    v, k = w.shape[0], ids.shape[1]
    if not _ids_in_epilogue(k):
        k = 0  # the kernels' id loop runs no step; ids, and run for u and m_own, stay valid pointers
        u = m_own = run
    nt = -(-v // cfg["BN"])
    rows = max(cfg["BM"], settings.lm_head_part_bytes // (12 * nt) // cfg["BM"] * cfg["BM"])
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        sms = torch.cuda.get_device_properties(h2.device).multi_processor_count
        d_w = TensorDescriptor.from_tensor(w, [cfg["BN"], cfg["BK"]])
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        part = torch.empty(3, r1 - r0, nt, dtype=torch.float32, device=h2.device)
        tiles = -(-(r1 - r0) // cfg["BM"]) * nt
        b_ptr = bias.contiguous() if bias is not None else w  # the kernels read it at unit stride
        if tma:
            K._lm_head_stats_tma_kernel[(min(sms, tiles),)](
                TensorDescriptor.from_tensor(h2[r0:r1], [cfg["BM"], cfg["BK"]]), d_w, b_ptr, ids[r0:r1], part,
                u[r0:r1], m_own[r0:r1], r1 - r0, v, hd, k, nt, 0, c,
                HAS_BIAS=bias is not None, EXACT_SHIFT=exact_shift(c), NUM_SMS=sms,
                PROMOTE=settings.lm_head_promote, **cfg)
        else:
            K._lm_head_stats_kernel[(tiles,)](
                h2[r0:r1], w, b_ptr, ids[r0:r1], part, u[r0:r1], m_own[r0:r1],
                r1 - r0, v, hd, k, h2.stride(0), w.stride(0), nt, 0, c,
                HAS_BIAS=bias is not None, EXACT_SHIFT=exact_shift(c),
                PROMOTE=settings.lm_head_promote, **cfg)
        if settings.lm_head_batch_invariant:
            # the tiles' statistics folded per row, in the row's own order (a torch reduction
            # chooses its split from the number of rows)
            K._tile_merge_kernel[(r1 - r0,)](part, run[r0:r1], nt, (r1 - r0) * nt, run.stride(0), c,
                                             EXACT_SHIFT=exact_shift(c), BLOCK_T=K.MERGE_BLOCK_T)
        else:
            m_t, s_t, t_t = part.unbind(0)  # per row and vocabulary tile
            m, s_row, t_row, _, _ = lp_ops.merge_row_stats(m_t, s_t, t_t, c, lp_ops.shift_is_exact(True, m_t.dtype, c), 1)
            run[r0:r1, 0], run[r0:r1, 1], run[r0:r1, 2] = m, s_row, t_row


def _dlogits_coefficients(glp, gh, idx2, st2, ent2, t_eff, ignore_index, v_total, sum_in_kernel):
    """Per row (m, log2 s, a, b) as a [4, N] fp32 tensor, and the ids' scaled log-prob
    gradients [N, K] (None without glp), as _logprobs_entropy_backward_kernel forms them;
    ``sum_in_kernel``: a leaves out the sum of the ids' gradients, which the d logits kernel adds
    in id order (the batch-invariant head)."""
    n = st2.shape[0]
    it = 1.0 / t_eff
    coef = torch.empty(4, n, dtype=torch.float32, device=st2.device)
    coef[0], coef[1] = st2[:, 0], st2[:, 1]
    a = torch.zeros(n, dtype=torch.float32, device=st2.device)
    g = None
    if glp is not None:
        ids = idx2.reshape(n, -1)
        g = glp.reshape(ids.shape).float()
        g = torch.where(ids == ignore_index, torch.zeros_like(g), g)
        bad = (ids != ignore_index) & ((ids < 0) | (ids >= v_total))
        g = torch.where(bad, torch.full_like(g, float("nan")), g)  # an out-of-range id: NaN row
        if not sum_in_kernel:  # (else their sum joins a in the kernel, _dlogits_epilogue: SUM_G)
            a = a + g.sum(1)
        g = g * it
    b = torch.zeros_like(a)
    if gh is not None:
        a = a + gh.float() * ent2.float()
        b = gh.float() * traced_constants()[1]  # LN2 (a literal: the vocabulary-parallel backward is traced by Dynamo)
    coef[2], coef[3] = a * it, b * it
    return coef, g


def _dlogits_fused_gemm(h2, w, bias, ids, g, coef, dz, v_off, c, id_dz=None):
    """d logits of vocabulary rows w (ids v_off ..) into dz [N, v], from the GEMM tiles; id_dz (the
    ids' d logits from _ids_side, where the epilogues leave the ids out) written over them."""
    tma = _use_tma(h2, w)
    K, h2, w, cfg = _launch_args(h2, w, "dlogits_tma" if tma else "dlogits")
    n, hd = h2.shape
    v = w.shape[0]
    nt = -(-v // cfg["BN"])
    tiles = -(-n // cfg["BM"]) * nt
    k = ids.shape[1]
    in_epilogue = _ids_in_epilogue(k)
    args = (bias.contiguous() if bias is not None else w, ids, g if g is not None else coef, coef, dz)
    flags = dict(HAS_BIAS=bias is not None, HAS_GLP=g is not None and in_epilogue, EXACT_SHIFT=exact_shift(c),
                 PROMOTE=settings.lm_head_promote,
                 SUM_G=g is not None and in_epilogue and settings.lm_head_batch_invariant, **cfg)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        sms = torch.cuda.get_device_properties(h2.device).multi_processor_count
        K._lm_head_dlogits_tma_kernel[(min(sms, tiles),)](
            TensorDescriptor.from_tensor(h2, [cfg["BM"], cfg["BK"]]), TensorDescriptor.from_tensor(w, [cfg["BN"], cfg["BK"]]),
            *args, n, v, hd, k, dz.stride(0), nt, v_off, c, NUM_SMS=sms, **flags)
    else:
        K._lm_head_dlogits_kernel[(tiles,)](
            h2, w, *args, n, v, hd, k, h2.stride(0), w.stride(0), dz.stride(0), nt, v_off, c, **flags)
    if id_dz is not None:
        _scatter_ids(id_dz, ids, dz, v_off)


def _forward_impl(hidden, weight, index, bias, opts, path):
    meta.check_linear(hidden, weight, index, bias, opts)
    dt = acc_dtype(hidden.dtype)
    lead = row_shape(hidden, opts.shift)
    logp = new_output(index.shape, dt, hidden.device)
    ent = new_output(lead, dt, hidden.device)
    stats = new_output(tuple(lead) + (opts.stats_width(weight.shape[0]),), dt, hidden.device)
    h2, idx2 = _rows(hidden, index, opts.shift)
    n, v = h2.shape[0], weight.shape[0]
    if n == 0:
        return logp, ent, stats
    if not path.triton and hidden.device.type == "cpu":
        reference.check_index_range(idx2, v, opts.ignore_index)
    w, h2 = _gemm_operands(weight, h2, not path.triton)
    invariant = _invariant(path, h2, w)
    if opts.restricts_support():
        _support_forward(h2, w, idx2, bias, opts, path, invariant, logp.view(idx2.shape), ent.view(n),
                         stats.view(n, stats.shape[-1]))
        return logp, ent, stats
    t_eff = effective_temperature(opts)
    c = LOG2E / t_eff
    step = _chunk_cols(hidden.device, n, 4, min_cols=settings.lm_head_min_cols.get(hidden.device.type, 1),
                       invariant=invariant)
    ids = idx2.reshape(n, -1).contiguous()
    run = torch.empty(n, 3, dtype=dt, device=hidden.device)
    fused = _fused_gemm("forward", path, w, opts) and h2.dtype == w.dtype
    side = fused and not _ids_in_epilogue(ids.shape[1])  # the ids beside the epilogues: no u, m_own
    u = torch.zeros((n, 0) if side else ids.shape, dtype=dt, device=hidden.device)
    m_own = torch.zeros_like(u)
    if fused:
        _forward_fused_gemm(h2, w, bias, ids, run, u, m_own, c)
    else:
        for v0 in range(0, v, step):
            v1 = min(v, v0 + step)
            z = _logits_chunk(h2, w[v0:v1], bias[v0:v1] if bias is not None else None, opts, invariant)
            path.merge(z, ids, v0, v0 == 0, run, u, m_own, t_eff, c)
            del z
    m, s_run, t_run = run.unbind(1)
    log2s = torch.log2(s_run)
    stats.view(n, 2)[:, 0] = m
    stats.view(n, 2)[:, 1] = log2s
    ent.view(n).copy_((log2s - t_run / s_run) * LN2)
    if side:  # the ids' d against the rows' max, from their own dot products
        lp = (_ids_side(h2, w, bias, ids, torch.stack((m, log2s)), 0, c) - log2s[:, None]) * LN2
    else:
        exact = lp_ops.shift_is_exact(path.triton, dt, c)
        lp = (u + lp_ops.shift_difference(m_own, m[:, None], c, exact) - log2s[:, None]) * LN2
    lp = torch.where((ids >= 0) & (ids < v), lp, torch.full_like(lp, float("nan")))
    logp.view(ids.shape).copy_(torch.where(ids == opts.ignore_index, torch.zeros_like(lp), lp))
    return logp, ent, stats


def _backward_impl(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy, opts, hidden_grad,
                   weight_grad, path):
    meta.check_linear(hidden, weight, index, bias, opts)
    chunks = _support_backward if opts.restricts_support() else backward_chunks
    dh, dw, db = chunks(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy, opts, path,
                        hidden_grad=hidden_grad, weight_grad=weight_grad)
    return (hidden_grad_from_rows(dh, hidden, opts.shift) if hidden_grad else hidden.new_empty(0)), dw, db


def backward_chunks(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy, opts, path, *, v_off=0,
                    v_total=None, hidden_grad=True, weight_grad=True):
    """(d hidden rows [N, H] in fp32 (fp64 for fp64), d weight, d bias) from vocabulary chunks.
    The weight's rows may be ids v_off .. of a vocabulary of v_total (the vocabulary-parallel
    head, torch_fused/parallel.py: stats and entropy of the whole rows, index the global ids);
    d hidden is then this slice's part of the sum. Without ``hidden_grad`` (``weight_grad``),
    d hidden (d weight) is an empty tensor and its GEMMs are skipped."""
    dw = (torch.empty_like(weight, memory_format=torch.contiguous_format) if weight_grad
          else weight.new_empty(0))
    db = torch.empty(bias.shape if bias is not None else (0,), dtype=hidden.dtype, device=hidden.device)
    h2, idx2 = _rows(hidden, index, opts.shift)
    n, v = h2.shape[0], weight.shape[0]
    v_total = v if v_total is None else v_total
    ignore_index, softcap = opts.ignore_index, opts.softcap
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    dh = torch.empty(n if hidden_grad else 0, h2.shape[1], dtype=acc, device=hidden.device)
    if n == 0 or v == 0 or (grad_logp is None and grad_entropy is None):
        dh.zero_()
        dw.zero_()
        db.zero_()
        return dh, dw, db
    w, hm = _gemm_operands(weight, h2, not path.triton)
    t_eff = effective_temperature(opts)
    st2 = stats.reshape(n, 2)
    ent2 = entropy.reshape(n)
    glp = grad_logp.reshape(idx2.shape) if grad_logp is not None else None
    gh = grad_entropy.reshape(n) if grad_entropy is not None else None
    glp, idx2, bad_rows = _contain_bad_ids(glp, idx2, ignore_index, v_total)
    dev = hidden.device
    fused = _fused_gemm("backward", path, w, opts) and hm.dtype == w.dtype
    if fused:  # d logits straight from the GEMM tiles: one w.dtype chunk buffer
        ids = idx2.reshape(n, -1).contiguous()
        c = traced_constants()[0] / t_eff  # LOG2E, as above
        sum_in_kernel = settings.lm_head_batch_invariant
        coef, g_ids = _dlogits_coefficients(glp, gh, idx2, st2, ent2, t_eff, ignore_index, v_total, sum_in_kernel)
        id_dz = None
        if g_ids is not None and not _ids_in_epilogue(ids.shape[1]):
            if sum_in_kernel:  # the epilogues leave the ids out: their gradients join a here, in id order
                from ..kernels import lm_head as KL

                KL._add_id_grads_kernel[(-(-n // 128),)](coef, g_ids, n, ids.shape[1], BLOCK_R=128)
            # the ids' d logits: computed once, written into each chunk
            id_dz = _ids_side(hm, w, bias, ids, coef, v_off, c, g=g_ids)
    # Triton path, bf16 / fp16: d logits written over their own fp32 logits chunk
    in_place = path.triton and softcap is None and w.dtype in (torch.bfloat16, torch.float16)
    invariant = _invariant(path, hm, w)
    step = _chunk_cols(dev, n, w.element_size() if fused else 4 if in_place else 4 + w.element_size(),
                       min_cols=(settings.lm_head_dlogits_min_cols if fused else settings.lm_head_min_cols).get(dev.type, 1),
                       invariant=invariant)
    for v0 in range(0, v, step):
        v1 = min(v, v0 + step)
        b_c = bias[v0:v1] if bias is not None else None
        if fused:
            dz = torch.empty(n, v1 - v0, dtype=w.dtype, device=dev)
            _dlogits_fused_gemm(hm, w[v0:v1], b_c, ids, g_ids, coef, dz, v_off + v0, c, id_dz)
        else:
            z = _logits_chunk(hm, w[v0:v1], b_c, opts, invariant)
            if in_place:
                # row r's w.dtype values in the first bytes of row r's fp32 values (no second
                # chunk-sized buffer)
                dz = z.view(w.dtype)[:, :v1 - v0]
                path.backward(glp, gh, z, idx2, st2, ent2, t_eff, ignore_index, v_off=v_off + v0, v_total=v_total,
                              out=dz)
            else:
                dz, _ = path.backward(glp, gh, z, idx2, st2, ent2, t_eff, ignore_index, v_off=v_off + v0,
                                      v_total=v_total, out_dtype=z.dtype if softcap is not None else w.dtype)
            if softcap is not None:  # d y = d z * s (1 - tanh^2), tanh = z / c, in fp32
                dz = dz.mul_(z.div_(softcap).square_().neg_().add_(1.0)).mul_(opts.logit_scale).to(w.dtype)
            del z
        if weight_grad:
            torch.mm(dz.t(), hm, out=dw[v0:v1]) if dw.dtype == dz.dtype else dw[v0:v1].copy_(dz.t() @ hm)
        if hidden_grad and invariant and dh.dtype == torch.float32:
            _matmul_into(dh, dz, w[v0:v1], accumulate=v0 != 0)
        elif hidden_grad:
            _addmm_f32_(dh, dz, w[v0:v1], first=v0 == 0)
        if bias is not None:
            db[v0:v1] = dz.sum(0, dtype=acc).to(db.dtype)
        del dz  # (on CUDA it holds the chunk's memory: free it before the next chunk's GEMM)
    if bad_rows is not None and hidden_grad:
        dh.masked_fill_(bad_rows[:, None], float("nan"))
    return dh, dw, db


def _contain_bad_ids(glp, idx2, ignore_index, v_total):
    """(upstream log-prob gradient, ids, rows holding a bad id or None) for the backward. An id
    outside the vocabulary (NaN forward; no check on the device: it would sync) makes its row's d
    hidden NaN, as the logits ops' d logits row: the d logits use the row as if the id were
    ignore_index, so d weight and d bias, which sum over every row, stay finite. On the CPU the
    forward raises IndexError first, except in a vocabulary-parallel call that torch.compile traces
    (parallel._checks_index), which then gives these same NaNs."""
    if glp is None:
        return glp, idx2, None
    bad = (idx2 != ignore_index) & ((idx2 < 0) | (idx2 >= v_total))
    return (glp.masked_fill(bad, 0.0), idx2.masked_fill(bad, ignore_index),
            bad.reshape(idx2.shape[0], -1).any(1))


# ---------------------------------------------------------------------------------------------
# The head over the sampler's support (top_k, top_p, min_p): token-row chunks of whole logits rows
# ---------------------------------------------------------------------------------------------
# A row's threshold needs all of its logits before any of its sums, so this path runs over chunks
# of token rows [rows, V] (the lm_head_support_chunk_bytes setting) rather than vocabulary
# chunks: per chunk, the fp32 logits from one GEMM, the rows' thresholds (and with top_k their kept
# ids) from the sampler's kernels (fused::_sampler_threshold, ops/sampler.py; with the kernels off,
# on CPU and in fp64 the listing comes from a top-k of the rows, which gives min-p / top-k alone
# their threshold too: reference.min_p_top_k_threshold), then the log-prob family's core forward
# restricted to them. The backward recomputes the chunk's logits, writes their d logits with the
# same thresholds (d logits 0 outside the support; in place over the fp32 logits for bf16 / fp16
# weights on the Triton path) and runs the d hidden and d weight GEMMs on them. Saved for the
# backward: the core's (max, log2 sum) and the threshold per row (stats [..., 3]).


def _support_rows(device: torch.device, v: int) -> int:
    """Token rows per chunk of the support path: the lm_head_support_chunk_bytes budget of fp32 [rows, V]
    (a device type it does not name: its "cpu" entry, else 4 MiB), in multiples of 64 past 64 rows,
    at least one."""
    budget = settings.lm_head_support_chunk_bytes
    rows = max(1, budget.get(device.type, budget.get("cpu", 4 << 20)) // (4 * v))
    return rows - rows % 64 if rows > 64 else rows


def _support_options(opts: meta.HeadOptions) -> tuple[float, LogprobOptions]:
    """(the chunk's temperature, the log-prob core's options) for the support path's chunks: the
    logits as _logits_chunk makes them (scaled and capped with a softcap; without one the scale
    is folded into the temperature), whole rows, no shift (the rows are already shifted)."""
    t_eff = effective_temperature(opts)
    return t_eff, LogprobOptions(t_eff, opts.ignore_index, True, False)


def _support_forward(h2, w, idx2, bias, opts, path, invariant, lp2, ent2, st2):
    """Writes the support path's log-probs lp2, entropy ent2 [N] and statistics st2 [N, width] of the
    rows h2 [N, H] (the GEMM's operands w, h2 as _forward_impl prepared them): the core's (max,
    log2 sum), the threshold and, with ``top_k`` <= SUPPORT_CAP, the listed support (HeadOptions.stats_width)."""
    n, v = h2.shape[0], w.shape[0]
    t_eff, lopts = _support_options(opts)
    k = opts.listed_ids(v)
    top_p = opts.top_p is not None and opts.top_p < 1.0
    step = _support_rows(h2.device, v)
    # the threshold kernels (kernels/sampler.py) give each row's threshold and its kept ids in id
    # order (a count, then the ids) in about one pass over the row, without a top-k; else (the
    # reference, fp64, the kernels switched off) the listing comes from a top-k of the logits
    # (top_k >= V alone keeps every id: the threshold op then lists no row, the top-k route all)
    kernel_list = (bool(k) and opts.top_k < v and path.triton and settings.sampler_kernels
                   and h2.dtype != torch.float64)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        z = _logits_chunk(h2[r0:r1], w, bias, opts, invariant)
        if k and not kernel_list:
            # one more than listed where the row has more: whether ties run past the k-th value
            vals, ids = z.topk(min(k + 1, v), dim=1)
        listed = None
        if k and not top_p and not kernel_list:
            # min-p / top-k: the rule's threshold from the listing's own top k (one top-k pass)
            tau = reference.min_p_top_k_threshold(z, kernel_temperature(t_eff), opts, vals)[:, 0]
        else:
            tau, listed = torch.ops.fused._sampler_threshold(z, None, t_eff, False, opts.top_k, opts.top_p,
                                                             opts.min_p)
        # ids below the threshold: -inf from the core (and no gradient in its backward); a row
        # the threshold op listed has its sums taken over its listed logits alone
        lp_c, ent_c, st_c = lp_ops._core(z, idx2[r0:r1], None, *lopts.values(), tau, listed)
        lp2[r0:r1] = lp_c
        ent2[r0:r1] = ent_c
        st2[r0:r1, :2] = st_c
        st2[r0:r1, 2] = tau
        if kernel_list:
            # listed: [rows, SUPPORT_CAP + 1], the count of kept ids (-1: more than SUPPORT_CAP)
            # and the ids in id order; a row keeping more than k (ties past the k-th) or none (a
            # NaN row) is not listed, as below
            kept = listed[:, 0].to(torch.int64)
            ok = (kept > 0) & (kept <= k)
            inside = (torch.arange(k, device=z.device)[None, :] < kept[:, None]) & ok[:, None]
            ids = torch.where(inside, listed[:, 1:1 + k].to(torch.int64), v)
            st2[r0:r1, 3] = torch.where(ok, kept, -1)
            st2[r0:r1, 4:4 + k] = ids
            st2[r0:r1, 4 + k:] = z.gather(1, ids.clamp(max=v - 1))
        elif k:
            # the kept ids are the row's largest logits (ties with the threshold included): its top
            # k where at most k logits reach the threshold; a row with more (ties past the k-th) or
            # none (NaN) is not listed. The count of logits >= tau, from the top k + 1 alone (no
            # [rows, V] pass): past k where the (k+1)-th reaches tau, else all of them in the top k
            kept = (vals[:, :k] >= tau[:, None]).sum(1)
            if vals.shape[1] > k:
                kept = torch.where(vals[:, k] >= tau, k + 1, kept)
            vals, ids = vals[:, :k], ids[:, :k]
            # the kept ids in id order (a tie's order inside topk may follow the batch; the
            # backward's sums follow this order), the rest after them
            inside = torch.arange(k, device=z.device)[None, :] < kept[:, None]
            ids, order = torch.where(inside, ids, v).sort(1)
            st2[r0:r1, 3] = torch.where((kept > 0) & (kept <= k), kept, -1)
            st2[r0:r1, 4:4 + k] = ids
            st2[r0:r1, 4 + k:] = vals.gather(1, order)
        del z


def _support_backward(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy, opts, path, *,
                      hidden_grad=True, weight_grad=True):
    """(d hidden rows [N, H] in fp32 (fp64), d weight, d bias) of the support path. A row whose
    support the forward listed (and the lm_head_support_listed setting on) takes the listed
    backward (no logits, no GEMM); the other rows take token-row chunks of recomputed logits. The
    route is the row's own (its listing), so a row's d hidden does not depend on the other rows."""
    h2, idx2 = _rows(hidden, index, opts.shift)
    n, v = h2.shape[0], weight.shape[0]
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    st = stats.reshape(n, -1) if n > 0 else None
    k = opts.listed_ids(v)
    listed = bool(k) and settings.lm_head_support_listed
    # every row listed (one device sync): d weight is the listed backward's sparse product alone,
    # written into a column-major accumulator, the layout torch's sparse-dense addmm writes in
    # place (another it copies to that layout and back: two strided passes over [V, H] in fp32)
    by_columns = weight_grad and listed and n > 0 and not bool((st[:, 3] < 0).any())
    dh = torch.zeros(n if hidden_grad else 0, h2.shape[1], dtype=acc, device=hidden.device)
    if by_columns:
        dw_acc = torch.zeros(weight.shape[::-1], dtype=acc, device=hidden.device).t()
    else:
        dw_acc = torch.zeros(weight.shape if weight_grad else (0,), dtype=acc, device=hidden.device)
    db_acc = torch.zeros(bias.shape if bias is not None else (0,), dtype=acc, device=hidden.device)
    if n > 0 and (grad_logp is not None or grad_entropy is not None):
        w, hm = _gemm_operands(weight, h2, not path.triton)
        ent2 = entropy.reshape(n)
        glp = grad_logp.reshape(idx2.shape) if grad_logp is not None else None
        gh = grad_entropy.reshape(n) if grad_entropy is not None else None
        glp, idx2, bad_rows = _contain_bad_ids(glp, idx2, opts.ignore_index, v)
        grads = (dh, dw_acc, db_acc, hidden_grad, weight_grad)
        unlisted = None  # the rows the chunks take (None: all)
        if listed:
            _listed_backward(glp, gh, hm, w, idx2, bias, st, ent2, opts, k, *grads)
            unlisted = st[:, 3] < 0
        _chunked_support_backward(glp, gh, hm, w, idx2, bias, st, ent2, opts, path, unlisted, *grads)
        if bad_rows is not None and hidden_grad:
            dh.masked_fill_(bad_rows[:, None], float("nan"))
    dw = dw_acc.to(weight.dtype, memory_format=torch.contiguous_format) if weight_grad else weight.new_empty(0)
    return dh, dw, db_acc.to(hidden.dtype)


def _chunked_support_backward(glp, gh, hm, w, idx2, bias, st, ent2, opts, path, unlisted, dh, dw_acc, db_acc,
                              hidden_grad, weight_grad):
    """The gradients of the rows ``unlisted`` marks (all where None) from token-row chunks of
    recomputed logits: d logits from the log-prob core's backward with the rows' thresholds, then
    the d hidden and d weight GEMMs, added to dh (written where None), dw_acc and db_acc. The
    chunks are the forward's (the same GEMM shapes give the same logits, so each id is inside or
    outside the support as in the forward, ties included); a chunk without a marked row is
    skipped, and the other rows of a chunk pass no upstream gradient."""
    n, v = hm.shape[0], w.shape[0]
    t_eff, _ = _support_options(opts)
    invariant = _invariant(path, hm, w)
    step = _support_rows(hm.device, v)
    starts = range(0, n, step)
    if unlisted is not None:
        marked = torch.zeros(len(starts), dtype=torch.int64, device=hm.device)
        marked.index_add_(0, torch.arange(n, device=hm.device) // step, unlisted.to(torch.int64))
        starts = [r0 for r0, c in zip(starts, marked.tolist()) if c]  # (one device sync)
        keep = unlisted.to(st.dtype)
        glp = None if glp is None else glp * keep.reshape((n,) + (1,) * (glp.dim() - 1)).to(glp.dtype)
        gh = None if gh is None else gh * keep.to(gh.dtype)
    for r0 in starts:
        r1 = min(n, r0 + step)
        z = _logits_chunk(hm[r0:r1], w, bias, opts, invariant)
        args = (None if glp is None else glp[r0:r1], None if gh is None else gh[r0:r1], z, idx2[r0:r1],
                st[r0:r1, :2], ent2[r0:r1], t_eff, opts.ignore_index)
        tau = st[r0:r1, 2].contiguous()
        # (not in place over the logits: with K ids the kernel reads their logits again in every
        # block of the row)
        dz, _ = path.backward(*args, out_dtype=z.dtype if opts.softcap is not None else w.dtype, threshold=tau)
        if opts.softcap is not None:  # d y = d z * s (1 - tanh^2), tanh = z / c, in fp32
            dz = dz.mul_(z.div_(opts.softcap).square_().neg_().add_(1.0)).mul_(opts.logit_scale).to(w.dtype)
        if weight_grad:
            _addmm_f32_(dw_acc, dz.t(), hm[r0:r1])
        if hidden_grad and invariant and dh.dtype == torch.float32:
            _matmul_into(dh[r0:r1], dz, w, accumulate=unlisted is not None)
        elif hidden_grad:
            _addmm_f32_(dh[r0:r1], dz, w, first=unlisted is None)
        if bias is not None:
            db_acc += dz.sum(0, dtype=db_acc.dtype)
        del z, dz


def _listed_backward(glp, gh, hm, w, idx2, bias, st, ent, opts, k, dh, dw_acc, db_acc, hidden_grad, weight_grad):
    """Adds the gradients of the rows whose support the forward listed (the others contribute
    nothing here), from that list of each row's kept ids and their logits, without logits or a
    GEMM: d logits at those ids only,
    (1/T) [sum_ids g_lp (1[j = id] - p_j) - g_ent p_j (log p_j + H)] over the ids inside the
    support (an id outside it, or ignore_index, passes nothing), then d hidden = a gather-sum of
    the weight's rows (embedding_bag, accumulating in fp32, rounded once to the weight's dtype),
    d weight += a sparse [V, N] by [N, H] product in fp32, d bias a scatter-add."""
    n, v = hm.shape[0], w.shape[0]
    t_eff, _ = _support_options(opts)
    cnt, ids, zs = st[:, 3], st[:, 4:4 + k].to(torch.int64), st[:, 4 + k:4 + 2 * k]
    # the forward lists a row's ids by id; an id of -inf logit (a masked vocabulary entry the
    # threshold keeps when it is -inf) has p 0 and no gradient
    valid = (torch.arange(k, device=st.device)[None, :] < cnt[:, None]) & (zs > float("-inf"))
    a = torch.where(valid, zs / t_eff, float("-inf"))
    logp = torch.where(valid, a - torch.logsumexp(a, 1, keepdim=True), 0.0)
    p = logp.exp() * valid
    dz = torch.zeros_like(zs)
    if glp is not None:
        g2, i2 = glp.reshape(n, -1).to(zs.dtype), idx2.reshape(n, -1)
        g2 = g2.masked_fill(i2 == opts.ignore_index, 0.0)
        g_all = torch.zeros_like(cnt)
        for j in range(i2.shape[1]):  # the K ids one at a time: [N, k] temporaries
            hit = (ids == i2[:, j:j + 1]) & valid
            g_j = torch.where(hit, g2[:, j:j + 1], 0.0)
            dz += g_j
            g_all += g_j.sum(1)
        dz -= p * g_all[:, None]
    if gh is not None:
        dz -= gh.reshape(n, 1).to(zs.dtype) * p * (logp + ent.reshape(n, 1).to(zs.dtype))
    dz = torch.where(valid, dz / t_eff, 0.0)
    if opts.softcap is not None:  # d y = d z * s (1 - tanh^2), tanh = z / c
        dz = dz * (1.0 - (zs / opts.softcap).square()) * opts.logit_scale
    safe_ids = torch.where(valid, ids, 0)
    if hidden_grad:
        dh += torch.nn.functional.embedding_bag(safe_ids, w, per_sample_weights=dz.to(w.dtype), mode="sum")
    flat_rows = torch.arange(n, device=st.device)[:, None].expand(n, k).reshape(-1)
    if weight_grad:  # every (id, row) place, zero weight where not valid: no data-dependent shapes
        d = torch.sparse_coo_tensor(torch.stack([safe_ids.reshape(-1), flat_rows]), dz.reshape(-1).to(dw_acc.dtype),
                                    (v, n), check_invariants=False)
        dw_acc.addmm_(d, hm.to(dw_acc.dtype))
    if bias is not None:
        db_acc.index_add_(0, safe_ids.reshape(-1), dz.reshape(-1).to(db_acc.dtype))


def hidden_grad_from_rows(dh, hidden, shift):
    """d hidden in hidden's shape and dtype from the rows' fp32 sum (zero last position with shift)."""
    dh_full = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    if dh.numel():
        if shift:
            dh_full[..., :-1, :] = dh.view(dh_full[..., :-1, :].shape)
        else:
            dh_full.copy_(dh.view(dh_full.shape))
    return dh_full


def _bwd_reference(glp, gh, z, idx, st, ent, t, ignore_index, **kw):
    return reference.logprobs_entropy_backward(glp, gh, z, idx, st, ent, None, LogprobOptions(t, ignore_index, True, False),
                                               **kw)


def _bwd_triton(glp, gh, z, idx, st, ent, t, ignore_index, **kw):
    return lp_ops.backward_triton(glp, gh, z, idx, st, ent, None, LogprobOptions(t, ignore_index, True, False), **kw)


@dataclasses.dataclass(frozen=True)
class Path:
    """The implementation a call runs: the Triton kernels (``TRITON``) or the PyTorch reference
    (``REFERENCE``): its chunk merge of the forward and its d logits of the backward."""
    triton: bool
    merge: Callable
    backward: Callable


REFERENCE = Path(False, _merge_reference, _bwd_reference)
TRITON = Path(True, _merge_triton, _bwd_triton)


def path_for(t: torch.Tensor) -> Path:
    """The implementation the op's dispatcher would pick for a tensor on t's device."""
    return TRITON if t.device.type in TRITON_DEVICES else REFERENCE


_TENSORS = "Tensor hidden, Tensor weight, Tensor index, Tensor? bias"


@torch.library.custom_op(_FWD, mutates_args=(),
                         schema=f"({_TENSORS}, {meta.HeadOptions.schema()}) -> (Tensor, Tensor, Tensor)")
def linear_forward(hidden, weight, index, bias, *options):
    return _forward_impl(hidden, weight, index, bias, meta.HeadOptions(*options), REFERENCE)


@torch.library.custom_op(_BWD, mutates_args=(), schema=(
    f"(Tensor? grad_logp, Tensor? grad_entropy, {_TENSORS}, Tensor stats, Tensor entropy, "
    f"{meta.HeadOptions.schema()}, *, bool hidden_grad=True, bool weight_grad=True) -> (Tensor, Tensor, Tensor)"))
def linear_backward_op(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy, *options,
                       hidden_grad=True, weight_grad=True):
    return _backward_impl(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy,
                          meta.HeadOptions(*options), hidden_grad, weight_grad, REFERENCE)


linear_forward.register_fake(meta.linear_forward_fake)
linear_backward_op.register_fake(meta.linear_backward_fake)

if TRITON_DEVICES:
    @linear_forward.register_kernel(TRITON_DEVICES)
    def _linear_forward_triton(hidden, weight, index, bias, *options):
        return _forward_impl(hidden, weight, index, bias, meta.HeadOptions(*options), TRITON)

    @linear_backward_op.register_kernel(TRITON_DEVICES)
    def _linear_backward_triton(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy, *options,
                                hidden_grad=True, weight_grad=True):
        return _backward_impl(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy,
                              meta.HeadOptions(*options), hidden_grad, weight_grad, TRITON)


@torch.library.custom_op(f"{NAMESPACE}::_linear_logprobs_slice_backward", mutates_args=(), schema=(
    f"(Tensor? grad_logp, Tensor? grad_entropy, {_TENSORS}, Tensor stats, Tensor entropy, "
    f"{meta.HeadOptions.schema()}, *, int v_off, int v_total, bool hidden_grad=True, bool weight_grad=True) "
    "-> (Tensor, Tensor, Tensor)"))
def linear_slice_backward_op(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy, *options, v_off,
                             v_total, hidden_grad=True, weight_grad=True):
    """The backward of a vocabulary slice of the head (the vocabulary-parallel head, torch_fused/parallel.py):
    backward_chunks with the weight's rows as ids v_off .. of v_total, d hidden as fp32 (fp64) rows
    [N, H] still to be summed over the slices. One opaque op, so that torch.compile traces the
    vocabulary-parallel backward without entering the launch code."""
    return backward_chunks(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy,
                           meta.HeadOptions(*options), REFERENCE, v_off=v_off, v_total=v_total,
                           hidden_grad=hidden_grad, weight_grad=weight_grad)


@linear_slice_backward_op.register_fake
def _(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy, *options, v_off, v_total,
      hidden_grad=True, weight_grad=True):
    opts = meta.HeadOptions(*options)
    n = math.prod(meta.row_shape(hidden, opts.shift))
    dh = hidden.new_empty((n if hidden_grad else 0, hidden.shape[-1]), dtype=acc_dtype(hidden.dtype))
    return (dh, weight.new_empty(weight.shape if weight_grad else (0,)),
            hidden.new_empty(bias.shape if bias is not None else (0,)))


if TRITON_DEVICES:
    @linear_slice_backward_op.register_kernel(TRITON_DEVICES)
    def _linear_slice_backward_triton(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy, *options,
                                      v_off, v_total, hidden_grad=True, weight_grad=True):
        return backward_chunks(grad_logp, grad_entropy, hidden, weight, index, bias, stats, entropy,
                               meta.HeadOptions(*options), TRITON, v_off=v_off, v_total=v_total,
                               hidden_grad=hidden_grad, weight_grad=weight_grad)


def _setup_context(ctx, inputs, output):
    hidden, weight, index, bias = inputs[:4]
    _, ent, stats = output
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)
    ctx.options = inputs[4:]
    # the entropy is an output the caller may modify in place: the backward keeps its own copy (O(rows))
    ctx.save_for_backward(hidden, weight, index, bias, stats, ent.detach().clone())


def _backward(ctx, g_logp, g_ent, _g_stats):
    hidden, weight, index, bias, stats, ent = ctx.saved_tensors
    need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
    rest = (None,) * (len(ctx.needs_input_grad) - 4)
    if not (need_h or need_w or need_b):
        return (None, None, None, None) + rest
    dh, dw, db = torch.ops.fused._linear_logprobs_entropy_backward(
        g_logp, g_ent, hidden, weight, index, bias, stats, ent, *ctx.options, hidden_grad=bool(need_h),
        weight_grad=bool(need_w))
    return (dh if need_h else None, dw if need_w else None, None,
            db if (need_b and bias is not None) else None) + rest


_setup_context, _backward = under_forward_settings(_setup_context, _backward)
linear_forward.register_autograd(_backward, setup_context=_setup_context)

LIB.define(f"linear_logprobs_and_entropy(Tensor hidden, Tensor weight, Tensor index, *, Tensor? bias=None, "
           f"{meta.HeadOptions.schema(defaults=True)}) -> (Tensor, Tensor)")


def _linear_logprobs_and_entropy(hidden, weight, index, *, bias=None, **options):
    no_forward_mode("linear_logprobs_and_entropy", hidden, weight, bias)
    logp, ent, _ = torch.ops.fused._linear_logprobs_entropy_forward(
        hidden, weight, index, bias, *meta.HeadOptions(**options).values())
    return logp, ent


LIB.impl("linear_logprobs_and_entropy", _linear_logprobs_and_entropy, "CompositeImplicitAutograd")
