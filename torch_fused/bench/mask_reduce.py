"""Benchmarks of fused::mask_reduce against torch.where(...).sum and its torch.compile.

Floor: x read once (only its kept rows where the mask is constant along the contiguous dim and
so drops whole rows) + the mask's (and scale's) stored elements + y written, from
torch_fused.mask_reduce_cost, over the copy bandwidth of the same run. The torch.compile
baseline is compiled afresh for each case (static shapes).

Times are device times (common.device_ms: L2 flushed, the host kept ahead of the device), for
every implementation alike; the (8, 4096, 4096) calls take less device time than the host
path of a custom op, so do_bench's events would time the host there. Each row's note
gives the host's enqueue time per call as well: eager calls back to back run at the slower of
the two.
"""

from __future__ import annotations

import torch

import torch_fused
from torch_fused.settings import override

from .common import Row, device_ms, peak_extra_mb, warm_up

# (B, M, N), mask pattern, reduce dim 1
CASES = [
    ((65536, 4, 8192), "B M 1 expanded"),
    ((8192, 4, 8192), "full"),
    ((8, 4096, 4096), "1 M N expanded"),
    ((8, 4096, 4096), "B 1 N expanded"),
    ((8, 4096, 4096), "B M 1 expanded"),
    ((64, 512, 4096), "B M 1 expanded"),  # masked pooling over a sequence: row tiles, kept rows listed
]


def plain(x, mask):
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(1)


def make_mask(shape, pattern, g):
    """The benchmark's bool mask for a (B, M, N) case: 'full', or a mask stored with size 1 in the
    dims its pattern names 1 ('B M 1', '1 M N', 'B 1 N') and expanded to the full shape."""
    if pattern == "full":
        return torch.rand(shape, device="cuda", generator=g) > 0.5
    stored = [1 if name == "1" else size for name, size in zip(pattern.split()[:3], shape)]
    return (torch.rand(stored, device="cuda", generator=g) > 0.5).expand(shape)


def run(report, copy_gbps, quick=False):
    for shape, pattern in CASES[:1] if quick else CASES:
        torch._dynamo.reset()  # the baseline compiled for this shape and these strides alone
        compiled = torch.compile(plain, dynamic=False)
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        mask = make_mask(shape, pattern, g)
        cost = torch_fused.mask_reduce_cost(x, 1, mask)
        # a mask constant along the contiguous dim drops whole rows, which need not be read: the
        # floor is then the kept bytes; a per-element mask needs every sector of x read
        floor = cost["bytes"] if mask.stride(-1) == 0 else cost["floor_bytes"]
        name = f"{shape[0]}x{shape[1]}x{shape[2]} mask {pattern}"
        y = torch_fused.mask_reduce(x, 1, mask)
        ref = plain(x.float(), mask)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        warm_up(lambda: torch_fused.mask_reduce(x, 1, mask))
        for impl, fn in [("torch_fused", lambda: torch_fused.mask_reduce(x, 1, mask)),
                         ("torch.where eager", lambda: plain(x, mask)),
                         ("torch.compile where", lambda: compiled(x, mask))]:
            ms, host_ms = device_ms(fn)
            pk = peak_extra_mb(fn)
            note = f"host {host_ms * 1e3:.0f} us/call"
            if floor != cost["floor_bytes"]:
                # the kept-rows floor is the table's; beside it, the floor of x read once whole
                # (what a kernel that cannot skip rows must move)
                read_once_ms = cost["floor_bytes"] / (copy_gbps * 1e9) * 1e3
                note += f"; {read_once_ms / ms:.3f} of the x-read-once floor"
            if impl == "torch_fused":
                note += f"; rel err {err:.1e}; out {y.numel() * 2 / 2**20:.0f} MiB"
            report.rows.append(Row("mask_reduce dim 1", name, impl, ms, floor, peak_extra_mb=pk, note=note).finish(copy_gbps))
            r = report.rows[-1]
            print(f"mask_reduce {name:34s} {impl:22s} {ms:8.3f} ms  {r.frac_floor:.3f} of floor  peak {pk:.0f} MiB  "
                  f"host {host_ms * 1e3:.0f} us", flush=True)
        report.extra[name] = cost
        del x, mask
        torch.cuda.empty_cache()


# --sweep: the strip tiles (kernels/mask_reduce.py TILES) on the few-output cases. The row mask's
# ("B M 1") strips list its kept rows: their sweep is the strip width (row_mask_strip_min_bytes)
# and the listed walk's trips, warps and pipeline stages (compact_strip_*; 1 stage: ids loaded a
# trip ahead by hand), plus one point walking every row instead (compact_strips off)
SWEEP_CASES = [((8, 4096, 4096), p) for p in ("1 M N expanded", "B 1 N expanded", "B M 1 expanded", "full")]
SWEEP_GRID = dict(strip_min_bytes=(128, 256), strip_u=(4, 8, 16), strip_warps=(4, 8), programs_per_sm=(4, 8, 16))
ROW_MASK_SWEEP_GRID = dict(row_mask_strip_min_bytes=(128, 256, 512), compact_strip_rows=(16, 32, 64),
                           compact_strip_warps=(4, 8), compact_strip_stages=(1, 2, 3, 4))
ROW_MASK_SWEEP_EXTRA = [dict(compact_strips=False)]


def sweep_points(pattern: str):
    """The TILES entries of every sweep point of a case's mask pattern."""
    import itertools

    grid = ROW_MASK_SWEEP_GRID if pattern == "B M 1 expanded" else SWEEP_GRID
    for values in itertools.product(*grid.values()):
        yield dict(zip(grid, values))
    if pattern == "B M 1 expanded":
        yield from (dict(p) for p in ROW_MASK_SWEEP_EXTRA)


def sweep(copy_gbps, shape=None):
    """Device time of fused::mask_reduce over dim 1 at every sweep point of each mask of
    SWEEP_CASES (sweep_points: SWEEP_GRID, or the row mask's ROW_MASK_SWEEP_GRID; ``shape``:
    B,M,N instead of 8,4096,4096), beside
    torch.compile's time; fractions of the floor. The shipped choice is ``TILES``."""
    from ..kernels import mask_reduce as K

    shipped = dict(K.TILES)
    cases = [(tuple(shape), p) for _, p in SWEEP_CASES] if shape else SWEEP_CASES
    out = dict(copy_gbps=copy_gbps, shipped={k: shipped[k] for k in SWEEP_GRID},
               shipped_row_mask={k: shipped[k] for k in [*ROW_MASK_SWEEP_GRID, "compact_strips"]}, cases=[])
    for shp, pattern in cases:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(shp, device="cuda", dtype=torch.bfloat16, generator=g)
        mask = make_mask(shp, pattern, g)
        cost = torch_fused.mask_reduce_cost(x, 1, mask)
        floor_ms = (cost["bytes"] if mask.stride(-1) == 0 else cost["floor_bytes"]) / (copy_gbps * 1e9) * 1e3
        torch._dynamo.reset()
        compiled = torch.compile(plain, dynamic=False)
        c_ms = device_ms(lambda: compiled(x, mask), rep=30)[0]
        rows = []
        for point in sweep_points(pattern):
            with override(mask_reduce_tiles={**K.TILES, **point}):
                ms = device_ms(lambda: torch_fused.mask_reduce(x, 1, mask), rep=30)[0]
            rows.append(dict(point, ms=ms, frac=floor_ms / ms))
        best = max(rows, key=lambda r: r["frac"])
        print(f"mask_reduce sweep {shp} {pattern}: torch.compile {c_ms * 1e3:.1f} us "
              f"({floor_ms / c_ms:.3f}); best {best['ms'] * 1e3:.1f} us ({best['frac']:.3f}) at "
              f"{ {k: v for k, v in best.items() if k not in ('ms', 'frac')} }", flush=True)
        out["cases"].append(dict(shape=list(shp), mask=pattern, floor_ms=floor_ms, compile_ms=c_ms, rows=rows))
    return out
