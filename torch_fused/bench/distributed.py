"""Multi-rank checks and timings of the sharded SinkGD step and the vocab-parallel ops, one process
per device: ``torchrun --nproc-per-node 2 -m torch_fused.bench --distributed [--quick] [--out DIR]``
(the same as ``-m torch_fused.bench.distributed``).

NCCL on CUDA devices (one per rank), gloo on CPUs (``--device cpu``; ``--quick`` sizes: a smoke
run). Every rank checks its results against the same computation on one device and reports it;
rank 0 writes ``distributed.json`` and ``distributed.md`` to ``--out``. Exit status 1 if a check
fails.

- **Vocab-parallel.** bf16 logits [N, V] (V = 151936) sharded ``Shard(-1)``: per-rank time of
  ``logprobs_and_entropy`` forward and forward+backward against the single-device op on the
  full logits (the same rank, the same data), and a baseline written the way RL frameworks
  write it (max all-reduce, fp32 exp, sum all-reduces, forward). The fused head with a
  ``Shard(0)`` [V, 4096] weight against the single-device head. Checks: log-probs, entropy and
  the logits' (weight's) gradient against the single-device results.
- **SinkGD under FSDP2.** Four Llama-3-8B layers' matrices (bf16) under ``fully_shard``: the
  per-rank ``SinkGD.step()`` time against the single-device fused step of the same layers, the
  collectives it makes (count and elements, ``CollectiveCounter``) and the time one all-reduce
  of that many elements takes here. Check: the parameters after two steps against the
  single-device steps' (plain, stochastic rounding, spectral).

Times are medians over ``--reps`` calls, each between barriers, the largest over the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import torch_fused
from torch_fused.collectives import CollectiveCounter

V_FULL = 151936
LAYER = [("q", 4096, 4096), ("k", 1024, 4096), ("v", 1024, 4096), ("o", 4096, 4096), ("gate", 14336, 4096),
         ("up", 14336, 4096), ("down", 4096, 14336)]


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, reps: int, warmup: int = 2) -> float:
    """Median ms of fn over reps calls, each between barriers; the largest median over ranks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    both = torch.isfinite(a) & torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return float("inf")
    return float((a[both] - b[both]).abs().max()) if both.any() else 0.0


def rl_baseline(x_local: torch.Tensor, idx: torch.Tensor, v_off: int):
    """Log-probs and entropy of vocabulary-sharded logits as RL frameworks write them: max
    all-reduce, fp32 exponentials, sum all-reduces (forward)."""
    xs = x_local.float()
    m = xs.max(-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    z = xs - m[:, None]
    e = z.exp()
    s = e.sum(-1)
    ez = (e * z).sum(-1)
    tgt = torch.zeros_like(m)
    local = idx - v_off
    mine = (local >= 0) & (local < xs.shape[-1])
    tgt[mine] = z.gather(-1, local.clamp(0, xs.shape[-1] - 1)[:, None]).squeeze(-1)[mine]
    for t in (s, ez, tgt):
        dist.all_reduce(t)
    return tgt - s.log(), s.log() - ez / s


def vocab_parallel(dev, mesh, sizes, v, hidden, reps, results, failures):
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, world = dist.get_rank(), dist.get_world_size()
    bounds = [v * r // world for r in range(world + 1)]  # Shard(-1)'s split (torch.chunk) for v % world == 0
    v_off = bounds[rank]
    for n in sizes:
        g = torch.Generator(device=dev).manual_seed(n)
        full = (torch.randn(n, v, device=dev, generator=g) * 3).to(torch.bfloat16)
        idx = torch.randint(0, v, (n,), device=dev, generator=g)
        x = distribute_tensor(full, mesh, [Shard(-1)])
        xl = x.to_local()

        def ours_fwd():
            return torch_fused.logprobs_and_entropy(x, idx)

        def single_fwd():
            return torch_fused.logprobs_and_entropy(full, idx)

        def fwdbwd(inp):
            leaf = inp.detach().requires_grad_(True)
            lp, ent = torch_fused.logprobs_and_entropy(leaf, idx)
            (lp.sum() + ent.sum()).backward()
            return lp, ent, leaf.grad

        row = dict(case="vocab-parallel logits", n=n, v=v, world=world)
        row["fwd_ms"] = timed(ours_fwd, dev, reps)
        row["single_fwd_ms"] = timed(single_fwd, dev, reps)
        row["fwdbwd_ms"] = timed(lambda: fwdbwd(x), dev, reps)
        row["single_fwdbwd_ms"] = timed(lambda: fwdbwd(full), dev, reps)
        row["rl_baseline_fwd_ms"] = timed(lambda: rl_baseline(xl, idx, v_off), dev, reps)
        with CollectiveCounter() as calls:
            lp, ent, gx = fwdbwd(x)
        row["collectives"], row["collective_elements"] = len(calls), sum(e for _, e in calls)
        slp, sent, sg = fwdbwd(full)
        row["err_logp"] = _max_err(lp.to_local(), slp)
        row["err_entropy"] = _max_err(ent.to_local(), sent)
        row["err_grad"] = _max_err(gx.to_local(), sg[:, bounds[rank]:bounds[rank + 1]])
        row["ok"] = row["err_logp"] <= 1e-3 and row["err_entropy"] <= 1e-3 and row["err_grad"] <= 1e-2
        results.append(row)
        if not row["ok"]:
            failures.append(row)
        del full, x, xl
    # the fused head with a vocabulary-sharded weight
    n = sizes[0]
    g = torch.Generator(device=dev).manual_seed(1)
    h = torch.randn(n, hidden, device=dev, generator=g).to(torch.bfloat16)
    w_full = (torch.randn(v, hidden, device=dev, generator=g) / hidden**0.5).to(torch.bfloat16)
    idx = torch.randint(0, v, (n,), device=dev, generator=g)
    w = distribute_tensor(w_full, mesh, [Shard(0)])

    def head(weight):
        hh = h.detach().requires_grad_(True)
        ww = weight.detach().requires_grad_(True)
        lp, ent = torch_fused.linear_logprobs_and_entropy(hh, ww, idx)
        (lp.sum() + ent.sum()).backward()
        return lp, ent, hh.grad, ww.grad

    row = dict(case="vocab-parallel fused head", n=n, v=v, h=hidden, world=world)
    row["fwdbwd_ms"] = timed(lambda: head(w), dev, reps)
    row["single_fwdbwd_ms"] = timed(lambda: head(w_full), dev, reps)
    with CollectiveCounter() as calls:
        lp, ent, dh, dw = head(w)
    row["collectives"], row["collective_elements"] = len(calls), sum(e for _, e in calls)
    slp, sent, sdh, sdw = head(w_full)
    row["err_logp"] = _max_err(lp.to_local(), slp)
    row["err_entropy"] = _max_err(ent.to_local(), sent)
    row["err_grad"] = max(_max_err(dh, sdh) / max(float(sdh.abs().max()), 1e-30),
                          _max_err(dw.to_local(), sdw[bounds[rank]:bounds[rank + 1]]) / max(float(sdw.abs().max()), 1e-30))
    row["ok"] = row["err_logp"] <= 2e-2 and row["err_entropy"] <= 2e-2 and row["err_grad"] <= 2e-2
    results.append(row)
    if not row["ok"]:
        failures.append(row)


def sinkgd_fsdp(dev, mesh, layers, div, reps, results, failures):
    from torch.distributed.fsdp import fully_shard
    from torch_fused.optim import SinkGD

    world = dist.get_world_size()
    shapes = [(f"L{i}.{name}", m // div, n // div) for i in range(layers) for name, m, n in LAYER]

    def model():
        g = torch.Generator(device=dev).manual_seed(0)
        mods = torch.nn.ModuleList()
        for _, m, n in shapes:
            lin = torch.nn.Linear(n, m, bias=False, device=dev, dtype=torch.bfloat16)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(m, n, device=dev, generator=g) * 0.02)
            mods.append(lin)
        return mods

    def grads(step):
        g = torch.Generator(device=dev).manual_seed(100 + step)
        return [torch.randn(m, n, device=dev, generator=g).to(torch.bfloat16) for _, m, n in shapes]

    for name, kw in (("plain", {}), ("stochastic rounding", dict(stochastic_round=True)),
                     ("spectral", dict(spectral_norm=True, spectral_target="muon"))):
        single, sharded = model(), model()
        for mod in sharded:
            fully_shard(mod, mesh=mesh)
        opt_s = SinkGD(single.parameters(), lr=0.02, **kw)
        opt_d = SinkGD(sharded.parameters(), lr=0.02, **kw)

        def set_grads(step):
            from torch.distributed.tensor import distribute_tensor

            for a, b, gr in zip(single.parameters(), sharded.parameters(), grads(step)):
                a.grad = gr
                b.grad = distribute_tensor(gr, b.device_mesh, b.placements)

        for step in range(2):  # the check: two steps from the same weights and gradients
            set_grads(step)
            opt_s.step()
            opt_d.step()
        err = max(_max_err(a.detach(), b.detach().full_tensor()) / max(float(a.detach().abs().max()), 1e-30)
                  for a, b in zip(single.parameters(), sharded.parameters()))
        with CollectiveCounter() as calls:
            opt_d.step()
        elems = sum(e for _, e in calls)
        row = dict(case=f"SinkGD FSDP2, {name}", layers=layers, matrices=len(shapes), world=world,
                   step_ms=timed(opt_d.step, dev, reps), single_step_ms=timed(opt_s.step, dev, reps),
                   collectives=len(calls), collective_elements=elems, rel_err=err)
        buf = torch.zeros(max(elems // max(len(calls), 1), 1), dtype=torch.float32, device=dev)
        row["all_reduces_ms"] = timed(lambda: [dist.all_reduce(buf) for _ in calls], dev, reps)
        # bf16 weights: one bf16 rounding of an update may differ between the two (the sums'
        # order); stochastic rounding uses the same random bits (the whole-parameter index)
        row["ok"] = err <= 2 ** -6
        results.append(row)
        if not row["ok"]:
            failures.append(row)
        del single, sharded, opt_s, opt_d


def markdown(meta: dict, results: list) -> str:
    lines = [f"{meta['device']}, world {meta['world']} ({meta['backend']}); torch {meta['torch']}, triton "
             f"{meta['triton']}. Per-rank median ms (the largest over ranks); ratio: sharded over one device.", "",
             "| case | shape | sharded ms | one device ms | ratio | checks |", "|---|---|---:|---:|---:|---|"]
    for r in results:
        if r["case"].startswith("SinkGD"):
            shape = f"{r['layers']} layers, {r['matrices']} matrices"
            lines.append(f"| {r['case']} step | {shape} | {r['step_ms']:.3f} | {r['single_step_ms']:.3f} | "
                         f"{r['step_ms'] / r['single_step_ms']:.2f} | rel err {r['rel_err']:.1e} "
                         f"{'ok' if r['ok'] else 'FAIL'}; {r['collectives']} collectives, {r['collective_elements']} "
                         f"elements, {r['all_reduces_ms']:.3f} ms as plain all-reduces |")
            continue
        shape = f"N {r['n']} V {r['v']}" + (f" H {r['h']}" if "h" in r else "")
        checks = (f"err logp {r['err_logp']:.1e}, entropy {r['err_entropy']:.1e}, grad {r['err_grad']:.1e} "
                  f"{'ok' if r['ok'] else 'FAIL'}")
        if "fwd_ms" in r:
            lines.append(f"| {r['case']} fwd | {shape} | {r['fwd_ms']:.3f} | {r['single_fwd_ms']:.3f} | "
                         f"{r['fwd_ms'] / r['single_fwd_ms']:.2f} | RL-style baseline fwd {r['rl_baseline_fwd_ms']:.3f} ms |")
        lines.append(f"| {r['case']} fwd+bwd | {shape} | {r['fwdbwd_ms']:.3f} | {r['single_fwdbwd_ms']:.3f} | "
                     f"{r['fwdbwd_ms'] / r['single_fwdbwd_ms']:.2f} | {checks} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="torchrun --nproc-per-node 2 -m torch_fused.bench.distributed",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run (CPU / gloo)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=None, help="result folder (default: a new torch_fused_bench_distributed_<time>)")
    ap.add_argument("--only", default="vocab,sinkgd", help="comma-separated: vocab, sinkgd")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run it under torchrun: torchrun --nproc-per-node 2 -m torch_fused.bench.distributed")
    from torch.distributed.device_mesh import init_device_mesh

    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    reps = args.reps or (3 if args.quick else 10)
    results, failures = [], []
    parts = set(args.only.split(","))
    if "vocab" in parts:
        v = 1024 * dist.get_world_size() if args.quick else V_FULL
        sizes = [64] if args.quick else [8192, 16384, 65536]
        vocab_parallel(dev, mesh, sizes, v, 64 if args.quick else 4096, reps, results, failures)
    if "sinkgd" in parts:
        sinkgd_fsdp(dev, mesh, 1 if args.quick else 4, 64 if args.quick else 1, reps, results, failures)
    # every rank's failures count
    bad = torch.tensor([len(failures)], device=dev)
    dist.all_reduce(bad)
    if dist.get_rank() == 0:
        import triton

        meta = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", world=dist.get_world_size(),
                    backend=backend, torch=torch.__version__, triton=triton.__version__, quick=args.quick)
        out = Path(args.out or time.strftime("torch_fused_bench_distributed_%Y%m%d_%H%M%S"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "distributed.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
        (out / "distributed.md").write_text(markdown(meta, results))
        print(markdown(meta, results), flush=True)
        print(f"results written to {out.resolve()}; {int(bad)} failed check(s) over the ranks", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if int(bad) else 0


def run_and_exit(argv=None) -> None:
    """Run main and leave the process without interpreter finalization.

    Once every rank has written its results and the process group is destroyed, nothing is left to do;
    but gloo's worker threads can still be torn down during finalization, and on torch 2.14 with two
    CPU ranks that occasionally aborts the process (``terminate called without an active exception``)
    after a clean run, which torchrun reports as a failed rank. Flushing and ``os._exit`` skip it.
    """
    try:
        code = main(argv)
    except SystemExit as e:  # argparse and the torchrun check
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()
