"""The sampler's support on CUDA, the threshold routes side by side (the ``sampler_kernels``
setting on: the Triton kernels, with the filter's one pass and its two, its rows' tails in the
streaming programs or in a kernel of their own, and top-p's band listed in order or appended; off:
the plain-PyTorch rule), then the fused head over the support.

    python tools/sampler_routes.py            # timings
    python tools/sampler_routes.py --profile  # and a kernel-time table of the head with top_k 50
    python tools/sampler_routes.py --logits-only / --head-only   # one part

1. ``selective_log_softmax`` forward+backward over the support (bf16 logits, randn * 3) at
   N 4096 / V 151936 and N 16384 / V 32000, as a multiple of the same op over the full vocabulary.
2. ``linear_logprobs_and_entropy`` forward+backward at N 8192, H 4096, V 151936 (bf16) over the
   support, as a multiple of its three bare GEMMs (logits, d hidden, d weight), timed around it.
"""

from __future__ import annotations

import argparse

import torch

import torch_fused
from torch_fused.bench.common import bench_ms, head_inputs, timed_against_floor, warm_up
from torch_fused.settings import override

OPTIONS = (dict(top_k=50), dict(min_p=0.05), dict(top_p=0.9), dict(top_k=50, top_p=0.9))


def logits_op_rows():
    for n, v in ((4096, 151936), (16384, 32000)):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(n, v, device="cuda", generator=g) * 3).to(torch.bfloat16).requires_grad_(True)
        idx = torch.randint(0, v, (n,), device="cuda", generator=g)

        def f(**kw):
            lp = torch_fused.selective_log_softmax(x, idx, **kw)
            return torch.autograd.grad(torch.where(torch.isfinite(lp), lp, 0.0).sum(), x)

        warm_up(f, ms=100.0)
        full = bench_ms(f, warmup=3, rep=30)
        print(f"N{n} V{v} full vocabulary {full:.3f} ms", flush=True)
        # the rule; the filter's four forms (min-p / top-k options); top-p alone with the band
        # listed in order and appended
        routes = [(False, False, False, False)] + [(True, o, sp, False) for o in (True, False) for sp in (False, True)]
        routes += [(True, False, False, True)]
        for kernels, one_pass, split, append in routes:
            route = (f"kernels={kernels}" + (f" one_pass={one_pass} split={split} top_p_append={append}"
                                             if kernels else ""))
            for kw in OPTIONS:
                alone = set(kw) == {"top_p"}
                if kernels and ((alone and (one_pass or split)) or (append and not alone)):
                    continue  # (top-p alone never runs the filter; the band forms only top-p alone)
                with override(sampler_kernels=kernels, sampler_filter_one_pass=one_pass, sampler_filter_split=split,
                              sampler_top_p_append=append):
                    fn = lambda kw=kw: f(**kw)  # noqa: E731
                    warm_up(fn, ms=50.0)
                    ms = bench_ms(fn, warmup=2, rep=20)
                print(f"N{n} V{v} {route} {kw}: {ms:.3f} ms = {ms / full:.2f}x the full vocabulary", flush=True)
        del x


def head_rows(profile: bool):
    n, hd, v = 8192, 4096, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    h, w, idx, dl = head_inputs(n, hd, v, g)
    hb, wb = h.detach(), w.detach()
    floor = lambda: (hb @ wb.t(), dl @ wb, dl.t() @ hb)  # noqa: E731
    warm_up(floor)

    def f(**kw):
        lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx, **kw)
        return torch.autograd.grad(torch.where(torch.isfinite(lp), lp, 0.0).sum() + ent.sum(), (h, w))

    for kw in (dict(),) + OPTIONS[:3]:
        fn = lambda kw=kw: f(**kw)  # noqa: E731
        warm_up(fn, ms=100.0)
        ms, fl = timed_against_floor(lambda: bench_ms(fn, warmup=2, rep=20), lambda: bench_ms(floor))
        print(f"head support N{n} H{hd} V{v} {kw or 'full vocabulary'}: {ms:.1f} ms, {ms / fl:.2f}x GEMMs ({fl:.1f} ms)",
              flush=True)
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof

        f(top_k=50)
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            f(top_k=50)
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--head-only", action="store_true")
    ap.add_argument("--logits-only", action="store_true")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools/sampler_routes.py times CUDA kernels: no CUDA device here")
    if not a.head_only:
        logits_op_rows()
    if not a.logits_only:
        head_rows(a.profile)


if __name__ == "__main__":
    main()
