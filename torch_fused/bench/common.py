"""Benchmark harness: same-run copy bandwidth, timing, peak memory, and the result files.

Every row reports the fraction of the memory floor: the fewest bytes the op must move (each
input read once, each output written once) over the device-to-device copy bandwidth measured
in the same run, divided by the measured time. A ratio to a same-run measurement survives a
noisy or differently clocked machine; an absolute time does not.
"""

from __future__ import annotations

import statistics

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class Row:
    group: str  # e.g. "selective_log_softmax fwd"
    shape: str  # e.g. "B8 L1024 V151936 strided"
    impl: str  # e.g. "torch_fused", "torch eager"
    ms: float
    floor_bytes: int
    floor_ms: float = 0.0
    frac_floor: float = 0.0
    gbps: float = 0.0
    peak_extra_mb: float | None = None
    note: str = ""

    def finish(self, copy_gbps: float) -> "Row":
        self.floor_ms = self.floor_bytes / (copy_gbps * 1e9) * 1e3
        self.frac_floor = self.floor_ms / self.ms if self.ms > 0 else 0.0
        self.gbps = self.floor_bytes / (self.ms * 1e-3) / 1e9 if self.ms > 0 else 0.0
        return self


@dataclass
class Report:
    device: str = ""
    torch: str = torch.__version__
    triton: str = ""
    copy_gbps: float = 0.0
    rows: list[Row] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


MIN_SAMPLES = 10  # timed calls behind every bench_ms median


def bench_ms(fn, warmup=25, rep=100) -> float:
    """Median ms of fn by triton's do_bench, over at least MIN_SAMPLES timed calls: do_bench
    fits rep milliseconds, which for a call of 40-300 ms is one to three calls, so rep grows
    until the calls fit."""
    import triton.testing

    while True:
        times = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="all")
        if isinstance(times, float):  # a triton without return_mode="all": its mean
            return times
        if len(times) >= MIN_SAMPLES:
            return float(statistics.median(times))
        rep = rep * MIN_SAMPLES / max(len(times), 1) * 1.2


def device_ms(fn, rep: int = 60, lead_us: float = 1000.0, flush_bytes: int = 256 << 20) -> tuple[float, float]:
    """(median device ms, median host enqueue ms) of one call of fn.

    Two biases of do_bench are removed, for every implementation alike:
    - Host time. do_bench's events bracket the host's launch path as well whenever that path
      outlasts the device work queued before it, so a short kernel behind a longer Python
      dispatch reads as part of the dispatch. Here a device-side spin of lead_us precedes each
      call, so the host has enqueued the events and the call before the device reaches them.
    - Dirty L2. do_bench flushes L2 by zeroing a buffer, which leaves up to the whole L2 dirty;
      the timed call then pays for writing those lines back. Here the flush reads a buffer
      instead, so L2 holds clean lines of it.
    (What each bias measured: docs/BENCHMARKS.md, "Method".)
    The host's enqueue time is returned beside it; if it is not well inside lead_us the device
    time is not clean, and this raises."""
    import time

    fn()
    torch.cuda.synchronize()
    cache = torch.zeros(flush_bytes // 4, dtype=torch.float32, device="cuda")
    # the spin's cycles per microsecond, from one timed spin
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(1_000_000)
    e.record()
    torch.cuda.synchronize()
    cycles = int(1_000_000 / (s.elapsed_time(e) * 1e3) * lead_us)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    host = []
    for i in range(rep):
        cache.sum()  # a read-only pass: evicts what fn left in L2 without leaving dirty lines
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        starts[i].record()
        fn()
        ends[i].record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    dev = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    host.sort()
    if host[rep // 2] > 0.8 * lead_us * 1e-3:
        raise RuntimeError(f"host enqueue {host[rep // 2]:.3f} ms is not well inside the {lead_us} us lead")
    return dev[rep // 2], host[rep // 2]


def warm_up(fn, ms: float = 300.0) -> None:
    """Run fn back to back for about ms milliseconds (device time), so the first timing of a
    group does not catch the GPU's clocks ramping up after host-side setup (new inputs, a dynamo
    reset), which would slow the group's first row (docs/BENCHMARKS.md, "Method")."""
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()


def head_inputs(n: int, hd: int, v: int, g: torch.Generator):
    """The fused-head suites' inputs, drawn in this order from generator ``g`` (on their device):
    bf16 hidden states ``h`` [n, hd] and weight ``w`` [v, hd] (scaled so the logits are O(1)), both
    requiring grad, ids ``idx`` [n], and a bf16 d logits ``dl`` [n, v] for the bare backward GEMMs."""
    dev = g.device
    h = torch.randn(n, hd, device=dev, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, hd, device=dev, generator=g) / hd**0.5 * 2).to(torch.bfloat16).requires_grad_(True)
    idx = torch.randint(0, v, (n,), device=dev, generator=g)
    dl = torch.randn(n, v, device=dev, dtype=torch.bfloat16, generator=g)
    return h, w, idx, dl


def timed_against_floor(time_op, time_floor) -> tuple[float, float]:
    """(op ms, floor ms): the floor timed right before and right after the op, in this order,
    and its ms the mean of the two, so that the clocks' drift over a suite (GEMMs run the chip at
    its power limit) weighs on the op and its floor alike. time_op and time_floor take no
    arguments and return one timing in ms each (bench_ms of the call, or a CPU timer)."""
    before = time_floor()
    ms = time_op()
    return ms, (before + time_floor()) / 2


def copy_bandwidth_gbps(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (device_ms:
    clean L2, the host kept ahead)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = device_ms(lambda: b.copy_(a), rep=20)[0]
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def peak_extra_mb(fn, minus_bytes: int = 0) -> float:
    """Peak memory above what was allocated before the call (outputs included, less minus_bytes:
    e.g. the returned gradients), in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (peak - base - minus_bytes) / 2**20


def new_report() -> Report:
    import triton

    r = Report()
    r.device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    r.triton = triton.__version__
    return r


def markdown(report: Report) -> str:
    lines = [
        f"Device: {report.device}; torch {report.torch}; triton {report.triton}; "
        f"copy bandwidth (read+write) measured in this run: {report.copy_gbps:.0f} GB/s",
        "",
        "| group | shape | impl | ms | GB/s (floor bytes) | fraction of floor | peak extra MiB | note |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in report.rows:
        pk = "" if r.peak_extra_mb is None else f"{r.peak_extra_mb:.0f}"
        lines.append(
            f"| {r.group} | {r.shape} | {r.impl} | {r.ms:.3f} | {r.gbps:.0f} | {r.frac_floor:.3f} | {pk} | {r.note} |"
        )
    return "\n".join(lines) + "\n"


def save(report: Report, out_dir: Path, name: str, markdown_fn=None, plot_fn=None) -> None:
    """<name>.json, .md and .png under out_dir; a suite with its own table and plot passes them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = asdict(report)
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1))
    (out_dir / f"{name}.md").write_text((markdown_fn or markdown)(report))
    try:
        (plot_fn or plot)(report, out_dir / f"{name}.png")
    except Exception as e:  # matplotlib not installed (the `bench` extra): the JSON and markdown are written
        print(f"(no plot: {e})")


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(r.group for r in report.rows))
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 2.2 + 0.9 * len(groups) * 2), squeeze=False)
    for ax, g in zip(axes[:, 0], groups):
        rows = [r for r in report.rows if r.group == g]
        labels = [f"{r.shape} | {r.impl}" for r in rows]
        ax.barh(range(len(rows)), [r.frac_floor for r in rows],
                color=["tab:green" if r.impl == "torch_fused" else "tab:gray" for r in rows])
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(labels, fontsize=6)
        ax.axvline(1.0, color="k", lw=0.5)
        ax.set_xlim(0, 1.1)
        ax.set_title(f"{g}: fraction of memory floor (higher is better)", fontsize=8)
        ax.invert_yaxis()
    fig.suptitle(f"{report.device}, copy {report.copy_gbps:.0f} GB/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
