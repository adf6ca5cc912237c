"""Forward log-prob/entropy kernel, this tree's against a previous one: interleaved timings as
fractions of the same-run copy floor, SWEEP=1 a (BLOCK_V, num_warps) sweep of this tree's kernel,
NCU=1 one launch of each for ncu. The previous kernel is read from benchmarks/_lp_prev.py; make
it with  git show 241ed7e:torch_fused/kernels/logprobs.py > benchmarks/_lp_prev.py  (the
block-max forward, before the per-thread running max).
python benchmarks/entropy_probe.py"""

import importlib.util
import os

import torch
import triton
import triton.testing

from torch_fused.bench.common import copy_bandwidth_gbps
from torch_fused.kernels import logprobs as NEW

_PREV = os.path.join(os.path.dirname(__file__), "_lp_prev.py")
if os.path.exists(_PREV):
    spec = importlib.util.spec_from_file_location("_lp_prev", _PREV)
    OLD = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(OLD)
else:
    OLD = NEW

NCU = os.environ.get("NCU") == "1"
SWEEP = os.environ.get("SWEEP") == "1"  # (BLOCK_V, num_warps) sweep of this tree's kernel
CFGS = [(1024, 2), (1024, 4), (512, 1), (512, 2), (2048, 4), (2048, 8)]


def launch(mod, x, idx, ent_flag, idx_flag, cfg=None):
    rows, v = (x.shape[0] * x.shape[1], x.shape[2])
    inner = x.shape[1]
    s_outer, s_inner = x.stride(0), x.stride(1)
    logp = torch.empty(rows, device=x.device)
    ent = torch.empty(rows, device=x.device)
    stats = torch.empty(rows, 2, device=x.device)
    block_v, warps = cfg or mod.pick_block(v, 2, "fwd_ent" if ent_flag else "fwd")
    extra = {"EPT": 8} if mod is NEW else {}
    mod._logprobs_entropy_forward_kernel[(rows,)](
        x, idx, logp, ent, stats, stats, v, 1, inner, s_outer, s_inner, NEW.LOG2E, -100,
        HAS_INDEX=idx_flag, HAS_ENT=ent_flag, EXACT_SHIFT=False, T_FROM_PTR=False,
        BLOCK_V=block_v, BLOCK_K=2, num_warps=warps, **extra)
    return logp, ent, stats


def main():
    copy = copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s")
    shapes = [(4, 4096, 151936, False), (4, 4096, 151936, True), (16, 4096, 32000, False)]
    if NCU:
        shapes = [(1, 2048, 151936, False)]
    for bb, ll, v, strided in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        base = torch.randn(bb, ll + (1 if strided else 0), v, device="cuda", dtype=torch.bfloat16, generator=g) * 3
        x = base[:, :-1] if strided else base
        idx = torch.randint(0, v, (bb * ll,), device="cuda", generator=g)
        floor_ms = x.numel() * 2 / (copy * 1e9) * 1e3
        # agreement of the two kernels
        lo, eo, so = launch(OLD, x, idx, True, True)
        ln, en, sn = launch(NEW, x, idx, True, True)
        print(f"B{bb} L{ll} V{v} {'strided' if strided else 'contig'}: max |dlogp| {(lo - ln).abs().max().item():.2e}"
              f"  max |dH| {(eo - en).abs().max().item():.2e}  m equal {bool((so[:, 0] == sn[:, 0]).all())}", flush=True)
        if NCU:
            for mod in (OLD, NEW):
                launch(mod, x, idx, True, False)
            torch.cuda.synchronize()
            continue
        if SWEEP:
            res = {}
            for rnd in range(2):
                for cfg in CFGS:
                    for name, ent_f, idx_f in [("ent", True, False), ("lp", False, True), ("lp+ent", True, True)]:
                        t = triton.testing.do_bench(lambda: launch(NEW, x, idx, ent_f, idx_f, cfg), return_mode="median")
                        res.setdefault((cfg, name), []).append(floor_ms / t)
            for (cfg, name), fr in res.items():
                print(f"   {str(cfg):12s} {name:7s} floor fraction {max(fr):.3f} (rounds {', '.join(f'{f:.3f}' for f in fr)})",
                      flush=True)
            del base, x
            torch.cuda.empty_cache()
            continue
        res = {}
        for rnd in range(3):
            for name, mod, ent_f, idx_f in [("old ent", OLD, True, False), ("new ent", NEW, True, False),
                                             ("old lp", OLD, False, True), ("new lp", NEW, False, True),
                                             ("old lp+ent", OLD, True, True), ("new lp+ent", NEW, True, True)]:
                t = triton.testing.do_bench(lambda: launch(mod, x, idx, ent_f, idx_f), return_mode="median")
                res.setdefault(name, []).append(floor_ms / t)
        for name, fr in res.items():
            fr = sorted(fr)
            print(f"   {name:12s} floor fraction min/med/max {fr[0]:.3f}/{fr[1]:.3f}/{fr[2]:.3f}", flush=True)
        del base, x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
