"""SinkGD on sharded parameters: one rank's work against the single-device fused step.

``python -m torch_fused.bench.sinkgd_sharded --out DIR`` (one GPU) builds four Llama-3-8B
layers' matrices (q 4096x4096, k and v 1024x4096, o 4096x4096, gate and up 14336x4096, down
4096x14336; bf16 weights and gradients) and times, per configuration (plain, stochastic
rounding, spectral "muon"; 5 Sinkhorn iterations):

- the fused single-device step on the whole layers (``torch_fused.optim.sinkgd_step`` with a
  ``SinkGDCache``, as the optimizer calls it);
- the sharded step (optim/sharded.py) of rank 0 of a world of ``--world`` ranks: its row
  shard of every matrix, as ``fully_shard`` leaves it. The process group is PyTorch's fake
  backend (every collective returns at once, leaving its input as it is), so the time is the
  rank's local work, and the collectives it makes are counted with their payloads.

The sharded step runs in each of ``modes``: ``fused`` (its default on a GPU: the fused
step's kernels on the local rows, the all-reduces between their launches), ``compiled`` and
``eager`` (its PyTorch-op path, the ``sinkgd_sharded_fused`` setting off, with the chunk functions compiled or
eager). Times are CUDA-event medians of whole calls (host work included: the sharded step is
eager) and the sum of the device kernels' times of one call (torch.profiler). Before the
timing, a world of 1 (the whole matrices through the sharded path) is compared with the fused
step on one layer: bf16 entries that differ and by how many ulps.

``--tiny`` runs small shapes on the CPU (a check of the script; the times mean nothing).
Writes sinkgd_sharded.json and sinkgd_sharded.md into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from ..settings import override
from ..collectives import CollectiveCounter

LLAMA3_8B_LAYER = [("q", 4096, 4096), ("k", 1024, 4096), ("v", 1024, 4096), ("o", 4096, 4096),
                   ("gate", 14336, 4096), ("up", 14336, 4096), ("down", 4096, 14336)]
CONFIGS = {
    "plain": dict(sinkhorn_iters=5),
    "stochastic_round": dict(sinkhorn_iters=5, stochastic_round=True),
    "spectral_muon": dict(sinkhorn_iters=5, spectral_norm=True, spectral_target="muon", spectral_iters=1),
}


def _shapes(layers: int, tiny: bool):
    div = 64 if tiny else 1
    return [(f"L{i}.{name}", m // div, n // div) for i in range(layers) for name, m, n in LLAMA3_8B_LAYER]


def _init_fake_group(world: int, rank: int = 0):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _shard(full: torch.Tensor, mesh, rank: int, world: int):
    """Rank ``rank``'s Shard(0) DTensor of ``full`` (torch.chunk's split), holding only its rows."""
    from torch.distributed.tensor import DTensor, Shard

    m = full.shape[0]
    step = -(-m // world)
    lo, hi = min(rank * step, m), min(m, (rank + 1) * step)
    return DTensor.from_local(full[lo:hi].clone(), mesh, [Shard(0)], run_check=False, shape=full.shape,
                              stride=full.stride())


def _time(fn, dev, warmup: int, reps: int) -> float:
    """Median ms of fn() (CUDA events on a GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            out.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _kernel_ms(fn, dev) -> float | None:
    """Sum of the device kernels' times of one call of fn (torch.profiler), in ms."""
    if dev.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def _peak_extra_mb(fn, dev) -> float | None:
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 ulps between same-signed entries (sign changes count as the
    sum of both sides' distances from zero)."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    oa = torch.where(ia < 0, -(ia & 0x7FFF), ia)  # sign-magnitude to a monotone integer
    ob = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((oa - ob).abs().max()) if a.numel() else 0


def run(out_dir: Path, layers: int = 4, world: int = 2, tiny: bool = False, reps: int = 5, warmup: int = 2,
        configs=tuple(CONFIGS), modes=None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from torch_fused.optim import SinkGDCache, sinkgd_step
    from torch_fused.optim.sharded import sinkgd_step_sharded
    from torch_fused.optim.sinkgd import _warm_start

    dev = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    shapes = _shapes(layers, tiny)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ws, gs = [], []
    for _, m, n in shapes:
        ws.append((torch.randn(m, n, generator=gen) * 0.02).to(torch.bfloat16).to(dev))
        gs.append((torch.randn(m, n, generator=gen) * torch.rand(n, generator=gen) * 1e-3).to(torch.bfloat16).to(dev))
    lr = torch.tensor(1e-2, device=dev)
    n_params = sum(m * n for _, m, n in shapes)
    report = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
                  torch=torch.__version__, layers=layers, world=world, rank=0, params=n_params,
                  shapes=[list(s) for s in shapes], tiny=tiny, check={}, rows=[])

    from torch_fused.optim import sharded

    if modes is None:  # the fused kernels and the compiled chunk functions: on CUDA only
        modes = ["fused", "compiled"] if dev.type == "cuda" else ["eager"]

    modes_set = contextlib.ExitStack()  # the settings as they were, restored at the end

    def set_mode(mode):
        modes_set.enter_context(override(sinkgd_sharded_fused=mode == "fused",
                                         sinkgd_sharded_compile=mode == "compiled"))

    # --- the sharded path at world 1 (whole matrices) against the fused step, one layer
    _init_fake_group(1)
    mesh = init_device_mesh(dev.type, (1,))
    k = len(LLAMA3_8B_LAYER)
    for mode, name in [(mo, na) for mo in modes for na in configs]:
        set_mode(mode)
        cfg = CONFIGS[name]
        a = [w.clone() for w in ws[:k]]
        b = [_shard(w, mesh, 0, 1) for w in ws[:k]]
        bg = [_shard(g, mesh, 0, 1) for g in gs[:k]]
        va = [_warm_start(w) for w in a] if cfg.get("spectral_norm") else None
        vb = [_warm_start(w) for w in a] if cfg.get("spectral_norm") else None
        step = torch.tensor(1.0, device=dev)
        sinkgd_step(a, gs[:k], lr=lr, spectral_vecs=va, step=step, **cfg)
        try:
            sinkgd_step_sharded(b, bg, lr=lr, spectral_vecs=vb, step=step, **cfg)
        except Exception as e:  # recorded: the timing below still runs
            report["check"][f"{name}, {mode}"] = dict(error=f"{type(e).__name__}: {e}"[:2000])
            continue
        diff = sum(int((x.view(torch.int16) != y.to_local().view(torch.int16)).sum()) for x, y in zip(a, b))
        total = sum(x.numel() for x in a)
        report["check"][f"{name}, {mode}"] = dict(bf16_entries_differing=diff, fraction=diff / total,
                                                  max_ulps=max(_ulps_bf16(x, y.to_local()) for x, y in zip(a, b)))
        print(f"[sinkgd_sharded] check {name} {mode}: {report['check'][f'{name}, {mode}']}", file=sys.stderr,
              flush=True)
        del a, b, bg

    # --- rank 0 of `world`: its row shards; collectives are the fake backend's no-ops
    _init_fake_group(world, 0)
    mesh = init_device_mesh(dev.type, (world,))
    sp = [torch.nn.Parameter(_shard(w, mesh, 0, world)) for w in ws]
    sg = [_shard(g, mesh, 0, world) for g in gs]
    cache = SinkGDCache()
    local_params = sum(p.to_local().numel() for p in sp)
    for name in configs:
        cfg = CONFIGS[name]
        step = torch.tensor(1.0, device=dev)
        vf = [_warm_start(w) for w in ws] if cfg.get("spectral_norm") else None
        vs = [_warm_start(p) for p in sp] if cfg.get("spectral_norm") else None

        def fused():
            sinkgd_step(ws, gs, lr=lr, spectral_vecs=vf, step=step, cache=cache, **cfg)

        def shard():
            sinkgd_step_sharded(sp, sg, lr=lr, spectral_vecs=vs, step=step, **cfg)

        set_mode(modes[0])
        with CollectiveCounter() as calls:
            shard()
        row = dict(config=name, **{k_: v for k_, v in cfg.items()})
        row["fused_full_ms"] = _time(fused, dev, warmup, reps)
        row["fused_full_kernel_ms"] = _kernel_ms(fused, dev)
        for mode in modes:
            set_mode(mode)
            sfx = "" if mode == modes[0] else f"_{mode}"
            try:
                row[f"shard{sfx}_ms"] = _time(shard, dev, warmup, reps)
                row[f"shard{sfx}_kernel_ms"] = _kernel_ms(shard, dev)
                row[f"shard{sfx}_peak_extra_mb"] = _peak_extra_mb(shard, dev)
            except Exception as e:  # recorded: the other rows still come out
                row[f"shard{sfx}_error"] = f"{type(e).__name__}: {e}"[:2000]
                row.setdefault(f"shard{sfx}_ms", None)
                row.setdefault(f"shard{sfx}_kernel_ms", None)
                row.setdefault(f"shard{sfx}_peak_extra_mb", None)
            print(f"[sinkgd_sharded] {name} {mode}: {row.get(f'shard{sfx}_ms')} ms", file=sys.stderr, flush=True)
        set_mode(modes[0])
        row["fused_full_peak_extra_mb"] = _peak_extra_mb(fused, dev)
        row["collectives"] = len(calls)
        row["collective_ops"] = sorted({c for c, _ in calls})
        row["collective_elements"] = sum(n for _, n in calls)
        row["collective_elements_per_call"] = [n for _, n in calls]
        ok = row["shard_ms"] is not None
        row["shard_vs_fused_full"] = row["shard_ms"] / row["fused_full_ms"] if ok else None
        row["shard_vs_fused_share"] = (row["shard_ms"] / (row["fused_full_ms"] * local_params / n_params)
                                       if ok else None)
        report["rows"].append(row)
    modes_set.close()
    report["shard_modes"] = modes
    report["local_params"] = local_params
    report["columns"] = sum(n for _, _, n in shapes)

    import torch.distributed as dist

    dist.destroy_process_group()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sinkgd_sharded.json").write_text(json.dumps(report, indent=1))
    (out_dir / "sinkgd_sharded.md").write_text(markdown(report))
    return report


def markdown(r: dict) -> str:
    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    lines = [f"# SinkGD, sharded step of rank 0 of {r['world']} vs the fused single-device step",
             "",
             f"{r['device']}, torch {r['torch']}; {r['layers']} Llama-3-8B layers"
             f"{' (tiny: shapes / 64)' if r['tiny'] else ''}, bf16, {r['params'] / 1e6:.0f}M parameters, "
             f"rank 0 holds {r['local_params'] / 1e6:.0f}M; sum of columns {r['columns']}.",
             "",
             "| config | fused, whole layers (ms) | kernels (ms) | sharded, rank 0 (ms) | kernels (ms) | "
             "shard / fused | shard / fused's share | all-reduces | elements | peak extra MiB shard / fused "
             + "".join(f"| sharded, {mo} (ms) | kernels (ms) " for mo in r["shard_modes"][1:]) + "|",
             "|---|---|---|---|---|---|---|---|---|---|" + "---|---|" * len(r["shard_modes"][1:])]
    for row in r["rows"]:
        lines.append(
            f"| {row['config']} | {f(row['fused_full_ms'])} | {f(row['fused_full_kernel_ms'])} | {f(row['shard_ms'])} "
            f"| {f(row['shard_kernel_ms'])} | {f(row['shard_vs_fused_full'])} | {f(row['shard_vs_fused_share'])} "
            f"| {row['collectives']} | {row['collective_elements']} | {f(row['shard_peak_extra_mb'], '{:.0f}')} / "
            f"{f(row['fused_full_peak_extra_mb'], '{:.0f}')} "
            + "".join(f"| {f(row.get(f'shard_{mo}_ms'))} | {f(row.get(f'shard_{mo}_kernel_ms'))} "
                      for mo in r["shard_modes"][1:]) + "|")
    lines += ["", f"Sharded step's modes: {' and '.join(r['shard_modes'])} (first: the main columns; fused: the "
              "fused step's kernels on the local rows; compiled / eager: its PyTorch ops, chunk functions "
              "compiled or not). "
              "\"fused's share\": the fused step's time times the rank's fraction of the parameters. "
              "Collectives are counted on rank 0 with the fake backend (each returns at once).", "",
              "Check, world 1 (whole matrices through the sharded path) against the fused step, one layer:", "",
              "| config | bf16 entries differing | fraction | max ulps |", "|---|---|---|---|"]
    for name, c in r["check"].items():
        if "error" in c:
            lines.append(f"| {name} | error: {c['error'][:200]} | | |")
        else:
            lines.append(f"| {name} | {c['bf16_entries_differing']} | {c['fraction']:.2e} | {c['max_ulps']} |")
    errors = [(row["config"], k_, v) for row in r["rows"] for k_, v in row.items() if k_.endswith("_error")]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {c} {k_}: {v[:300]}" for c, k_, v in errors]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for sinkgd_sharded.json and .md")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--world", type=int, default=2, help="ranks the rows are split over (rank 0 is timed)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (checks the script)")
    ap.add_argument("--modes", nargs="+", choices=["fused", "compiled", "eager"],
                    help="sharded-step paths, the first one the main columns (default: fused compiled on CUDA, "
                         "eager on the CPU)")
    a = ap.parse_args(argv)
    if a.layers < 1 or a.world < 1 or a.reps < 1:
        ap.error("--layers, --world and --reps: expected >= 1")
    r = run(a.out, layers=a.layers, world=a.world, tiny=a.tiny, reps=a.reps, warmup=a.warmup,
            configs=tuple(a.configs), modes=a.modes)
    print(markdown(r))


if __name__ == "__main__":
    main()
