"""Tile sweep of fused::mask_reduce on the three benchmark cases (bf16 x, bool mask), with a
correctness check per config, against the shipped picker. Configs are
(BLOCK_R, BLOCK_I, num_warps, VEC, PIPELINE, U): a trip loads a [U, BLOCK_R, BLOCK_I] tile, VEC = 8
bf16 elements (16 bytes) per thread and row, U rows per thread and column run.
Run on the device: python benchmarks/mask_reduce_tiles.py"""

import os

import torch
import triton
import triton.testing

import torch_fused
from torch_fused.bench.common import copy_bandwidth_gbps, device_ms
from torch_fused.bench.mask_reduce import make_mask
from torch_fused.kernels import mask_reduce as K

CASES = [((65536, 4, 8192), "B M 1 expanded"), ((8192, 4, 8192), "full"), ((8, 4096, 4096), "1 M N expanded")]
CONFIGS = {
    "B M 1 expanded": [None, (1, 1024, 4, 8, False, 4), (1, 2048, 8, 8, False, 4)],
    "full": [None, (1, 1024, 4, 8, False, 4), (1, 2048, 8, 8, False, 4)],
    # sm_90 registers per thread (local triton 3.8 compile) in the comments: they set programs per SM
    # rows of 128 B (BLOCK_I 64) to 512 B, 4 or 8 rows per thread
    "1 M N expanded": [None, (32, 64, 8, 8, False, 4), (32, 64, 8, 8, False, 8), (32, 128, 16, 8, False, 4),
                       (32, 128, 16, 8, False, 8), (32, 256, 32, 8, False, 4), (16, 128, 8, 8, False, 8),
                       (16, 64, 4, 8, False, 8), (16, 64, 4, 8, True, 4), (32, 64, 8, 8, True, 4),
                       (64, 64, 16, 8, False, 4), (16, 256, 16, 8, False, 8), (64, 128, 32, 8, False, 4),
                       (16, 128, 8, 8, False, 4)],
}
ROUNDS = 3  # every config timed ROUNDS times, interleaved: the spread shows the run's noise
HINTS = os.environ.get("HINTS") == "1"  # instead: the shipped tile with and without eviction hints
ONLY = os.environ.get("ONLY")
NOMASK = os.environ.get("NOMASK") == "1"  # also time each config once without a mask  # e.g. ONLY="1 M N expanded": that case alone


def main():
    copy = copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s")
    orig = K.pick_blocks
    for shape, pat in CASES:
        if ONLY and pat != ONLY:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        bb, m, n = shape
        mask = make_mask(shape, pat, g)
        floor_ms = torch_fused.mask_reduce_cost(x, 1, mask)["floor_bytes"] / (copy * 1e9) * 1e3
        ref = torch.where(mask, x.float(), 0.0).sum(1)
        print(f"{pat}: shipped picks {orig(m, n, bb, False, 2, torch.cuda.get_device_properties(0).multi_processor_count)}")
        times = {}
        nomask = {}
        for rnd in range(0 if HINTS else ROUNDS):
            for cfg in CONFIGS[pat]:
                K.pick_blocks = orig if cfg is None else (lambda *args, _c=cfg: _c)
                if rnd == 0:
                    y = torch_fused.mask_reduce(x, 1, mask, out_dtype=torch.float32)
                    err = ((y - ref).norm() / ref.norm()).item()
                    assert err < 1e-5, (cfg, err)
                t = device_ms(lambda: torch_fused.mask_reduce(x, 1, mask))[0]
                times.setdefault(cfg, []).append(t)
                if NOMASK and rnd == 0:  # the same tiles without a mask: the strip walk alone
                    t = device_ms(lambda: torch_fused.mask_reduce(x, 1))[0]
                    nomask[cfg] = (x.numel() + x.numel() // m) * 2 / (copy * 1e9) * 1e3 / t
        for cfg, ts in times.items():
            fr = sorted(floor_ms / t for t in ts)
            extra = f"  no mask {nomask[cfg]:.3f} of its floor" if cfg in nomask else ""
            print(f"{pat:6s} {str(cfg or 'shipped'):32s} {min(ts):.4f} ms  floor fraction min/med/max "
                  f"{fr[0]:.3f}/{fr[len(fr) // 2]:.3f}/{fr[-1]:.3f}{extra}", flush=True)
        K.pick_blocks = orig
        if pat == "1 M N expanded" and HINTS:
            hint = {}
            for rnd in range(4):
                for on in (True, False):
                    K.EVICT_HINTS = on
                    t = device_ms(lambda: torch_fused.mask_reduce(x, 1, mask))[0]
                    hint.setdefault(on, []).append(floor_ms / t)
            K.EVICT_HINTS = True
            for on, fr in hint.items():
                print(f"{pat:6s} shipped, eviction hints {on!s:5s} rounds: {', '.join(f'{f:.3f}' for f in fr)}", flush=True)
        elif pat == "1 M N expanded":
            order = {}
            for rnd in range(ROUNDS):
                for on in (True, False):
                    K.OUTER_FIRST = on
                    if rnd == 0:
                        y = torch_fused.mask_reduce(x, 1, mask, out_dtype=torch.float32)
                        assert ((y - ref).norm() / ref.norm()).item() < 1e-5, on
                    t = device_ms(lambda: torch_fused.mask_reduce(x, 1, mask))[0]
                    order.setdefault(on, []).append(floor_ms / t)
            K.OUTER_FIRST = True
            for on, fr in order.items():
                fr = sorted(fr)
                print(f"{pat:6s} shipped, OUTER_FIRST={on!s:5s}            floor fraction min/med/max "
                      f"{fr[0]:.3f}/{fr[len(fr) // 2]:.3f}/{fr[-1]:.3f}", flush=True)
            # probes: the strips without a mask (shipped and two fixed tiles), and eager torch.sum
            probes = [("no mask", None), ("no mask (16,64,4,8,F,8)", (16, 64, 4, 8, False, 8)),
                      ("no mask (32,64,8,8,T,4)", (32, 64, 8, 8, True, 4)), ("torch.sum", "sum")]
            for name, cfg in probes:
                K.pick_blocks = orig if cfg in (None, "sum") else (lambda *args, _c=cfg: _c)
                fn = (lambda: x.sum(1)) if cfg == "sum" else (lambda: torch_fused.mask_reduce(x, 1))
                nfloor = (x.numel() + x.numel() // m) * 2 / (copy * 1e9) * 1e3
                t = device_ms(fn)[0]
                print(f"{pat:6s} {name:18s} {t:.4f} ms  {nfloor / t:.3f} of its floor", flush=True)
            K.pick_blocks = orig
            # a copy moving the op's floor bytes (half read, half written): the ceiling at this size
            fb = torch_fused.mask_reduce_cost(x, 1, mask)["floor_bytes"]
            a = torch.empty(fb // 4, dtype=torch.bfloat16, device="cuda")
            b = torch.empty_like(a)
            t = device_ms(lambda: b.copy_(a))[0]
            print(f"{pat:6s} {'copy, same bytes':18s} {t:.4f} ms  {floor_ms / t:.3f} of the floor", flush=True)
            del a, b
        del x, mask, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
