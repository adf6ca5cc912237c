"""Compile every Triton kernel for the Hopper target (sm_90) on this machine, without a GPU.

The interpreter runs kernels as Python, so it accepts code the real compiler rejects (a
non-constexpr global, a type mismatch across an `if`, ...). Triton's own pipeline, down to the
ptxas bundled in the triton wheel, catches those here in CI instead of on the lent GPU.
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
    from torch_fused.kernels import logprobs as LP
    from torch_fused.kernels import mask_reduce as MR

    fwd = {"p_x": "*bf16", "p_idx": "*i64", "p_logp": "*fp32", "p_ent": "*fp32", "p_stats": "*fp32", "p_temp": "*fp32",
           "V": "i32", "K": "i32", "inner_size": "i32", "stride_outer": "i64", "stride_inner": "i64",
           "scale": "fp32", "ignore_index": "i32"}
    for hi, he, tp in [(True, True, False), (True, False, False), (False, True, False), (True, True, True)]:
        yield (f"lp_fwd idx={hi} ent={he} t_ptr={tp}", LP._logprobs_entropy_forward_kernel, fwd,
               {"HAS_INDEX": hi, "HAS_ENT": he, "EXACT_SHIFT": False, "T_FROM_PTR": tp, "BLOCK_V": 2048,
                "BLOCK_K": 2, "EPT": 8}, 4)
    bwd = {"p_x": "*fp16", "p_idx": "*i32", "p_glp": "*fp32", "p_gh": "*fp32", "p_stats": "*fp32",
           "p_ent": "*fp32", "p_dx": "*fp16", "p_temp": "*fp32", "p_xdx": "*fp32", "V": "i32", "K": "i32", "inner_size": "i32",
           "stride_outer": "i64", "stride_inner": "i64", "scale": "fp32", "inv_t": "fp32", "ignore_index": "i32"}
    for glp, gh, sk, dt in [(True, True, True, False), (True, False, False, False), (False, True, True, False),
                            (True, True, True, True)]:
        yield (f"lp_bwd glp={glp} gh={gh} single={sk} dt={dt}", LP._logprobs_entropy_backward_kernel, bwd,
               {"HAS_GLP": glp, "HAS_GH": gh, "SINGLE_K": sk, "EXACT_SHIFT": False, "T_FROM_PTR": dt,
                "HAS_DT": dt, "BLOCK_V": 2048, "BLOCK_K": 4}, 4)
    mr = {"p_x": "*bf16", "p_m": "*u8", "p_s": "*fp32", "p_y": "*bf16", "R": "i32", "O1": "i32", "I": "i32",
          "n_iblk": "i32", "n_outer": "i32"}
    for pre in ("sx", "sm", "ss"):
        for suf in ("r", "0", "1", "i"):
            mr[f"{pre}_{suf}"] = "i64"
    for hm, hs, f64, mb, sb, wide, (br, bi, w, vec, pipe, un) in [
            (True, True, False, (False, True), (True, False), False, (1, 2048, 8, 8, False, 4)),
            (False, False, True, (False, False), (False, False), True, (4, 1024, 4, 2, True, 1)),
            (True, True, False, (False, False), (False, True), False, (16, 64, 4, 8, False, 8)),
            (True, False, False, (True, False), (False, False), False, (32, 64, 8, 8, True, 4))]:
        yield (f"mask_reduce mask={hm}{mb} scale={hs}{sb} f64={f64} wide={wide}", MR._mask_reduce_forward_kernel, mr,
               {"HAS_MASK": hm, "HAS_SCALE": hs, "ACC_F64": f64, "M_BCAST_R": mb[0], "M_BCAST_I": mb[1],
                "S_BCAST_R": sb[0], "S_BCAST_I": sb[1], "PRED_X": mb[1], "WIDE": wide, "BLOCK_R": br, "BLOCK_I": bi, "VEC": vec,
                "M_EVICT": "evict_last" if mb[0] else "", "X_EVICT": "evict_first" if mb[0] else "",
                "PIPELINE": pipe, "U": un, "OUTER_FIRST": pipe and hm, "EVEN": not wide}, w)
    try:
        from torch_fused.kernels import sinkgd as SG
    except ImportError:
        return
    yield from SG.compile_cases()


CASES = list(_cases())


@pytest.mark.parametrize("name,fn,sig,constexprs,warps", CASES, ids=[c[0] for c in CASES])
def test_kernel_compiles_for_sm90(name, fn, sig, constexprs, warps):
    sig = dict(sig)
    for k in constexprs:
        sig[k] = "constexpr"
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    k = triton.compile(src, target=TARGET, options={"num_warps": warps})
    assert "cubin" in k.asm and len(k.asm["cubin"]) > 0
