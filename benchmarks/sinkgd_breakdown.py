"""Where a SinkGD step's time goes on one Llama-3-8B layer (bf16): each kernel timed alone, for a
few tile shapes. Run on the device: python benchmarks/sinkgd_breakdown.py"""

import math

import torch
import triton.testing

import torch_fused  # noqa: F401
from torch_fused.kernels import sinkgd as K
from torch_fused.ops import sinkgd as S


def ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def main():
    a = torch.empty(2 << 30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    copy = 2 * a.numel() * 2 / (ms(lambda: b.copy_(a)) * 1e-3) / 1e9
    del a, b
    print(f"copy {copy:.0f} GB/s")
    m, n = 14336, 4096
    g = torch.randn(1, m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    w = torch.randn(1, m, n, device="cuda", dtype=torch.bfloat16)
    r = torch.ones(1, m, device="cuda")
    c = torch.ones(1, n, device="cuda")
    floor1 = g.numel() * 2 / (copy * 1e9) * 1e3  # one read of G
    for tile in [(8, 1024, 4), (4, 2048, 4), (16, 512, 4), (2, 4096, 8)]:
        bm, bn, wp = tile
        tn = triton.cdiv(n, bn)
        part = torch.empty(1, tn, m, device="cuda")
        t = ms(lambda: K._sinkgd_sums_kernel[(triton.cdiv(m, bm), tn, 1)](
            g, r, c, part, m, n, g.stride(0), g.stride(1), AXIS=0, BM=bm, BN=bn, num_warps=wp))
        print(f"row pass  tile {tile}: {t:.3f} ms  {floor1 / t:.3f} of one-read floor")
    for tile in [(128, 64, 4), (64, 256, 4), (32, 512, 4), (256, 128, 8)]:
        bm, bn, wp = tile
        tm = triton.cdiv(m, bm)
        part = torch.empty(1, tm, n, device="cuda")
        t = ms(lambda: K._sinkgd_sums_kernel[(tm, triton.cdiv(n, bn), 1)](
            g, r, c, part, m, n, g.stride(0), g.stride(1), AXIS=1, BM=bm, BN=bn, num_warps=wp))
        print(f"col pass  tile {tile}: {t:.3f} ms  {floor1 / t:.3f} of one-read floor")
    coef = torch.ones(1, device="cuda") * 1e-4
    cw = torch.zeros(1, device="cuda")
    seed = torch.zeros((), device="cuda")
    for tile in [(16, 256, 4), (8, 1024, 4), (32, 256, 8)]:
        bm, bn, wp = tile
        t = ms(lambda: K._sinkgd_update_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), 1)](
            w, g, r, c, coef, cw, m, n, g.stride(0), g.stride(1), w.stride(0), w.stride(1), seed, 0,
            STOCHASTIC=False, BM=bm, BN=bn, num_warps=wp))
        print(f"update    tile {tile}: {t:.3f} ms  {3 * floor1 / t:.3f} of its floor (G, W read, W write)")
    t = ms(lambda: S._scales_triton(g, 5, 1e-8))
    print(f"scales L=5 (as shipped): {t:.3f} ms = {t / floor1:.1f} one-read floors (10 is the design)")
    p = torch.nn.Parameter(torch.randn(512, 512, device="cuda", dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    opt = torch_fused.optim.SinkGD([p], lr=torch.tensor(1e-3, device="cuda"))
    t = ms(opt.step)
    print(f"one 512x512 step (launch-bound): {t * 1e3:.0f} us for 21 launches")


if __name__ == "__main__":
    main()
