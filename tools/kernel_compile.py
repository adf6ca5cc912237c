"""Compile kernels for a CUDA target on this machine (no GPU needed) and report what the compiler
made of each: compile seconds, PTX size, the global loads and barriers in one thread's program,
the layout conversions of full 2-D tiles inside loops (each one a trip through shared memory),
the registers a thread takes (ptxas's allocation, read from the cubin by the cuobjdump that ships
with Triton) and how many programs of that size a multiprocessor's 64K registers hold: a
persistent grid sized past that number runs its programs in waves.

    python tools/kernel_compile.py                   # every compile case of torch_fused/kernels
    python tools/kernel_compile.py --only lm_head    # the cases whose name starts with lm_head
    python tools/kernel_compile.py --arch 80 --set BN=128

The cases are each module's ``compile_cases()`` (the constexpr branches its launchers take, as
tests/test_kernels_compile.py compiles them); ``--set NAME=VALUE`` overrides a constexpr of every
case that has it. A fresh TRITON_CACHE_DIR is used, so the seconds are a first compile's.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _cases():
    import torch_fused.kernels as package

    for m in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{m.name}")
        if hasattr(module, "compile_cases"):
            yield from module.compile_cases()


def _tile_conversions_in_loops(ttgir: str) -> int:
    """convert_layout ops on a 2-D tensor of at least 64 x 64 elements nested in an scf.for (a
    region's braces open at the end of its line and close at the start of another; attribute
    braces balance on their own line)."""
    stack, n = [], 0
    for line in ttgir.splitlines():
        if any(stack) and "ttg.convert_layout" in line:
            shape = re.search(r"tensor<(\d+)x(\d+)x", line)
            if shape and int(shape.group(1)) >= 64 and int(shape.group(2)) >= 64:
                n += 1
        net = line.count("{") - line.count("}")
        if net > 0:
            stack += ["scf.for" in line] * net
        elif net < 0:
            del stack[net:]
    return n


def _registers(cubin: bytes | None) -> int | None:
    """Registers a thread of the cubin's kernel takes (None where cuobjdump is missing)."""
    import subprocess

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cubin or not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", out)
    return int(m.group(1)) if m else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="report the cases whose name starts with this")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability (default 90)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override a constexpr (an int) in every case that has it")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="tf-compile-"))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    overrides = {}
    for item in args.set:
        name, _, value = item.partition("=")
        overrides[name] = int(value)
    target = GPUTarget("cuda", args.arch, 32)
    cases = [c for c in _cases() if c[0].startswith(args.only)]
    w = max([len(c[0]) for c in cases] + [4])
    print(f"{'case':{w}s} {'s':>6s} {'PTX kB':>7s} {'ld.global':>9s} {'bar':>5s} {'tile cvt in loops':>17s} "
          f"{'regs':>5s} {'programs/SM':>11s}")
    for name, fn, sig, constexprs, warps in cases:
        constexprs = {k: overrides.get(k, v) for k, v in constexprs.items()}
        sig = dict(sig, **{k: "constexpr" for k in constexprs})
        t0 = time.perf_counter()
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=target,
                           options={"num_warps": warps})
        dt = time.perf_counter() - t0
        ptx = k.asm["ptx"]
        loads = len(re.findall(r"^\s*(?:@!?%p\d+\s+)?ld\.global", ptx, re.M))
        bars = len(re.findall(r"^\s*(?:@!?%p\d+\s+)?bar\.", ptx, re.M))
        regs = _registers(k.asm.get("cubin"))
        # (registers go to a warp in units of 256: 8 a thread)
        per_sm = "" if regs is None else str(min(65536 // (-(-regs // 8) * 8 * 32 * warps), 64 // warps))
        print(f"{name:{w}s} {dt:6.1f} {len(ptx) / 1e3:7.0f} {loads:9d} {bars:5d} "
              f"{_tile_conversions_in_loops(k.asm['ttgir']):17d} {'' if regs is None else regs:>5} {per_sm:>11s}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
