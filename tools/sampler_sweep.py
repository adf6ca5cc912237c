"""Launch configurations of the sampler's filter kernel (kernels/sampler.py: min-p and top-k, one
streaming pass or two) on CUDA, timed against one read of the logits (``amax`` over the rows), with
each configuration's thresholds and support lists checked equal to the first's and the default
configuration's thresholds checked equal to the plain-PyTorch rule's.

    python tools/sampler_sweep.py                  # the configurations below
    python tools/sampler_sweep.py --out DIR        # and DIR/sampler_sweep.json
    python tools/sampler_sweep.py --configs 2      # the first two configurations

Then the top-p kernel (top-p alone) under a few (programs per multiprocessor, warps, sample
size), each with its band listed in order and appended. A filter configuration is (block: the
lanes and elements a step, cap: the working list, programs per multiprocessor, warps), each with one pass and with two (``sampler_filter_one_pass``), each with
its rows' tails in the streaming programs and in a kernel of their own (``sampler_filter_split``); the
defaults are kernels/sampler.py ``config`` and ``FILTER_PROGRAMS_PER_SM``. bf16 logits randn * 3
at N 4096 / V 151936 and N 16384 / V 32000.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from torch_fused.bench.common import bench_ms, warm_up
from torch_fused.kernels import sampler as K
from torch_fused.ops import sampler as S
from torch_fused.settings import override

CONFIGS = (
    (2048, 1024, 8, 4), (2048, 1024, 4, 8), (1024, 512, 16, 4), (1024, 1024, 16, 2), (4096, 1024, 4, 8),
    (4096, 1024, 2, 16), (2048, 1024, 2, 8),
)
OPTIONS = (dict(top_k=50), dict(min_p=0.05), dict(top_k=50, top_p=0.9))
# the top-p kernel's (programs per multiprocessor, warps, sample size); the first is the default
TOP_P_CONFIGS = ((4, 8, 8192), (2, 8, 8192), (4, 4, 8192), (4, 8, 4096), (8, 4, 4096))


def _thresholds(x, opt):
    return S.threshold_launches(x, None, 1.0, False, opt.get("top_k"), opt.get("top_p"), opt.get("min_p"))


def _top_p_rows(x, n, v, fl, configs):
    """The top-p kernel (top-p alone) under TOP_P_CONFIGS, each with its band listed in order and
    appended (``sampler_top_p_append``): its time against one read, the rows it leaves to the
    exact kernel, and the rows whose threshold differs from the default configuration's (the
    band's sums in another order can move a cut that lies within fp32 rounding of top_p)."""
    from torch_fused.ops.sampler import threshold_launches

    base, base_pps = K.config, K.PROGRAMS_PER_SM
    out, ref = [], None
    for c in TOP_P_CONFIGS[:configs]:
        for append in (False, True):
            K.config = lambda e, vv, small, c=c: base(e, vv, small)._replace(warps=c[1], sample=c[2])
            K.PROGRAMS_PER_SM = c[0]
            try:
                with override(sampler_top_p_append=append):
                    _, sup, _ = threshold_launches(x, None, 1.0, False, None, 0.9, None, finish=False)
                    exact = int((sup[:, 0] == -2).sum())
                    fn = lambda: _thresholds(x, dict(top_p=0.9))  # noqa: E731
                    t, _ = fn()
                    ref = ref if ref is not None else t.clone()
                    moved = int((t != ref).sum())
                    warm_up(fn, ms=30.0)
                    ms = bench_ms(fn, warmup=2, rep=20)
            finally:
                K.config, K.PROGRAMS_PER_SM = base, base_pps
            band = "appended band" if append else "ordered band"
            print(f"N{n} V{v} top_p 0.9 programs/SM {c[0]} warps {c[1]} sample {c[2]} {band}: {ms:.3f} ms = "
                  f"{ms / fl:.2f}x one read; rows to the exact kernel {exact}; thresholds moved {moved}", flush=True)
            out.append(dict(n=n, v=v, options=dict(top_p=0.9), config=list(c), append=append, ms=ms, x_read=ms / fl,
                            exact_rows=exact, moved=moved))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", type=int, default=len(CONFIGS), help="the first this many configurations only")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools/sampler_sweep.py times CUDA kernels: no CUDA device here")
    base, base_pps = K.config, K.FILTER_PROGRAMS_PER_SM
    rows = []
    for n, v in ((4096, 151936), (16384, 32000)):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(n, v, device="cuda", generator=g) * 3).to(torch.bfloat16)
        floor = lambda: x.amax(-1)  # noqa: E731
        warm_up(floor, ms=100.0)
        fl = bench_ms(floor, warmup=3, rep=30)
        print(f"N{n} V{v} one read of the logits (amax): {fl:.3f} ms", flush=True)
        for opt in OPTIONS:
            tau, sup = _thresholds(x, opt)
            with override(sampler_kernels=False):
                rule, _ = _thresholds(x, opt)
            print(f"N{n} V{v} {opt}: default thresholds equal the rule's: {bool(torch.equal(tau, rule))}; rows "
                  f"listed {(sup[:, 0] >= 0).float().mean().item():.3f}", flush=True)
            first = None
            for c in CONFIGS[:a.configs]:
                for one_pass, split in ((True, False), (False, False), (True, True), (False, True)):
                    K.config = lambda e, vv, small, c=c: base(e, vv, small)._replace(block=c[0], cap=c[1],
                                                                                     filter_warps=c[3])
                    K.FILTER_PROGRAMS_PER_SM = c[2]
                    try:
                        with override(sampler_filter_one_pass=one_pass, sampler_filter_split=split):
                            fn = lambda: _thresholds(x, opt)  # noqa: E731
                            t, s = fn()
                            first = first or (t.clone(), s.clone())
                            same = bool(torch.equal(t, first[0]) and torch.equal(s, first[1]))
                            warm_up(fn, ms=30.0)
                            ms = bench_ms(fn, warmup=2, rep=20)
                    finally:
                        K.config, K.FILTER_PROGRAMS_PER_SM = base, base_pps
                    passes = ("one pass" if one_pass else "two passes") + (", split tail" if split else "")
                    print(f"N{n} V{v} {opt} block {c[0]} cap {c[1]} programs/SM {c[2]} warps {c[3]} {passes}: "
                          f"{ms:.3f} ms = {ms / fl:.2f}x one read; same thresholds and lists: {same}", flush=True)
                    rows.append(dict(n=n, v=v, options=opt, config=list(c), one_pass=one_pass, split=split, ms=ms,
                                     x_read=ms / fl, same=same))
        rows += _top_p_rows(x, n, v, fl, a.configs)
        del x
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "sampler_sweep.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
