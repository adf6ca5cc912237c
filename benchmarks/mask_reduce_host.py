"""Host time of one eager fused::mask_reduce call on the (8, 4096, 4096) [1, M, N]-mask case:
through torch.ops (the dispatcher), through the implementation directly, and the bare Triton
launch; each batch enqueued behind a long device-side spin (nothing waits on the GPU). Then a
cProfile of dispatcher calls. Run on the device: python benchmarks/mask_reduce_host.py"""

import cProfile
import pstats

import torch

import torch_fused
from torch_fused.bench.common import host_ms as common_host_ms
from torch_fused.bench.mask_reduce import make_mask
from torch_fused.ops import mask_reduce as op


def host_ms(fn, reps=200):
    fn()  # compiled and cached before the timed calls
    return common_host_ms(fn, reps, spin_cycles=2_000_000_000)


def main():
    shape = (8, 4096, 4096)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = make_mask(shape, "1 M N expanded", g)
    y = torch.empty(8, 4096, device="cuda", dtype=torch.bfloat16)
    for name, fn in [("torch_fused.mask_reduce", lambda: torch_fused.mask_reduce(x, 1, mask)),
                     ("torch.ops.fused.mask_reduce", lambda: torch.ops.fused.mask_reduce(x, 1, mask)),
                     ("implementation, direct", lambda: op._mask_reduce_triton(x, 1, mask)),
                     ("torch.empty_like(y)", lambda: torch.empty_like(y)),
                     ("x.sum(1) eager", lambda: x.sum(1))]:
        print(f"{name:30s} {host_ms(fn) * 1e3:7.1f} us/call", flush=True)
    torch.cuda._sleep(4_000_000_000)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        torch_fused.mask_reduce(x, 1, mask)
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
