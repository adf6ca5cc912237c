"""The fused lm_head, ``linear_logprobs_and_entropy``, against the bare GEMMs of the same run.

Floor: forward, one GEMM (hidden @ weight.T); forward+backward, the three GEMMs of a
materialized head (logits, d hidden = d logits @ weight, d weight = d logits.T @ hidden),
bf16 with fp32 accumulation, timed alone right before and right after each call timed against
it (their mean is that row's floor: the chip's clocks drift over the suite). Peak extra memory: above the inputs, not counting the
returned gradients. Baseline in the same run: the materialized logits with the fused log-prob
op (shift-free rows), and where installed the peers: TRL's ``trl.kernels.ChunkedLogProbFunction``
(with entropy, its trainer's chunk of 32768) and cut-cross-entropy's ``linear_cross_entropy``
(per-token loss, no entropy; exact gradients with ``filter_eps=None``, and its default filtered
ones; the filter skips little on these random logits of spread ~2). ``shift=True`` on the same
N rows (hidden ``[8, N/8 + 1, H]``) is timed against its own floor and compared with the unshifted
call through their multiples of their floors. A
frozen head (d hidden only) is timed against its two GEMMs. ``--sweep`` times the ways of making the logits
(ops/linear_logprobs.py, FUSED_GEMM and TMA; the GEMM tiles of kernels/lm_head.py) and the
chunk sizes.
``python -m torch_fused.bench.lm_head --cpu-memory`` measures the peak RSS growth of a CPU
forward+backward in a fresh process instead.
"""

from __future__ import annotations

import torch

import torch_fused

from ..settings import current as settings, override
from .common import Row, bench_ms, head_inputs, peak_extra_mb, timed_against_floor, warm_up

SHAPES = [(8192, 4096, 151936), (16384, 3584, 151936), (32768, 4096, 32000)]  # (N, H, V)


def peers(h, w, idx):
    """{name: forward+backward callable returning (d hidden, d weight)} of the installed peers."""
    out = {}
    try:
        from trl.kernels import ChunkedLogProbFunction

        def trl_chunked():
            lp, ent = ChunkedLogProbFunction.apply(h, w, None, idx, 1.0, 32768, None, 1.0, ("entropy",))[:2]
            return torch.autograd.grad(lp.sum() + ent.sum(), (h, w))

        out["TRL ChunkedLogProbFunction (with entropy)"] = trl_chunked
    except Exception as e:  # not installed, or another API
        print(f"TRL ChunkedLogProbFunction not timed: {type(e).__name__}: {e}", flush=True)
    try:
        from cut_cross_entropy import linear_cross_entropy

        for name, eps in (("exact", None), ("filtered, approximate", "high")):
            def cce(eps=eps):
                loss = linear_cross_entropy(h, w, idx, reduction="none", filter_eps=eps)
                return torch.autograd.grad(loss.sum(), (h, w))

            out[f"cut-cross-entropy {name} (no entropy)"] = cce
    except Exception as e:
        print(f"cut-cross-entropy not timed: {type(e).__name__}: {e}", flush=True)
    return out


def run(report, copy_gbps, quick=False):
    for n, hd, v in SHAPES[:1] if quick else SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        h, w, idx, dl = head_inputs(n, hd, v, g)
        shape = f"N{n} H{hd} V{v}"
        hb, wb = h.detach(), w.detach()
        floors = {"fwd": lambda: hb @ wb.t(), "fwd+bwd": lambda: (hb @ wb.t(), dl @ wb, dl.t() @ hb),
                  "fwd+d hidden": lambda: (hb @ wb.t(), dl @ wb)}
        warm_up(floors["fwd+bwd"])  # clocks up before the first floor
        report.extra.setdefault("gemm_ms", {})[shape] = first = {k: bench_ms(f) for k, f in floors.items()}
        logits_mib = n * v * 2 / 2**20
        grads_bytes = h.numel() * 2 + w.numel() * 2

        def fused_fwd():
            return torch_fused.linear_logprobs_and_entropy(hb, wb, idx)

        def fused_fwdbwd():
            lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx)
            return torch.autograd.grad(lp.sum() + ent.sum(), (h, w))

        def materialized_fwdbwd():
            logits = h @ w.t()
            lp, ent = torch_fused.logprobs_and_entropy(logits, idx)
            return torch.autograd.grad(lp.sum() + ent.sum(), (h, w))

        # shift=True on the same N rows: hidden [8, N/8 + 1, H] as a model leaves it, position t
        # scoring id t; compared with the unshifted call through their multiples of their floors
        hs = torch.randn(8, n // 8 + 1, hd, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
        idx_s = idx.view(8, n // 8)

        def shift_fwdbwd():
            lp, ent = torch_fused.linear_logprobs_and_entropy(hs, w, idx_s, shift=True)
            return torch.autograd.grad(lp.sum() + ent.sum(), (hs, w))

        def frozen_fwdbwd():  # a frozen head: d hidden only
            lp, ent = torch_fused.linear_logprobs_and_entropy(h, wb, idx)
            return torch.autograd.grad(lp.sum() + ent.sum(), (h,))

        warm_up(fused_fwd)
        cases = [("lm_head fwd", "torch_fused linear_logprobs_and_entropy", fused_fwd, "fwd", 0),
                 ("lm_head fwd+bwd", "torch_fused linear_logprobs_and_entropy", fused_fwdbwd, "fwd+bwd", grads_bytes),
                 ("lm_head fwd+bwd", "materialized logits + torch_fused op", materialized_fwdbwd, "fwd+bwd",
                  grads_bytes)]
        cases.append(("lm_head fwd+bwd, shift=True", "torch_fused linear_logprobs_and_entropy", shift_fwdbwd,
                      "fwd+bwd", hs.numel() * 2 + w.numel() * 2))
        cases += [("lm_head fwd+bwd", name, fn, "fwd+bwd", grads_bytes) for name, fn in peers(h, w, idx).items()]
        cases.append(("lm_head fwd+bwd, frozen head", "torch_fused linear_logprobs_and_entropy", frozen_fwdbwd,
                      "fwd+d hidden", h.numel() * 2))
        ratios = {}
        for group, impl, fn, floor_name, grads in cases:
            try:
                ms, floor_ms = timed_against_floor(lambda: bench_ms(fn, warmup=5, rep=200),
                                                   lambda: bench_ms(floors[floor_name]))
                pk = peak_extra_mb(fn, grads)
            except Exception as e:  # a peer that fails here is reported, not fatal
                print(f"{impl} failed at {shape}: {type(e).__name__}: {e}", flush=True)
                torch.cuda.empty_cache()
                continue
            ratios[group, impl] = ms / floor_ms
            # shift=True against the unshifted call: the ratio of their multiples of the floor
            unshifted = ratios.get(("lm_head fwd+bwd", impl)) if group.endswith("shift=True") else None
            row = Row(group, shape, impl, ms, 0, peak_extra_mb=pk,
                      note=f"{ms / floor_ms:.3f}x the bare GEMMs ({floor_ms:.3f} ms beside it, "
                      f"{first[floor_name]:.3f} ms first); logits {logits_mib:.0f} MiB"
                      + (f"; {ms / floor_ms / unshifted:.3f}x the unshifted call" if unshifted else ""))
            row.floor_ms = floor_ms
            row.frac_floor = floor_ms / ms
            report.rows.append(row)
            print(f"{group:16s} {shape:22s} {impl:40s} {ms:8.3f} ms  {ms / floor_ms:.3f}x GEMMs  "
                  f"peak extra {pk:.0f} MiB (logits {logits_mib:.0f} MiB)", flush=True)
            torch.cuda.empty_cache()
        del h, w, hb, wb, idx, hs, idx_s, dl, floors
        torch.cuda.empty_cache()


# Settings tried by --sweep: (passes with the logits GEMM in the Triton kernels, TMA on, tiles
# (BM, BN, BK, GROUP_M, warps, stages) of the forward, of the backward, CHUNK_BYTES in MiB,
# MIN_COLS and DLOGITS_MIN_COLS)
_T3, _T5 = (128, 256, 64, 16, 8, 3), (256, 128, 64, 16, 8, 3)
_G8, _G32 = (128, 256, 64, 8, 8, 3), (128, 256, 64, 32, 8, 3)
_BOTH = ("forward", "backward")
SWEEP = [((), True, _T3, _T3, 128, 2048), (_BOTH, True, _T3, _T3, 128, 2048), (_BOTH, True, _T3, _T3, 160, 2048),
         (_BOTH, True, _T3, _T3, 128, 4096), (_BOTH, True, _T3, _T3, 128, 8192), (_BOTH, True, _T3, _T5, 128, 2048),
         (_BOTH, True, _G8, _G8, 128, 8192), (_BOTH, True, _G32, _G32, 128, 8192)]


def sweep(copy_gbps, shape=None):
    """Forward and forward+backward times of the fused head for each GEMM tile setting of SWEEP,
    as multiples of the same run's bare GEMMs, with the peak extra memory."""
    res = []
    shapes = [tuple(shape)] if shape else SHAPES
    for n, hd, v in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        h, w, idx, dl = head_inputs(n, hd, v, g)
        hb, wb = h.detach(), w.detach()
        gemm1 = bench_ms(lambda: hb @ wb.t())
        gemm3 = bench_ms(lambda: (hb @ wb.t(), dl @ wb, dl.t() @ hb))
        del dl
        torch.cuda.empty_cache()

        def fwd():
            return torch_fused.linear_logprobs_and_entropy(hb, wb, idx)

        def fwdbwd():
            lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx)
            return torch.autograd.grad(lp.sum() + ent.sum(), (h, w))

        ref = None
        for passes, tma, t_fwd, t_bwd, chunk_mib, min_cols in SWEEP:
            tiles = {"stats": t_fwd, "dlogits": t_bwd, "stats_tma": t_fwd, "dlogits_tma": t_bwd}
            cfg = (passes, tma, t_fwd, t_bwd, chunk_mib, min_cols)
            config = override(lm_head_fused_gemm=frozenset(passes), lm_head_tma=tma, lm_head_tiles=tiles,
                              lm_head_chunk_bytes=dict(settings.lm_head_chunk_bytes, cuda=chunk_mib << 20),
                              lm_head_min_cols=dict(settings.lm_head_min_cols, cuda=min_cols),
                              lm_head_dlogits_min_cols=dict(settings.lm_head_dlogits_min_cols, cuda=min_cols))
            try:
                config.__enter__()
                out = fwdbwd()
                lp = fwd()[0]
                if ref is None:
                    ref = (lp, out)
                err = max((lp - ref[0]).abs().max().item(),
                          *((a.float() - b.float()).norm().item() / b.float().norm().item()
                            for a, b in zip(out, ref[1])))
                del out
                warm_up(fwd, 100)
                f = bench_ms(fwd, warmup=5, rep=150)
                warm_up(fwdbwd, 100)
                fb = bench_ms(fwdbwd, warmup=5, rep=300)
                pk = peak_extra_mb(fwdbwd, h.numel() * 2 + w.numel() * 2)
            except Exception as e:  # a tile setting that does not compile or fit
                print(f"N{n} H{hd} V{v} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            finally:
                config.__exit__(None, None, None)
            r = dict(shape=f"N{n} H{hd} V{v}", fused=passes, tma=tma, tiles_fwd=t_fwd, tiles_bwd=t_bwd,
                     chunk_mib=chunk_mib, min_cols=min_cols, fwd_ms=f, fwd_x_gemm=f / gemm1, fwdbwd_ms=fb,
                     fwdbwd_x_gemm=fb / gemm3, peak_extra_mib=pk, max_diff_vs_first=err)
            res.append(r)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
                  flush=True)
        del h, w, hb, wb, idx, ref
        torch.cuda.empty_cache()
    return res


def cpu_peak_rss_growth_mib(n=4096, hd=64, v=32768) -> float:
    """Peak RSS growth (MiB) of one fp32 forward+backward on CPU, measured in this process: run
    it in a fresh process with MALLOC_MMAP_THRESHOLD_=65536 so freed large blocks leave the RSS."""
    import resource

    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hd, generator=g, requires_grad=True)
    w = torch.randn(v, hd, generator=g, requires_grad=True)
    idx = torch.randint(0, v, (n,), generator=g)
    torch_fused.linear_logprobs_and_entropy(h[:2], w[:8], idx[:2] % 8)  # imports and first-call setup
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx)
    torch.autograd.grad(lp.sum() + ent.sum(), (h, w))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (after - before) / 1024


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m torch_fused.bench.lm_head")
    ap.add_argument("--cpu-memory", action="store_true",
                    help="peak RSS growth of a CPU fp32 forward+backward at N=4096, H=64, V=32768 (512 MiB of "
                         "logits); run with MALLOC_MMAP_THRESHOLD_=65536")
    args = ap.parse_args()
    if args.cpu_memory:
        print(f"peak RSS growth: {cpu_peak_rss_growth_mib():.1f} MiB (logits would be 512 MiB)")
