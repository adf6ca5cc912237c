"""Tile sweep of SinkGD's one-read row pass (kernels/sinkgd.py::_sinkgd_rows_kernel) on one
Llama-3-8B layer and on GPT-2 small's 2-D weights (bf16): for each (ROWS_ELEMS, ROWS_MAX_WARPS,
ROWS_BM, ROWS_MIN_PROGRAMS, ROWS_RB), the row pass alone (every bucket's launch, an
iteration past the first) as a fraction of one read of G at the same-run copy bandwidth, and the
whole L=5 step against fused AdamW.
Every config's step is checked against the shipped config's. Configs are timed in interleaved
rounds, so the spread shows the run's noise. Run on the device:
python benchmarks/sinkgd_rows_tiles.py"""

import time

import torch
import triton.testing

import torch_fused  # noqa: F401
from torch_fused.bench.common import copy_bandwidth_gbps, warm_up
from torch_fused.bench.sinkgd import GPT2_SMALL, LLAMA_LAYER, _params
from torch_fused.kernels import sinkgd as K
from torch_fused.ops import sinkgd as S

OPS = torch.ops.fused
# overrides of kernels/sinkgd.py's ROWS_* settings (None: as shipped)
CONFIGS = [None, {"ELEMS": 16}, {"BM": 32, "MIN_PROGRAMS": 8}, {"ELEMS": 64}, {"RB": 2}]
NAMES = ("ELEMS", "MAX_WARPS", "BM", "MIN_PROGRAMS", "RB")
ROUNDS = 3


def ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def set_config(cfg):
    for k, v in cfg.items():
        setattr(K, "ROWS_" + k, v)
    S._PLANS.clear()


def profile(step):
    """Device time per kernel over 3 steps (a torch.profiler table)."""
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            print(p.key_averages().table(sort_by=key, row_limit=10, max_name_column_width=48), flush=True)
            return
        except Exception:  # the sort key's name depends on the torch version
            continue


def main():
    copy = copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s")
    shipped = {k: getattr(K, "ROWS_" + k) for k in NAMES}
    lr = torch.tensor(1e-3, device="cuda")
    seed = torch.zeros((), device="cuda")
    for name, shapes in [("Llama-3-8B x1 layer", LLAMA_LAYER), ("GPT-2 small", GPT2_SMALL)]:
        params = _params(shapes)
        ws = [p.data for p in params]
        gs = [p.grad for p in params]
        g_bytes = sum(g.numel() * g.element_size() for g in gs)
        floor_read = g_bytes / (copy * 1e9) * 1e3
        w32 = [torch.zeros(w.shape, device="cuda") for w in ws]  # checks: fp32 weights keep the whole update

        def step(out=ws):
            OPS.sinkgd_step(out, gs, [], lr, 0.05, 0.0, 1e-8, 5, False, "unit", 1, None, 1.0, False, seed)

        adam = torch.optim.AdamW(params, lr=1e-4, fused=True)
        adam.step()
        set_config(shipped)
        step(w32)
        ref = [w.clone() for w in w32]
        warm_up(step)
        profile(step)
        # host time of a step: enqueued behind a long sleep kernel, so nothing waits on the GPU
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)
        t0 = time.perf_counter()
        for _ in range(10):
            step()
        host_ms = (time.perf_counter() - t0) / 10 * 1e3
        torch.cuda.synchronize()
        print(f"{name}: host time per step (enqueue only) {host_ms:.3f} ms", flush=True)
        res = {}
        for rnd in range(ROUNDS):
            adam_ms = ms(adam.step)
            res.setdefault("adam", []).append(adam_ms)
            for cfg in CONFIGS:
                set_config({**shipped, **(cfg or {})})
                if rnd == 0:  # the shipped config's update (summation order differs: close, not equal)
                    for w in w32:
                        w.zero_()
                    step(w32)
                    for w, r_ in zip(w32, ref):
                        assert ((w - r_).norm() / r_.norm()).item() < 1e-5, cfg
                plan = S._plan(ws, gs, 0.05, None, 1.0)
                r = torch.ones(plan.lens[0], device="cuda")
                c = torch.ones(plan.lens[1], device="cuda")
                part = torch.empty(plan.lens[3], device="cuda")

                def rows():
                    for (bn, rb, bm, wp), align, even, (t_meta, t_first, n_mats, grid) in plan.fused:
                        K._sinkgd_rows_kernel[(grid,)](t_meta, t_first, n_mats, gs[0], r, c, part, 1e-8, ONES_R=False,
                                                       ONES_C=False, BLOCK_N=bn, RB=rb, BM=bm, ALIGN=align,
                                                       EVEN_N=even, num_warps=wp)

                res.setdefault((str(cfg), "rows"), []).append(ms(rows))
                res.setdefault((str(cfg), "step"), []).append(ms(step))
                res.setdefault((str(cfg), "ratio"), []).append(res[(str(cfg), "step")][-1] / adam_ms)
        print(f"shipped: {shipped}")
        print(f"{name}: G {g_bytes / 2**20:.0f} MiB, one-read floor {floor_read:.3f} ms, "
              f"AdamW fused {min(res['adam']):.3f} ms; buckets of the last config {[(c, a, e) for c, a, e, _ in plan.fused]}")
        for cfg in CONFIGS:
            rows_fr = sorted(floor_read / t for t in res[(str(cfg), "rows")])
            ratio = sorted(res[(str(cfg), "ratio")])
            print(f"  {str(cfg or 'shipped'):34s} row pass {min(res[(str(cfg), 'rows')]):.3f} ms "
                  f"({rows_fr[0]:.3f}/{rows_fr[-1]:.3f} of one read)  step L=5 {min(res[(str(cfg), 'step')]):.3f} ms "
                  f"= {ratio[0]:.2f}-{ratio[-1]:.2f}x AdamW", flush=True)
        set_config(shipped)
        del params, ws, gs, adam, w32, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
