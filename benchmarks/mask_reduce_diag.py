"""Device-side look at fused::mask_reduce kernels: compile one config per case, print the
registers, spills and shared memory the device's Triton gave it, time it once more, and with
ASM=1 dump its TTGIR, PTX and SASS to $OUT/asm/.
python benchmarks/mask_reduce_diag.py  (NCU=1: one launch each, for ncu)"""

import os
import subprocess

import torch
import triton
import triton.testing

import torch_fused
from torch_fused.bench.mask_reduce import make_mask
from torch_fused.kernels import mask_reduce as K

OUT = os.environ.get("OUT", "/tmp/out")
# (pattern, shape, pick_blocks result: BLOCK_R, BLOCK_I, num_warps, VEC, PIPELINE, U)
CFGS = [("full", (8192, 4, 8192), (1, 512, 2, 8, False, 4)),
        ("1 M N expanded", (8, 4096, 4096), (16, 64, 4, 8, False, 4)),
        ("1 M N expanded", (8, 4096, 4096), (16, 64, 4, 8, False, 8)),
        ("1 M N expanded", (8, 4096, 4096), (32, 128, 16, 8, False, 4)),
        ("1 M N expanded", (8, 4096, 4096), (32, 256, 32, 8, False, 4)),
        ("1 M N expanded", (8, 4096, 4096), "torch.sum"),
        ("B M 1 expanded", (65536, 4, 8192), (1, 512, 2, 8, False, 4))]
ASM = os.environ.get("ASM") == "1"


def main():
    if ASM:
        os.makedirs(f"{OUT}/asm", exist_ok=True)
    ncu = os.environ.get("NCU") == "1"
    for pat, shape, cfg in CFGS:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        mask = make_mask(shape, pat, g)
        if cfg == "torch.sum":  # eager x.sum(1), for ncu: its grid, block and DRAM throughput
            x.sum(1)
            torch.cuda.synchronize()
            continue
        K.pick_blocks = lambda *a, _c=cfg: _c
        torch_fused.mask_reduce(x, 1, mask)
        torch.cuda.synchronize()
        if not ncu:
            t = triton.testing.do_bench(lambda: torch_fused.mask_reduce(x, 1, mask), return_mode="median")
            print(f"{pat} {cfg} {t:.4f} ms", flush=True)
        # the newest compiled variant of the kernel
        cache = K._mask_reduce_forward_kernel.device_caches[torch.cuda.current_device()][0]
        for key, kern in list(cache.items())[-1:]:
            tag = f"{pat.replace(' ', '')}_{'_'.join(map(str, cfg))}"
            print(tag, "regs", kern.n_regs, "spills", kern.n_spills, "smem", kern.metadata.shared, flush=True)
            if not ASM:
                continue
            for ext in ("ttgir", "ptx"):
                open(f"{OUT}/asm/{tag}.{ext}", "w").write(kern.asm[ext])
            open(f"/tmp/{tag}.cubin", "wb").write(kern.asm["cubin"])
            sass = subprocess.run(["cuobjdump", "-sass", f"/tmp/{tag}.cubin"], capture_output=True, text=True).stdout
            open(f"{OUT}/asm/{tag}.sass", "w").write(sass)
        del x, mask
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
