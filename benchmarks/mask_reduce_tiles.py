"""Tile / warp sweep of fused::mask_reduce on the three benchmark cases (bf16 x, bool mask),
with a correctness check per config. Hypothesis under test: a per-element uint8 mask and bf16 x
get different register layouts when a thread holds more than 16 bytes of x, and converting
between them costs more than the loads; 8 bf16 elements per thread (16 B) gives both the same.
Run on the device: python benchmarks/mask_reduce_tiles.py"""

import torch
import triton
import triton.testing

import torch_fused
from torch_fused.kernels import mask_reduce as K

CASES = [((65536, 4, 8192), "B M 1"), ((8192, 4, 8192), "full"), ((8, 4096, 4096), "1 M N")]
CONFIGS = {
    "B M 1": [None, (4, 512, 8), (4, 1024, 8)],
    "full": [None, (4, 1024, 16), (4, 512, 8), (2, 1024, 8), (4, 256, 4)],
    "1 M N": [None, (64, 64, 16), (32, 64, 8), (32, 128, 16), (16, 128, 8)],
}


def main():
    a = torch.empty(2 << 30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    copy = 2 * a.numel() * 2 / (triton.testing.do_bench(lambda: b.copy_(a), return_mode="median") * 1e-3) / 1e9
    del a, b
    print(f"copy {copy:.0f} GB/s")
    orig = K.pick_blocks
    for shape, pat in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        bb, m, n = shape
        if pat == "full":
            mask = torch.rand(shape, device="cuda", generator=g) > 0.5
        elif pat == "B M 1":
            mask = (torch.rand(bb, m, 1, device="cuda", generator=g) > 0.5).expand(shape)
        else:
            mask = (torch.rand(1, m, n, device="cuda", generator=g) > 0.5).expand(shape)
        floor_ms = torch_fused.mask_reduce_cost(x, 1, mask)["floor_bytes"] / (copy * 1e9) * 1e3
        ref = torch.where(mask, x.float(), 0.0).sum(1)
        for cfg in CONFIGS[pat]:
            K.pick_blocks = orig if cfg is None else (lambda r, i, o, rc, _c=cfg: _c)
            y = torch_fused.mask_reduce(x, 1, mask, out_dtype=torch.float32)
            err = ((y - ref).norm() / ref.norm()).item()
            t = triton.testing.do_bench(lambda: torch_fused.mask_reduce(x, 1, mask), return_mode="median")
            print(f"{pat:6s} {str(cfg or 'shipped'):16s} {t:.3f} ms  {floor_ms / t:.3f} of floor  rel err {err:.1e}",
                  flush=True)
        K.pick_blocks = orig
        del x, mask, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
