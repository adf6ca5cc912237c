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


def _cases():
    from torch_fused.kernels import lm_head, logprobs, mask_reduce, sinkgd

    for module in (lm_head, logprobs, mask_reduce, sinkgd):
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
