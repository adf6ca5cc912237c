"""Device-side look at fused::mask_reduce kernels: compile one config per case, dump the TTGIR,
PTX and SASS that the device's Triton produced to $OUT/asm/, and time each once more.
python benchmarks/mask_reduce_diag.py  (CASE env: which configs; NCU=1: one launch each, for ncu)"""

import os
import subprocess

import torch
import triton
import triton.testing

import torch_fused
from torch_fused.kernels import mask_reduce as K

OUT = os.environ.get("OUT", "/tmp/out")
CFGS = [("full", (8192, 4, 8192), (4, 512, 8, 1)), ("full", (8192, 4, 8192), (1, 2048, 8, 4)),
        ("1MN", (8, 4096, 4096), (32, 64, 8, 4)), ("BM1", (65536, 4, 8192), (4, 512, 8, 1))]


def main():
    os.makedirs(f"{OUT}/asm", exist_ok=True)
    ncu = os.environ.get("NCU") == "1"
    for pat, shape, cfg in CFGS:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        b, m, n = shape
        if pat == "full":
            mask = torch.rand(shape, device="cuda", generator=g) > 0.5
        elif pat == "BM1":
            mask = (torch.rand(b, m, 1, device="cuda", generator=g) > 0.5).expand(shape)
        else:
            mask = (torch.rand(1, m, n, device="cuda", generator=g) > 0.5).expand(shape)
        K.pick_blocks = lambda *a, _c=cfg: _c
        torch_fused.mask_reduce(x, 1, mask)
        torch.cuda.synchronize()
        if not ncu:
            t = triton.testing.do_bench(lambda: torch_fused.mask_reduce(x, 1, mask), return_mode="median")
            print(f"{pat} {cfg} {t:.4f} ms", flush=True)
        # the newest compiled variant of the kernel
        cache = K._mask_reduce_forward_kernel.device_caches[torch.cuda.current_device()][0]
        for key, kern in list(cache.items())[-1:]:
            tag = f"{pat}_{'_'.join(map(str, cfg))}"
            for ext in ("ttgir", "ptx"):
                open(f"{OUT}/asm/{tag}.{ext}", "w").write(kern.asm[ext])
            open(f"/tmp/{tag}.cubin", "wb").write(kern.asm["cubin"])
            sass = subprocess.run(["cuobjdump", "-sass", f"/tmp/{tag}.cubin"], capture_output=True, text=True).stdout
            open(f"{OUT}/asm/{tag}.sass", "w").write(sass)
            print(tag, "regs", kern.n_regs, "spills", kern.n_spills, "smem", kern.metadata.shared, flush=True)
        del x, mask
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
