"""Compile every Triton kernel for the Hopper target (sm_90) on this machine, without a GPU.

The interpreter runs kernels as Python, so it accepts code the real compiler rejects (a
non-constexpr global, a type mismatch across an `if`, ...). Triton's own pipeline, down to the
ptxas bundled in the triton wheel, catches those here in CI instead of on a GPU. Each kernel
module lists the constexpr branches its launchers take (``compile_cases``).
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from torch_fused._library import INTERPRET  # noqa: E402

pytestmark = pytest.mark.skipif(INTERPRET, reason="compiles the real kernels; the interpreter run skips it")

TARGET = GPUTarget("cuda", 90, 32)


def _kernel_modules():
    """Every module of torch_fused.kernels, found on disk: a new one is compiled here without
    being listed (test_every_kernel_has_a_compile_case holds it to that)."""
    import importlib
    import pkgutil

    import torch_fused.kernels as package

    return [importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)]


def _launched_kernels(module):
    """The module's launched kernels: its @triton.jit functions named ``*_kernel`` (the helpers
    they call are compiled inside them)."""
    return {name: fn for name, fn in vars(module).items()
            if isinstance(fn, triton.runtime.JITFunction) and name.endswith("_kernel")}


def _cases():
    for module in _kernel_modules():
        if hasattr(module, "compile_cases"):
            yield from module.compile_cases()


CASES = list(_cases())


@pytest.mark.parametrize("name,fn,sig,constexprs,warps", CASES, ids=[c[0] for c in CASES])
def test_kernel_compiles_for_sm90(name, fn, sig, constexprs, warps):
    sig = dict(sig)
    for k in constexprs:
        sig[k] = "constexpr"
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    k = triton.compile(src, target=TARGET, options={"num_warps": warps})
    assert "cubin" in k.asm and len(k.asm["cubin"]) > 0


def test_every_kernel_has_a_compile_case():
    """Each kernels module that launches a kernel lists compile cases for every one of them."""
    missing = []
    for module in _kernel_modules():
        kernels = _launched_kernels(module)
        if not kernels:
            continue
        cased = {id(c[1]) for c in module.compile_cases()} if hasattr(module, "compile_cases") else set()
        missing += [f"{module.__name__}.{name}" for name, fn in kernels.items() if id(fn) not in cased]
    assert not missing, f"kernels without a compile case (add them to their module's compile_cases): {missing}"


@pytest.mark.parametrize("table,arch,limit_kib", [("CONFIG", 90, 227), ("CONFIG", 80, 163), ("PROMOTE_CONFIG", 90, 227),
                                                  ("SMALL_SMEM_CONFIG", 86, 99), ("SMALL_SMEM_CONFIG", 75, 64)])
def test_lm_head_tiles_fit_the_shared_memory_they_are_chosen_for(table, arch, limit_kib):
    """The fused head's GEMM kernels compiled with each tile table for a device it is picked for:
    the shared memory the compiler allocates stays within pick_config's estimate (the operand
    pipeline plus SMEM_MARGIN), so the estimate decides correctly, and within the device's limit."""
    from torch_fused.kernels import lm_head as KL

    limit = limit_kib << 10
    cases = [c for c in KL.compile_cases() if not c[0].endswith("_tma")]
    for kind, (name, fn, sig, constexprs, _) in zip(("stats", "dlogits"), cases):
        bm, bn, bk, gm, warps, stages = getattr(KL, table)[kind]
        promote = table == "PROMOTE_CONFIG"
        assert KL.pick_config(kind, limit, promote) == getattr(KL, table)[kind]
        cx = dict(constexprs, BM=bm, BN=bn, BK=bk, GROUP_M=gm, PROMOTE=promote)
        sig = dict(sig, **{k: "constexpr" for k in cx})
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": warps, "num_stages": stages})
        shared = k.metadata.shared
        assert shared <= KL.pipeline_smem((bm, bn, bk, gm, warps, stages)) + KL.SMEM_MARGIN, (name, shared)
        assert shared <= limit, (name, shared)


def test_lm_head_without_fitting_tiles_takes_the_cublas_path():
    from torch_fused.kernels import lm_head as KL

    assert KL.pick_config("stats", 40 << 10) is None
