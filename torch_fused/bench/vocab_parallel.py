"""One rank's local work of the vocab-parallel ops (torch_fused/parallel.py), timed on one GPU
without a process group, against the single-GPU ops on the whole vocabulary.

With the vocabulary split over 2 ranks, a rank holds a [N, V/2] logits shard (bf16, V = 151936,
N = B * L of the log-prob benchmark shapes: 8 * 1024, 4 * 4096, 16 * 4096) or the [V/2, H] rows
of the lm_head weight. What it does besides the collectives (one all-gather of [N, 4] fp32
partials forward; for the head one all-reduce of the [N, H] fp32 d hidden backward; neither is
timed here) is:

- forward: the per-row partial statistics of its shard (parallel.logits_partials: the log-prob
  forward kernel over the shard) and the merge of the world's partials (parallel.merge_partials,
  O(N) work; here the gathered partials are this rank's twice);
- backward: the local d logits of the shard from the whole rows' statistics
  (parallel.logits_backward: the log-prob backward kernel with v_off / v_total).

Floors: logits forward, one read of the shard; forward+backward, read, read, write of the
shard's bytes. The single-GPU op on the full [N, V] logits is timed in the same run against the
full logits' floor, so the two fractions of the floor compare directly (a rank at the same
fraction as the single-GPU op takes half its time). The fused head with a vocab-sharded weight
[V/2, H] is reported against the bare GEMMs of its shard (forward: hidden @ w_shard.T;
forward+backward: that GEMM, d hidden and d weight), as ``lm_head`` reports the single-GPU head
against the full weight's GEMMs (also timed here).
"""

from __future__ import annotations

import torch

import torch_fused

from .common import Row, bench_ms, peak_extra_mb, warm_up

V = 151936
WORLD = 2
NS = [8 * 1024, 4 * 4096, 16 * 4096]  # B * L of bench/logprobs.py's shapes, all at V = 151936
HEAD_SHAPES = [(8192, 4096, 151936), (16384, 3584, 151936), (32768, 4096, 32000)]  # (N, H, V), as bench/lm_head.py
DEVICE = "cuda"  # (a CPU smoke run of the code paths sets "cpu" and stubs the timers)


def _empty_cache():
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _rank_pieces(v: int, rank: int = 0):
    from .. import parallel as P

    starts, sizes = P.chunk_split(v, WORLD)
    return P, starts[rank], sizes[rank], sizes[0]


def _logits_rows(report, copy_gbps, n):
    from .._library import LOG2E

    P, v_off, v_loc, step = _rank_pieces(V)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(n, v_loc, device=DEVICE, dtype=torch.bfloat16, generator=g) * 3  # this rank's shard
    idx = torch.randint(0, V, (n,), device=DEVICE, generator=g)
    idx2 = idx[:, None]
    exact = P._exact_shift(x, torch.float32, P.LOG2E)  # temperature 1
    ones_lp = torch.ones(n, device=DEVICE)
    ones_ent = torch.ones(n, device=DEVICE)
    shard_bytes = x.numel() * x.element_size()
    shape = f"N{n} V{V} shard [N, {v_loc}] of {WORLD}"

    def fwd():
        parts = P.logits_partials(x, idx, v_off, 1.0, True, False)
        world = torch.stack([parts, parts])  # stands for the all-gather's output
        return P.merge_partials(world, idx2, -100, step, V, LOG2E, exact, True)

    def partials():
        return P.logits_partials(x, idx, v_off, 1.0, True, False)

    def fwdbwd():
        _, ent, stats = fwd()
        return P.logits_backward(ones_lp, ones_ent, x, idx, stats, ent, 1.0, -100, False, v_off, V)

    def add(group, impl, fn, floor, returned=0, note=""):
        ms = bench_ms(fn)
        pk = peak_extra_mb(fn, returned)  # less the returned gradient
        report.rows.append(Row(group, shape, impl, ms, floor, peak_extra_mb=pk, note=note).finish(copy_gbps))
        print(f"{group:36s} {shape:40s} {impl:44s} {ms:8.3f} ms  {report.rows[-1].frac_floor:.3f} of floor",
              flush=True)
        return ms

    warm_up(fwdbwd)
    f_ms = add("vocab-parallel logits fwd", "rank-local: partials + merge", fwd, shard_bytes)
    add("vocab-parallel logits fwd", "rank-local: partials only", partials, shard_bytes)
    fb_ms = add("vocab-parallel logits fwd+bwd", "rank-local: partials + merge + local bwd", fwdbwd, 3 * shard_bytes,
                shard_bytes)
    del x
    _empty_cache()

    # the single-GPU op on the whole logits, same run
    full = torch.randn(n, V, device=DEVICE, dtype=torch.bfloat16, generator=g) * 3
    fg = full.detach().requires_grad_(True)
    full_bytes = full.numel() * full.element_size()

    def single_fwd():
        return torch_fused.logprobs_and_entropy(full, idx)

    def single_fwdbwd():
        lp, ent = torch_fused.logprobs_and_entropy(fg, idx)
        return torch.autograd.grad(lp.sum() + ent.sum(), fg)[0]

    warm_up(single_fwdbwd)
    sf = add("vocab-parallel logits fwd", "single-GPU op, full [N, V] logits", single_fwd, full_bytes)
    sfb = add("vocab-parallel logits fwd+bwd", "single-GPU op, full [N, V] logits", single_fwdbwd, 3 * full_bytes,
              full_bytes)
    report.extra.setdefault("rank_over_single_time", {})[shape] = {"fwd": f_ms / sf, "fwd+bwd": fb_ms / sfb}
    print(f"  rank-local / single-GPU time: fwd {f_ms / sf:.3f}, fwd+bwd {fb_ms / sfb:.3f} (ideal {1 / WORLD:.3f})",
          flush=True)
    del full, fg, idx
    _empty_cache()


def _head_rows(report, n, hd, v):
    from .._library import LOG2E
    from ..ops import linear_logprobs as LL
    from ..meta.linear_logprobs import HeadOptions

    P, v_off, v_loc, step = _rank_pieces(v)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    h = torch.randn(n, hd, device=DEVICE, generator=g).to(torch.bfloat16)
    w_full = (torch.randn(v, hd, device=DEVICE, generator=g) / hd**0.5 * 2).to(torch.bfloat16)
    w = w_full[v_off:v_off + v_loc].contiguous()  # this rank's rows of lm_head.weight
    idx = torch.randint(0, v, (n,), device=DEVICE, generator=g)
    idx2 = idx[:, None]
    exact = P._exact_shift(h, torch.float32, P.LOG2E)  # temperature 1
    ones = torch.ones(n, device=DEVICE)
    shape = f"N{n} H{hd} V{v} weight shard [{v_loc}, H] of {WORLD}"
    opts = HeadOptions()  # temperature 1, no shift, no scale or softcap

    def fwd():
        parts = P.linear_partials(h, w, idx, None, opts, v_off)
        return P.merge_partials(torch.stack([parts, parts]), idx2, -100, step, v, LOG2E, exact, True)

    def fwdbwd():
        _, ent, stats = fwd()
        dh, dw, _ = P.linear_backward(ones, ones, h, w, idx, None, stats, ent, opts, v_off=v_off, v_total=v)
        return LL.hidden_grad_from_rows(dh, h, opts.shift), dw  # (the all-reduce of dh is not timed)

    dl = torch.randn(n, v_loc, device=DEVICE, dtype=torch.bfloat16, generator=g)
    warm_up(lambda: (h @ w.t(), dl @ w, dl.t() @ h))  # the floors are timed first: clocks up
    gemm1 = bench_ms(lambda: h @ w.t())
    gemm3 = bench_ms(lambda: (h @ w.t(), dl @ w, dl.t() @ h))
    del dl
    _empty_cache()
    dlf = torch.randn(n, v, device=DEVICE, dtype=torch.bfloat16, generator=g)
    full1 = bench_ms(lambda: h @ w_full.t())
    full3 = bench_ms(lambda: (h @ w_full.t(), dlf @ w_full, dlf.t() @ h))
    del dlf
    _empty_cache()
    report.extra.setdefault("gemm_ms", {})[shape] = {"shard fwd": gemm1, "shard fwd+bwd": gemm3,
                                                     "full fwd": full1, "full fwd+bwd": full3}
    hg = h.detach().requires_grad_(True)
    wg = w_full.detach().requires_grad_(True)

    def single_fwd():
        return torch_fused.linear_logprobs_and_entropy(h, w_full, idx)

    def single_fwdbwd():
        lp, ent = torch_fused.linear_logprobs_and_entropy(hg, wg, idx)
        return torch.autograd.grad(lp.sum() + ent.sum(), (hg, wg))

    warm_up(fwd)
    shard_grads = (h.numel() + w.numel()) * 2  # the returned d hidden and d weight (bf16)
    full_grads = (h.numel() + w_full.numel()) * 2
    for group, impl, fn, floor_ms, what, returned in [
            ("vocab-parallel lm_head fwd", "rank-local: partials + merge", fwd, gemm1, "the shard's GEMM", 0),
            ("vocab-parallel lm_head fwd+bwd", "rank-local: partials + merge + local bwd", fwdbwd, gemm3,
             "the shard's 3 GEMMs", shard_grads),
            ("vocab-parallel lm_head fwd", "single-GPU head, full weight", single_fwd, full1, "the full GEMM", 0),
            ("vocab-parallel lm_head fwd+bwd", "single-GPU head, full weight", single_fwdbwd, full3,
             "the full 3 GEMMs", full_grads)]:
        ms = bench_ms(fn, warmup=5, rep=100)
        pk = peak_extra_mb(fn, returned)  # less the returned gradients
        row = Row(group, shape, impl, ms, 0, peak_extra_mb=pk,
                  note=f"{ms / floor_ms:.3f}x the bare GEMMs of {what} ({floor_ms:.3f} ms)")
        row.floor_ms = floor_ms
        row.frac_floor = floor_ms / ms
        report.rows.append(row)
        print(f"{group:36s} {shape:44s} {impl:44s} {ms:8.3f} ms  {ms / floor_ms:.3f}x {what}", flush=True)
    del h, w, w_full, hg, wg, idx
    _empty_cache()


def run(report, copy_gbps, quick=False):
    report.extra["world"] = WORLD
    report.extra["note"] = ("one rank's local work, no process group: collectives not timed (forward one all-gather "
                            "of [N, 4] fp32; the head's backward one all-reduce of [N, H] fp32)")
    for n in NS[:1] if quick else NS:
        _logits_rows(report, copy_gbps, n)
    for n, hd, v in HEAD_SHAPES[:1] if quick else HEAD_SHAPES:
        _head_rows(report, n, hd, v)
