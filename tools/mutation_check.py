#!/usr/bin/env python3
"""Mutation check: prove that the test suite can fail.

For every mutant (a known, realistic bug written as exact source-text replacements) this script

1. extracts torch_fused/, tests/ and pyproject.toml of one commit (``git archive``; HEAD by
   default, resolved once so every mutant sees the same code) into a fresh temporary directory,
2. applies the mutant's replacements; each ``old`` string must occur exactly once in the file,
   otherwise the mutant is STALE: reported (with the text it looks for) and not run, while the
   others run, and the script exits non-zero (a stale mutant never "passes");
   tests/test_mutation_anchors.py checks the same on the checkout in the normal test suite,
3. runs pytest on a small subset of test files in that copy, with PYTHONPATH at the copy, on the
   path the mutant breaks: the CPU reference (plain run) or the Triton kernels (TRITON_INTERPRET=1),
   ``-x -q -rfE -p no:cacheprovider -m "not cuda" --deselect tests/test_interpreter.py``,
4. checks, from inside that pytest process (a small plugin, ``-p mutation_guard``), that every
   imported ``torch_fused`` module came from the copy (not the editable install) and that
   TRITON_INTERPRET took effect as intended; the same plugin turns off hypothesis's shrinking
   (same examples, same verdict; a shrink under the interpreter can take minutes; ``--shrink``),
5. records the failing test(s) from pytest's ``FAILED ...`` lines.

A mutant is caught when at least one test FAILED. A run that ends in errors only (a mutant that
does not import, a collection error) is not a catch, and neither is one whose every failure is a
NameError, ImportError or SyntaxError (the mutated code does not run: status BROKEN). After the mutants, the failing tests are
rerun once per path on an unmutated copy (the control): each must pass there, so that a catch
is the mutation's doing and not a test that is red anyway.

A mutant with ``torch_below`` whose bug only an older torch shows is SKIPPED (not run, not a
failure) where ``--python``'s torch is newer.

Prints a table (mutant | path | file | caught? | first failing test(s) | seconds) and exits
1 if any mutant that ran survives, errors, or its control fails; else 2 if any mutant is STALE.

Not part of CI; dependency-free (standard library + git + the project's own test deps).

    python tools/mutation_check.py            # every mutant, then the control
    python tools/mutation_check.py --list
    python tools/mutation_check.py --only lse-fp32-triton
    python tools/mutation_check.py --all-failures   # every failing test, no -x
    python tools/mutation_check.py --worktree       # uncommitted edits included
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPY_PATHS = ("torch_fused", "tests", "pyproject.toml")
CPU = "cpu-reference"
TRITON = "triton-interpreter"
PYTEST_ARGS = ["-q", "-rfE", "-p", "no:cacheprovider", "-m", "not cuda", "--deselect", "tests/test_interpreter.py"]

LOGPROBS_TESTS = ["tests/test_logprobs.py"]
MASK_TESTS = ["tests/test_mask_reduce.py", "tests/test_masked.py"]
SINKGD_TESTS = ["tests/test_sinkgd.py"]
SHARDED_TESTS = ["tests/test_sinkgd_sharded.py"]
LM_HEAD_TESTS = ["tests/test_linear_logprobs.py"]
# the one test of a step on entries near the fp32 maximum (every row-pass path, spectral or not)
FP32_MAX_TEST = "tests/test_sinkgd.py::test_gradients_near_the_fp32_maximum_give_the_normalized_step"


@dataclasses.dataclass
class Mutant:
    name: str
    bug: str  # which bug (the numbered list in tools/README.md)
    file: str  # repository-relative file the edits apply to
    path: str  # CPU (plain run, reference path) or TRITON (TRITON_INTERPRET=1, the kernels)
    edits: list[tuple[str, str]]  # exact (old, new) replacements, each old occurring once
    tests: list[str]
    # only a torch older than this (major, minor) can show the bug (a limitation a later torch
    # lifted): with a newer one the mutant is SKIPPED, not run; --python an older environment
    torch_below: tuple[int, int] | None = None


# ---------------------------------------------------------------------------------------------
# The mutants. Each is a bug someone could plausibly write; several replacements only where one
# bug spans several places (the one-number lse has to be stored, read and used consistently).
# ---------------------------------------------------------------------------------------------
MUTANTS: list[Mutant] = [
    # 1. log-sum-exp kept as ONE fp32 number lse = m c + log2 s (instead of the pair (m, log2 s)).
    #    At |z| ~ 1e4 the fp32 lse (~1.4e4 in base 2) rounds by up to ~5e-4, which the log-probs
    #    and the gradient inherit.
    Mutant(
        "lse-fp32-ref", "1 lse saved as one fp32 number", "torch_fused/reference.py", CPU,
        [
            ("        stats[a:b, 0] = m.squeeze(-1).to(dt)\n"
             "        stats[a:b, 1] = log2s.to(dt)\n",
             "        lse = (m.squeeze(-1) * c + log2s).to(dt).double()  # MUTANT: one fp32 lse\n"
             "        stats[a:b, 0] = lse.to(dt)\n"
             "        stats[a:b, 1] = 0\n"),
            ("g = (torch.gather(d, 1, ib.clamp(0, max(v - 1, 0))) - log2s[:, None]) * LN2",
             "g = (torch.gather(x, 1, ib.clamp(0, max(v - 1, 0))) * c - lse[:, None]) * LN2"),
            ("lp = ((x - st[a:b, :1]) * c - st[a:b, 1:]) * ln2",
             "lp = (x * c - st[a:b, :1] - st[a:b, 1:]) * ln2"),
        ],
        LOGPROBS_TESTS,
    ),
    Mutant(
        "lse-fp32-triton", "1 lse saved as one fp32 number", "torch_fused/kernels/logprobs.py", TRITON,
        [
            ("    tl.store(p_stats + row * 2, m)\n"
             "    tl.store(p_stats + row * 2 + 1, log2s)\n",
             "    lse = m * c + log2s  # MUTANT: one fp32 lse\n"
             "    tl.store(p_stats + row * 2, lse)\n"
             "    tl.store(p_stats + row * 2 + 1, log2s * 0.0)\n"),
            ("b_lp = (_shifted(b_xi, m, c, EXACT_SHIFT) - log2s) * LN2",
             "b_lp = (b_xi * c - lse) * LN2"),
            # backward: the first stat is the lse, the second 0
            ("b_d = _shifted(b_x, m, c, EXACT_SHIFT) - log2s  # log2 p",
             "b_d = b_x * c - m - log2s  # log2 p (MUTANT: m holds the fp32 lse)"),
        ],
        LOGPROBS_TESTS,
    ),
    # 1b. the backward's row segments scatter the log-prob gradient at the row's column instead
    #     of the segment's (the segment's first column left out of the index offset)
    Mutant(
        "bwd-segment-offset-triton", "1b segment's index offset dropped", "torch_fused/kernels/logprobs.py", TRITON,
        [("                      v_seg, K, c0, v_off + c0, V_total,",
          "                      v_seg, K, c0, v_off, V_total,")],
        LOGPROBS_TESTS,
    ),
    # 2. temperature missing from the backward: d logits = d z instead of d z / T
    Mutant(
        "bwd-no-temperature-ref", "2 temperature missing from the backward", "torch_fused/reference.py", CPU,
        [("        dx = dz * inv_t\n", "        dx = dz\n")],
        LOGPROBS_TESTS,
    ),
    Mutant(
        "bwd-no-temperature-triton", "2 temperature missing from the backward",
        "torch_fused/kernels/logprobs.py", TRITON,
        [("    c, it = _temperature_scale(scale, inv_t, p_temp, T_FROM_PTR)\n",
          "    c, it = _temperature_scale(scale, inv_t, p_temp, T_FROM_PTR)\n"
          "    it = 1.0  # MUTANT\n")],
        LOGPROBS_TESTS,
    ),
    # 3. the entropy gradient with its sign flipped
    Mutant(
        "entropy-grad-sign-ref", "3 entropy gradient sign flipped", "torch_fused/reference.py", CPU,
        [("coef = coef + gh[a:b, None] * (lp_safe + h[a:b, None])",
          "coef = coef - gh[a:b, None] * (lp_safe + h[a:b, None])")],
        LOGPROBS_TESTS,
    ),
    Mutant(
        "entropy-grad-sign-triton", "3 entropy gradient sign flipped", "torch_fused/kernels/logprobs.py", TRITON,
        [("        a = a + gh * h\n        b = gh * LN2\n",
          "        a = a - gh * h\n        b = -gh * LN2\n")],
        LOGPROBS_TESTS,
    ),
    # 4. an ignore_index position given a gradient (its upstream gradient not zeroed)
    Mutant(
        "ignore-index-grad-ref", "4 ignore_index position given a gradient", "torch_fused/reference.py", CPU,
        [("        g2 = torch.where(valid, g2, torch.zeros_like(g2))\n", "")],
        LOGPROBS_TESTS,
    ),
    Mutant(
        "ignore-index-grad-triton", "4 ignore_index position given a gradient",
        "torch_fused/kernels/logprobs.py", TRITON,
        [("        b_g = tl.where(b_idx == ignore_index, 0.0, b_g)\n", "")],
        LOGPROBS_TESTS,
    ),
    # 5. mask_reduce reading a broadcast mask at the wrong stride (Triton path only: the reference
    #    leaves strides to PyTorch's broadcasting)
    Mutant(
        "mask-bcast-stride-ops", "5 broadcast mask read at the wrong stride", "torch_fused/ops/mask_reduce.py", TRITON,
        # the launcher hands the kernel x's strides where the mask is broadcast (stride 0), as if
        # the mask were laid out like x
        [("    sm = _strides(mask, shape, d) if mask is not None else None\n",
          "    sm = _strides(mask, shape, d) if mask is not None else None\n"
          "    if sm is not None:  # MUTANT: stride-0 mask strides replaced by x's (contiguous) strides\n"
          "        sm = tuple(s if s != 0 else t for s, t in zip(sm, sx))\n")],
        MASK_TESTS,
    ),
    Mutant(
        "mask-r-i-swap-kernel", "5 broadcast mask read at the wrong stride", "torch_fused/kernels/mask_reduce.py",
        TRITON,
        # the mask's in-tile offsets (and column base) built with its r and i strides swapped
        [("_operand_tile(p_m, a, b, i0, sm_0, sm_1, sm_r, sm_i, m_i,",
          "_operand_tile(p_m, a, b, i0, sm_0, sm_1, sm_i, sm_r, m_i,")],
        MASK_TESTS,
    ),
    # 6. SinkGD normalizing columns before rows (every iteration)
    Mutant(
        "sinkgd-cols-first-ref", "6 SinkGD columns normalized before rows", "torch_fused/reference.py", CPU,
        [("        r = _rescaled(r, x(), 2, math.sqrt(n), eps)\n"
          "        c = _rescaled(c, x(), 1, math.sqrt(m), eps)\n",
          "        c = _rescaled(c, x(), 1, math.sqrt(m), eps)\n"
          "        r = _rescaled(r, x(), 2, math.sqrt(n), eps)\n")],
        SINKGD_TESTS,
    ),
    Mutant(
        # the one-read row pass cannot take the columns first (it finishes rows, then adds their
        # columns); the two-pass path (n > max_fused_n, in the interpreter run n > 64) can: column
        # sums and scale, then row sums and scale, every launch reading only what is written
        "sinkgd-cols-first-triton", "6 SinkGD columns normalized before rows", "torch_fused/ops/sinkgd/launch.py", TRITON,
        [("""    K._sinkgd_sums_kernel[(g_s,)](m_s, f_s, n_s, gdt, r, c, part_r, AXIS=0, BM=rbm, BN=rbn,
                                  ONES_R=first, ONES_C=first, ALIGN=align, num_warps=rw)
    K._sinkgd_scale_kernel[(g_r,)](m_r, f_r, n_r, r, part_r, eps, AXIS=0, PART_TILE=rbn, BLOCK=plan.tiles.scale_block,
                                   PARTS=plan.tiles.scale_parts, ONES=first, SUMMED=False)
    K._sinkgd_sums_kernel[(g_c,)](m_c, f_c, n_c, gdt, r, c, part_c, AXIS=1, BM=cbm, BN=cbn,
                                  ONES_R=False, ONES_C=first, ALIGN=align, num_warps=cw)
""", """    # MUTANT: the wide matrices' columns normalized first (with the previous r), then their rows
    import types
    K._sinkgd_sums_kernel[(g_c,)](m_c, f_c, n_c, gdt, r, c, part_c, AXIS=1, BM=cbm, BN=cbn,
                                  ONES_R=first, ONES_C=first, ALIGN=align, num_warps=cw)
    _col_stage(plan, types.SimpleNamespace(c=c, part_c=part_c), eps, first)
    K._sinkgd_sums_kernel[(g_s,)](m_s, f_s, n_s, gdt, r, c, part_r, AXIS=0, BM=rbm, BN=rbn,
                                  ONES_R=first, ONES_C=False, ALIGN=align, num_warps=rw)
    K._sinkgd_scale_kernel[(g_r,)](m_r, f_r, n_r, r, part_r, eps, AXIS=0, PART_TILE=rbn, BLOCK=plan.tiles.scale_block,
                                   PARTS=plan.tiles.scale_parts, ONES=first, SUMMED=False)
"""), ("""        for plan, bufs, _, _, _ in work:
            _col_stage(plan, bufs, eps, first, sums)
""", """        for plan, bufs, _, _, _ in work:
            if plan.wide is None:  # MUTANT: the wide plans' columns were scaled above
                _col_stage(plan, bufs, eps, first, sums)
""")],
        SINKGD_TESTS,
    ),
    # 7. SinkGD dropping the (decoupled) weight decay from the update
    Mutant(
        "sinkgd-no-wd-ref", "7 SinkGD weight decay dropped", "torch_fused/reference.py", CPU,
        [("new = wf - coef_x[:, None, None].to(dt) * x - coef_w.to(dt) * wf",
          "new = wf - coef_x[:, None, None].to(dt) * x")],
        SINKGD_TESTS,
    ),
    Mutant(
        "sinkgd-no-wd-triton", "7 SinkGD weight decay dropped", "torch_fused/kernels/sinkgd.py", TRITON,
        [("new = b_w - coef_x * (b_g * b_r[:, None] * b_c[None, :]) - coef_w * b_w",
          "new = b_w - coef_x * (b_g * b_r[:, None] * b_c[None, :])")],
        SINKGD_TESTS,
    ),
    # 8. SinkGD spectral scale computed (the power iteration still updates the warm-start vectors)
    #    but not applied to the step
    Mutant(
        "sinkgd-no-spectral-ref", "8 SinkGD spectral scale not applied", "torch_fused/ops/sinkgd/__init__.py", CPU,
        [("""            s = reference.sinkgd_spectral_scale(g3, r, c, spectral_vecs[i], spectral_iters, target, eps)
        else:
            s = torch.ones(b, dtype=torch.float32, device=p.device)
""", """            reference.sinkgd_spectral_scale(g3, r, c, spectral_vecs[i], spectral_iters, target, eps)  # MUTANT
        s = torch.ones(b, dtype=torch.float32, device=p.device)
""")],
        SINKGD_TESTS,
    ),
    Mutant(
        "sinkgd-no-spectral-triton", "8 SinkGD spectral scale not applied", "torch_fused/kernels/sinkgd.py", TRITON,
        [("    if HAS_SPEC:\n        coef_x = coef_x * tl.load(p_spec + i_coef)\n", "")],
        SINKGD_TESTS,
    ),
    # 9. fused lm_head GEMM epilogues (kernels/lm_head.py): the bias left out of the logits tile
    #    (forward and backward alike), and the entropy term of d logits with its sign flipped
    Mutant(
        "lm-head-no-bias-triton", "9 fused lm_head epilogue", "torch_fused/kernels/lm_head.py", TRITON,
        [("    if HAS_BIAS:\n        acc += tl.load(p_b + o_n, mask=o_n < V, other=0.0).to(tl.float32)[None, :]\n"
          "    return tl.where(",
          "    return tl.where(  # MUTANT: no bias\n")],
        LM_HEAD_TESTS,
    ),
    Mutant(
        "lm-head-dlogits-entropy-sign-triton", "9 fused lm_head epilogue", "torch_fused/kernels/lm_head.py", TRITON,
        [("    dz = -tl.exp2(d) * (a[:, None] + b[:, None] * tl.maximum(d, D_MIN))\n",
          "    dz = -tl.exp2(d) * (a[:, None] - b[:, None] * tl.maximum(d, D_MIN))  # MUTANT\n")],
        LM_HEAD_TESTS,
    ),
    # 10. sharded SinkGD on the kernels (optim/sharded.py, ops/sinkgd/launch.py launch_sharded): the
    #     column scale with the rank's row count instead of the whole matrix's, and the column
    #     sums never all-reduced
    Mutant(
        "sinkgd-sharded-local-m-triton", "10 sharded SinkGD column sums", "torch_fused/kernels/sinkgd.py", TRITON,
        [("        target = tl.sqrt(tl.load(row + MG).to(tl.float32))\n",
          "        target = tl.sqrt(m.to(tl.float32))  # MUTANT: the local rows' m\n")],
        SHARDED_TESTS,
    ),
    Mutant(
        "sinkgd-sharded-no-all-reduce-triton", "10 sharded SinkGD column sums", "torch_fused/optim/sharded.py",
        TRITON,
        [("            part.copy_(_all_reduce(part, name))\n",
          "            _all_reduce(part, name)  # MUTANT: the sum is dropped\n")],
        SHARDED_TESTS,
    ),
    # 11. SinkGD weight decay with another matrix's lr factor (the update kernel indexing the
    #     per-matrix factors by its position in its launch)
    Mutant(
        "sinkgd-wd-factor-of-launch-position-triton", "11 SinkGD weight decay factor", "torch_fused/kernels/sinkgd.py",
        TRITON,
        [("    coef_w = lr * tl.load(p_fac + i_coef) * wd",
          "    coef_w = lr * tl.load(p_fac + mat) * wd  # MUTANT: the launch position")],
        SINKGD_TESTS,
    ),
    # 12. mask_reduce's trip offset r0 * row stride in 32 bits (wraps past 2**31 elements)
    Mutant(
        "mask-reduce-trip-offset-int32-triton", "12 mask_reduce trip offset in 32 bits",
        "torch_fused/kernels/mask_reduce.py", TRITON,
        [("    r0 = tl.cast(r0, tl.int64)\n", "")],
        MASK_TESTS,
    ),
    # 13. the masked helpers reading the strides of a tensor the compiled graph made: a float mask
    # cast to float64 through its stored elements (as_strided on a broadcast view, then a new
    # tensor broadcast again), and the weight sums taken the same way outside an op (Inductor
    # lays such intermediates out as it likes)
    Mutant(
        "masked-helpers-intermediate-strides", "13 masked helpers reading a graph intermediate's strides",
        "torch_fused/masked.py", CPU,
        [("    check_mask_reduce(loss, 1, mask, None, None, x_name=\"loss\")\n",
          "    check_mask_reduce(loss, 1, mask, None, None, x_name=\"loss\")\n"
          "    if mask.dtype.is_floating_point:  # MUTANT: strides of a traced view\n"
          "        mask = torch.broadcast_to(stored_view(mask, loss.shape).double(), loss.shape)\n"),
         ("    nd = check_mask_reduce(values, d, mask, None, None, x_name=\"values\")\n",
          "    nd = check_mask_reduce(values, d, mask, None, None, x_name=\"values\")\n"
          "    if mask.dtype.is_floating_point:  # MUTANT: strides of a traced view\n"
          "        mask = torch.broadcast_to(stored_view(mask, values.shape).double(), values.shape)\n"),
         ("    return torch.ops.fused._mask_weight(mask, list(shape), dim, dtype)\n",
          "    from .reference import mask_weight  # MUTANT: outside an op\n"
          "    return mask_weight(mask, shape, dim, dtype)\n")],
        ["tests/test_masked.py"],
    ),
    # 14. SinkGD's row pass squaring the gradient unscaled: rows whose squares overflow fp32 get
    # r = 0 (the step silently skipped)
    Mutant(
        "sinkgd-row-norm-unscaled-triton", "14 SinkGD row norm squared unscaled",
        "torch_fused/kernels/sinkgd.py", TRITON,
        [("    if worst > SSQ_SCALED:\n", "    if worst < 0.0:  # MUTANT: never redone scaled\n")],
        SINKGD_TESTS,
    ),
    # 15. the eager fast path skips autograd when only a tensor temperature requires grad: its
    # gradient silently never arrives
    Mutant(
        "fast-path-temperature-grad-dropped", "15 fast path drops the temperature's gradient",
        "torch_fused/ops/logprobs.py", CPU,
        [("    return call_eager(name, (logits, temperature_t), _EagerCore.apply,",
          "    return call_eager(name, (logits,), _EagerCore.apply,  # MUTANT\n                     ")],
        ["tests/test_logprobs_ops.py"],
    ),
    # 16. the backward reads a [rows, K] upstream gradient as if its K entries were contiguous:
    # wrong (or out-of-bounds) for the expanded gradient of a .sum()
    Mutant(
        "bwd-grad-stride-ignored-triton", "16 upstream gradient's column stride ignored",
        "torch_fused/kernels/logprobs.py", TRITON,
        [("        b_g = tl.load(p_glp + row * glp_sr + o_k * glp_sk, mask=m_k, other=0.0).to(tl.float32)",
          "        b_g = tl.load(p_glp + row * glp_sr + o_k, mask=m_k, other=0.0).to(tl.float32)  # MUTANT")],
        LOGPROBS_TESTS,
    ),
    # 17. the fused head's options lose one on their way (meta.linear_logprobs.HeadOptions to the
    #     implementation): logit_scale not folded into the temperature, and the vocabulary-parallel head
    #     dropping the softcap
    Mutant(
        "lm-head-logit-scale-dropped-ref", "17 fused head option dropped", "torch_fused/ops/linear_logprobs.py", CPU,
        [("    return kernel_temperature(t if opts.softcap is not None else t / opts.logit_scale)",
          "    return kernel_temperature(t)  # MUTANT")],
        LM_HEAD_TESTS,
    ),
    Mutant(
        "vocab-parallel-softcap-dropped-ref", "17 fused head option dropped", "torch_fused/parallel.py", CPU,
        [("    opts = HeadOptions(**options)\n",
          "    opts = HeadOptions(**{k: v for k, v in options.items() if k != 'softcap'})  # MUTANT\n")],
        ["tests/test_vocab_parallel.py"],
    ),
    # 18. a launch plan keyed without the strides of its tensors (ops/logprobs.py _FWD_PLANS /
    #     _BWD_PLANS): a call with the shapes of an earlier one but another layout (the logits, an
    #     upstream gradient) reuses that call's layout arithmetic
    Mutant(
        "plan-key-without-strides-triton", "18 launch plan keyed without strides", "torch_fused/_library.py", TRITON,
        [("    return None if t is None else (t.shape, t.stride(), t.dtype)",
          "    return None if t is None else (t.shape, t.dtype)  # MUTANT")],
        ["tests/test_logprobs_ops.py"],
    ),
    # 19. under torch.compile the backward with shift inlined as kernel launches (settings.
    #     compile_inline_kernels): its d logits is written through two views of one tensor, which a
    #     functional graph turns into two copies
    Mutant(
        "inline-shift-backward-ref", "19 aliasing launch inlined", "torch_fused/ops/logprobs.py", CPU,
        [("keep_whole=lambda args, kwargs: Options(*args[7:7 + _N_OPTS]).shift)",
          "keep_whole=None)  # MUTANT")],
        ["tests/test_logprobs_ops.py"],
    ),
    # 20: a traced launch passed one tensor for the written d logits and the unused tail pointer:
    #     the functional graph copies each, and the unwritten copy becomes d logits (None is passed)
    Mutant(
        "inline-aliased-pointers", "20 aliased pointers in a traced launch", "torch_fused/ops/logprobs.py", CPU,
        [("tail = dx[..., -1, :] if opts.shift else None", "tail = dx[..., -1, :] if opts.shift else dx  # MUTANT")],
        ["tests/test_logprobs_ops.py"],
    ),
    # 21: the row-mask prefetch (MASK_AHEAD) predicating x on the next trip's mask
    Mutant(
        "mask-ahead-next-trip", "21 row mask a trip off", "torch_fused/kernels/mask_reduce.py", TRITON,
        [("sx_r, sm_r, ss_r, mk, HAS_MASK", "sx_r, sm_r, ss_r, mk_next, HAS_MASK")],
        ["tests/test_mask_reduce.py"],
    ),
    # 22: the eager fast path's backward under create_graph computing d logits without a graph:
    #     a second derivative through the saved logits silently zero instead of an error
    Mutant(
        "create-graph-silent", "22 double backward silently zero", "torch_fused/ops/logprobs.py", CPU,
        [("            return _gradients(ctx, g_logp, g_ent, _backward_op, saved)\n",
          "            with torch.no_grad():  # MUTANT\n"
          "                return _gradients(ctx, g_logp, g_ent, _eager_backward(saved[0]), saved)\n")],
        ["tests/test_logprobs_ops.py"],
    ),
    # 23: COMPACT's kept-row count one short (the last kept row of every list left out)
    Mutant(
        "row-ids-count", "23 kept-row count one short", "torch_fused/kernels/mask_reduce.py", TRITON,
        [("    tl.store(p_cnt + pid, n)", "    tl.store(p_cnt + pid, n - 1)  # MUTANT")],
        ["tests/test_mask_reduce.py"],
    ),
    # 24: COMPACT walking each trip's listed rows again instead of the next trip's
    Mutant(
        "compact-same-trip", "24 listed rows a trip off", "torch_fused/kernels/mask_reduce.py", TRITON,
        [("ids_next = tl.load(p_ids + j0 + TRIP + o_r, mask=(j0 + TRIP + o_r) < cnt, other=0)",
          "ids_next = tl.load(p_ids + j0 + o_r, mask=(j0 + o_r) < cnt, other=0)  # MUTANT")],
        ["tests/test_mask_reduce.py"],
    ),
    # 25: the direct launch keyed without the pointers' alignment: a misaligned pointer launched
    #     through a kernel compiled for aligned ones
    Mutant(
        "direct-launch-alignment", "25 direct launch keyed by device alone", "torch_fused/_library.py", CPU,
        [("        key = (device, *[args[i].data_ptr() % 16 == 0 for i in slots])",
          "        key = (device,)  # MUTANT")],
        ["tests/test_logprobs_ops.py"],
    ),
    # 26: mask_reduce's launch plan keyed without dim: a call with another (bad) dim reusing a
    #     plan made for a good one, its checks skipped
    Mutant(
        "mask-reduce-plan-dim", "26 mask_reduce plan keyed without dim", "torch_fused/ops/mask_reduce.py", TRITON,
        [("    key = (tensor_key(x), x.device, dim, type(dim), tensor_key(mask),",
          "    key = (tensor_key(x), x.device, tensor_key(mask),  # MUTANT")],
        ["tests/test_mask_reduce.py"],
    ),
    # 27: the pipelined listed-row walk (strips) without its bound on the list: the slots past
    #     the count load id 0 (mask other=0), so x's row 0 is added once per such slot
    Mutant(
        "compact-pipelined-bound", "27 pipelined listed rows past the count", "torch_fused/kernels/mask_reduce.py",
        TRITON,
        [("            b_x = tl.load(p_xt + ids.to(tl.int64) * sx_r + t_xi, mask=m_r & m_i, other=0.0, "
          "eviction_policy=X_EVICT)\n            acc = _add_tile(acc, b_x, m_r, sc_i, True, HAS_SCALE)\n    else:",
          "            b_x = tl.load(p_xt + ids.to(tl.int64) * sx_r + t_xi, mask=m_i, other=0.0, "
          "eviction_policy=X_EVICT)  # MUTANT\n            acc = _add_tile(acc, b_x, m_i, sc_i, True, HAS_SCALE)\n    else:")],
        ["tests/test_mask_reduce.py"],
    ),
    # 28: the eager path's node handing the two public outputs' gradients back to the core
    #     swapped (logprobs_and_entropy: d log-probs taken as d entropy and the reverse)
    Mutant(
        "eager-output-grads-swapped", "28 eager node's output gradients swapped", "torch_fused/ops/logprobs.py", CPU,
        [("        elif ctx.opts.compute_entropy:\n            g_logp, g_ent = grads\n",
          "        elif ctx.opts.compute_entropy:\n            g_ent, g_logp = grads  # MUTANT\n")],
        ["tests/test_logprobs_ops.py"],
    ),
    # 29: the vocabulary-parallel logits made local with torch's to_local, whose backward gives d
    #     logits a global stride derived from the uneven local shard (not the logits')
    Mutant(
        "vocab-parallel-grad-stride", "29 vocab-parallel d logits' DTensor stride", "torch_fused/parallel.py", CPU,
        [("    x = _local_shard(logits)\n", "    x = logits.to_local()  # MUTANT\n")],
        ["tests/test_vocab_parallel.py"],
    ),
    # 30: the eager path's backward plans (linked to the forward's plan) keyed without the
    #     upstream gradients: an expanded or strided gradient reusing a contiguous one's plan
    # 31: the same keyed without the saved logits' layout: a saved-tensor hook that hands back a
    #     contiguous copy of a sliced logits reusing the slice's plan (or the reverse)
    # (backward_triton's key: its head, these tensors' keys, is the whole key of the eager path's
    # plans and the start of the registered op's)
    Mutant(
        "linked-bwd-plan-key-triton", "30 eager backward plan keyed without the gradients",
        "torch_fused/ops/logprobs.py", TRITON,
        [("key = (tensor_key(grad_logp), tensor_key(grad_entropy), tensor_key(logits), tensor_key(index),",
          "key = (tensor_key(logits), tensor_key(index),  # MUTANT: without the upstream gradients\n          ")],
        ["tests/test_logprobs_ops.py"],
    ),
    Mutant(
        "linked-bwd-plan-saved-layout-triton", "31 eager backward plan keyed without the saved logits' layout",
        "torch_fused/ops/logprobs.py", TRITON,
        [("key = (tensor_key(grad_logp), tensor_key(grad_entropy), tensor_key(logits), tensor_key(index),",
          "key = (tensor_key(grad_logp), tensor_key(grad_entropy),  # MUTANT: without the saved logits and index\n          ")],
        ["tests/test_logprobs_ops.py"],
    ),
    # 32: the backward kernel handed saved row statistics in the layout a saved-tensor hook gave
    #     them (it reads them as contiguous rows)
    Mutant(
        "saved-stats-layout-triton", "32 saved row statistics read in a hook's layout",
        "torch_fused/ops/logprobs.py", TRITON,
        [("go(grid, x, idx, glp, gh, stats.contiguous(), ent,", "go(grid, x, idx, glp, gh, stats, ent,")],
        ["tests/test_logprobs_ops.py"],
    ),
    # 33: SinkGD's AdamW step reading its state inside the (traced) step, not from the lists
    #     _init_group fills: a compiled step loses a mixed group's state
    Mutant(
        "adamw-state-in-trace", "33 AdamW state read inside the compiled step", "torch_fused/optim/sinkgd.py", CPU,
        [("        grads, m1, m2, steps = adamw_state\n",
          "        grads, m1, m2, steps = [], [], [], []  # MUTANT\n"
          "        for p in params:\n"
          "            st = self.state[p]\n"
          "            grads.append(p.grad)\n"
          "            m1.append(st['exp_avg'])\n"
          "            m2.append(st['exp_avg_sq'])\n"
          "            steps.append(st['step'])\n")],
        SINKGD_TESTS,
    ),
    # 34: a float lr taken in float32 for a float64 step
    Mutant(
        "float64-lr-rounded", "34 float lr rounded to float32 for a float64 step", "torch_fused/optim/sinkgd.py", CPU,
        [("torch.float64 if wide else torch.float32, device=dev)", "torch.float32, device=dev)  # MUTANT")],
        SINKGD_TESTS,
    ),
    # 35: the sharded PyTorch-op path's update in fp32 whatever W's dtype
    Mutant(
        "sharded-float64-update", "35 sharded float64 update rounded through fp32", "torch_fused/optim/sharded.py", CPU,
        [("    wf = w.to(r.dtype)\n", "    wf = w.float()  # MUTANT\n")],
        SHARDED_TESTS,
    ),
    # 36: matrices checked only in their group's own step (a later group's bad matrix raises
    #     after the earlier groups moved)
    Mutant(
        "bad-matrix-late-check", "36 matrix checks only in the group's own step", "torch_fused/optim/sinkgd.py", CPU,
        [("            if plain and not _all_valid(*zip(*plain)):", "            if False:  # MUTANT")],
        SINKGD_TESTS,
    ),
    # 37: the mask weight sum without an autograd formula (a mask that requires grad fails backward)
    Mutant(
        "mask-count-no-autograd", "37 mask weight sum without an autograd formula", "torch_fused/ops/mask_reduce.py",
        CPU,
        [("mask_weight.register_autograd(lambda ctx, grad: (None, None, None, None), setup_context=_mask_weight_setup)\n",
          "pass  # MUTANT\n")],
        MASK_TESTS,
    ),
    # 38: a tensor temperature's NaN (T <= 0, inf, NaN) set before the clamp, which drops it
    Mutant(
        "bad-temperature-clamped-triton", "38 bad tensor temperature clamped to a finite T",
        "torch_fused/kernels/logprobs.py", TRITON,
        [("        t = tl.minimum(tl.maximum(t, T_MIN_C), T_MAX_C)\n        t = tl.where(ok, t, float(\"nan\")).to(tl.float32)\n",
          "        t = tl.where(ok, t, float(\"nan\"))\n        t = tl.minimum(tl.maximum(t, T_MIN_C), T_MAX_C).to(tl.float32)  # MUTANT\n")],
        ["tests/test_logprobs_ops.py"],
    ),
    # 39: forward mode let through (the eager path and the ops): zero tangents without a word
    Mutant(
        "forward-mode-silent", "39 forward-mode AD not refused", "torch_fused/_library.py", CPU,
        [("    if hit:\n        raise NotImplementedError(", "    if False:  # MUTANT\n        raise NotImplementedError(")],
        ["tests/test_logprobs_ops.py"],
    ),
    # 40, 41: d T of a clamped tensor temperature as if T were the bound (up to 1e31 times too large)
    Mutant(
        "clamped-temperature-grad-triton", "40 d T nonzero where T is clamped (kernel path)", "torch_fused/reference.py",
        TRITON,
        [("    return torch.where(temperature_clamped(temperature_t), torch.zeros_like(dt), dt)\n",
          "    return dt  # MUTANT\n")],
        ["tests/test_logprobs_ops.py"],
    ),
    Mutant(
        "clamped-temperature-grad-reference", "41 d T nonzero where T is clamped (reference)", "torch_fused/reference.py",
        CPU,
        [("        dtemp = torch.where(temperature_clamped(temperature_t), torch.zeros_like(xdx),\n"
          "                            -xdx / temperature)",
          "        dtemp = (-xdx / temperature)  # MUTANT")],
        ["tests/test_logprobs_ops.py"],
    ),
    # 42, 43: the spectral step's v = w / max(sigma, eps) again: a zero gradient zeroes v for good
    Mutant(
        "spectral-zero-v-triton", "42 a zero gradient zeroes the warm-start vector (kernels)",
        "torch_fused/kernels/sinkgd.py", TRITON,
        [("    tl.store(p_v, tl.where(live, tl.load(p_v, mask=msk, other=0.0) / tl.where(live, s, 1.0), restart), mask=msk)\n",
          "    tl.store(p_v, tl.load(p_v, mask=msk, other=0.0) / tl.maximum(s, eps), mask=msk)  # MUTANT\n")],
        ["tests/test_sinkgd.py"],
    ),
    Mutant(
        "spectral-zero-v-reference", "43 a zero gradient zeroes the warm-start vector (reference, sharded)",
        "torch_fused/reference.py", CPU,
        [("    v = torch.where(live[:, None], w / torch.where(live, sigma, 1)[:, None],\n"
          "                    spectral_restart(w.shape[1], w.device).to(w.dtype))\n",
          "    v = w / sigma[:, None].clamp_min(eps)  # MUTANT\n")],
        ["tests/test_sinkgd.py", "tests/test_sinkgd_sharded.py"],
    ),
    # 44-46: the vocabulary-parallel paths under torch.compile(dynamic=True), and the compiled
    # CPU head's out-of-range id. 45: the code Dynamo traces there is the ops' forward (the ranks'
    # partials merged, parallel.merge_partials); their local backwards are registered ops, so the
    # reference backward is no longer traced. torch 2.14's Dynamo cannot use such a float, first
    # read in one autograd.Function's trace, in a second one; torch 2.15's lifts it
    Mutant(
        "dynamo-check-closure", "44 torch._check with a message closure inside Dynamo's trace", "torch_fused/_library.py",
        CPU,
        [("    if torch.compiler.is_dynamo_compiling():\n        # traced by Dynamo itself",
          "    if False:  # MUTANT\n        # traced by Dynamo itself")],
        ["tests/test_vocab_parallel.py"],
    ),
    Mutant(
        "traced-global-float", "45 a module-level float in the traced vocabulary-parallel code",
        "torch_fused/parallel.py", CPU,
        [("    ln2 = traced_constants()[1]\n", "    ln2 = reference.LN2  # MUTANT\n")],
        ["tests/test_vocab_parallel.py"], torch_below=(2, 15),
    ),
    Mutant(
        "head-bad-id-triton-only", "46 the head's out-of-range id contained on the Triton path only",
        "torch_fused/ops/linear_logprobs.py", CPU,
        [("    glp, idx2, bad_rows = _contain_bad_ids(glp, idx2, ignore_index, v_total)",
          "    glp, idx2, bad_rows = _contain_bad_ids(glp, idx2, ignore_index, v_total) if path.triton else (glp, idx2, None)  # MUTANT")],
        ["tests/test_vocab_parallel.py"],
    ),
    # 47, 48: the masked helpers' float weights: the sums of loss * w taken without the weights
    # (a floating mask passed to mask_reduce as a mask only, which keeps its entries at weight 1),
    # and a zero weight sum guarded by clamping the denominator to 1 (wrong for weights that sum
    # below 1, or to a negative number)
    Mutant(
        "float-mask-unweighted-sums", "47 the helpers' sums without a float mask's weights", "torch_fused/masked.py",
        CPU,
        [("    return mask if mask.dtype.is_floating_point else None\n", "    return None  # MUTANT\n")],
        ["tests/test_masked.py"],
    ),
    Mutant(
        "weight-sum-clamped", "48 the helpers' weight sums clamped to 1", "torch_fused/masked.py", CPU,
        [("    return torch.where(nonzero, num / torch.where(nonzero, den, torch.ones_like(den)), torch.zeros_like(num))\n",
          "    return num / den.clamp_min(1)  # MUTANT\n")],
        ["tests/test_masked.py"],
    ),
    # 49: the overflow of 14 past the one-read row pass: the two-pass kernels' row norms squared
    # unscaled (rows wider than max_fused_n: 64 in the interpreter run), a norm a * s formed where
    # it overflows (entries near the fp32 maximum; kernels, reference), the power pass's G (c v)
    # summed before r is applied (kernels' one-read and two-pass passes, the sharded PyTorch path)
    Mutant(
        "sinkgd-two-pass-row-norm-unscaled-triton", "49 SinkGD sums overflowing near the fp32 maximum",
        "torch_fused/kernels/sinkgd.py", TRITON,
        [("        if tl.max(s) > SSQ_SCALED:\n", "        if tl.max(s) < 0.0:  # MUTANT: never redone scaled\n")],
        [FP32_MAX_TEST],
    ),
    Mutant(
        "sinkgd-row-norm-formed-triton", "49 SinkGD sums overflowing near the fp32 maximum",
        "torch_fused/kernels/sinkgd.py", TRITON,
        [("tl.minimum(r_old * (target / s) / tl.maximum(a, eps / s), SCALE_MAX)",
          "tl.minimum(r_old * target / tl.maximum(a * s, eps), SCALE_MAX)  # MUTANT")],
        [FP32_MAX_TEST],
    ),
    Mutant(
        "sinkgd-row-norm-formed-ref", "49 SinkGD sums overflowing near the fp32 maximum",
        "torch_fused/reference.py", CPU,
        [("    return (v * (target / s) / torch.maximum(a, eps / s)).clamp_max(SCALE_MAX)\n",
          "    return (v * target / (a * s).clamp_min(eps)).clamp_max(SCALE_MAX)  # MUTANT\n")],
        [FP32_MAX_TEST],
    ),
    Mutant(
        "sinkgd-power-rows-r-last-triton", "49 SinkGD sums overflowing near the fp32 maximum",
        "torch_fused/kernels/sinkgd.py", TRITON,
        [("    if over > 0.0:\n", "    if over < 0.0:  # MUTANT: never redone with r first\n")],
        [FP32_MAX_TEST],
    ),
    Mutant(
        "sinkgd-power-tiles-r-last-triton", "49 SinkGD sums overflowing near the fp32 maximum",
        "torch_fused/kernels/sinkgd.py", TRITON,
        [("    b_x = b_g * tl.load(p_r + tl.load(row + R_OFF) + b * m + o_m, mask=m_m, other=0.0)[:, None]\n",
          "    r_row = tl.load(p_r + tl.load(row + R_OFF) + b * m + o_m, mask=m_m, other=0.0)  # MUTANT: r last\n"
          "    b_x = b_g\n"),
         ("        col = tl.sum(b_x * u[:, None], axis=0)\n",
          "        u = r_row * u\n        col = tl.sum(b_x * (r_row * u)[:, None], axis=0)\n")],
        [FP32_MAX_TEST],
    ),
    Mutant(
        "sinkgd-sharded-power-r-last", "49 SinkGD sums overflowing near the fp32 maximum",
        "torch_fused/optim/sharded.py", CPU,
        [("        out[:, a:e] = torch.einsum(\"bmn,bn->bm\", mat.r[:, a:e, None] * mat.g[:, a:e].to(mat.dt), x.to(mat.dt))\n",
          "        out[:, a:e] = mat.r[:, a:e] * torch.einsum(\"bmn,bn->bm\", mat.g[:, a:e].to(mat.dt), x.to(mat.dt))  # MUTANT\n")],
        ["tests/test_sinkgd_sharded.py::test_world_of_one_step_of_gradients_near_the_fp32_maximum"],
    ),
    # 50: a fallback_kwargs lr relative to a scheduler's initial_lr before the lr the group was
    #     constructed with (OneCycleLR's warm-up start: the biases at 25x their lr)
    Mutant(
        "fallback-lr-initial-lr-first", "50 a scheduler's initial_lr as the fallback lr's base",
        "torch_fused/optim/sinkgd.py", CPU,
        [("            start = group.get(\"fallback_lr_base\", group.get(\"initial_lr\"))\n",
          "            start = group.get(\"initial_lr\", group.get(\"fallback_lr_base\"))  # MUTANT\n")],
        ["tests/test_sinkgd.py::test_fallback_kwargs_lr_follows_a_scheduler_that_sets_the_lr_at_construction"],
    ),
    # 51: the optimizer's argument checks: a 1-element 1-D or integer lr tensor taken, a flag
    #     taken by its truth value (spectral_norm="False" turns the spectral step on)
    Mutant(
        "lr-tensor-shape-unchecked", "51 SinkGD arguments taken unchecked", "torch_fused/optim/sinkgd.py", CPU,
        [("        if lr.dim() != 0 or not lr.is_floating_point():\n", "        if False:  # MUTANT\n")],
        ["tests/test_sinkgd.py::test_bad_hyperparameters_raise_naming_them"],
    ),
    Mutant(
        "flags-by-truth-value", "51 SinkGD arguments taken unchecked", "torch_fused/optim/sinkgd.py", CPU,
        [("        if _flag(group[key]) is None:\n", "        if False:  # MUTANT\n")],
        ["tests/test_sinkgd.py::test_bad_hyperparameters_raise_naming_them"],
    ),
    # 52-56: packed batches (cu_seqlens): a boundary token put in the sequence before it, an empty
    # sequence left out of seq-mean-token-sum's count, the log-prob targets scoring across a
    # boundary, an [S] tensor in aggregate_loss (torch.compile specializes S == 1: a recompile),
    # and the CPU values of cu_seqlens unchecked in a compiled call
    Mutant(
        "packed-boundary-left", "52 a sequence's first token counted in the sequence before it", "torch_fused/packed.py",
        CPU, [("    return torch.searchsorted(cu_seqlens, pos, right=True)\n",
               "    return torch.searchsorted(cu_seqlens, pos, right=False)  # MUTANT\n")],
        ["tests/test_packed.py"],
    ),
    Mutant(
        "packed-empty-not-counted", "53 empty sequences left out of seq-mean-token-sum's S", "torch_fused/masked.py", CPU,
        [("        return s.sum() / torch.sym_max(cu_seqlens.shape[0] - 1, 1)\n",
          "        return s.sum() / torch.clamp((cu_seqlens[1:] > cu_seqlens[:-1]).sum(), min=1)  # MUTANT\n")],
        ["tests/test_packed.py"],
    ),
    Mutant(
        "packed-targets-cross", "54 packed targets that score across a boundary", "torch_fused/packed.py", CPU,
        [("    return torch.roll(input_ids, -1, -1).masked_fill(last, ignore_index)\n",
          "    return torch.roll(input_ids, -1, -1).masked_fill(pos == length - 1, ignore_index)  # MUTANT\n")],
        ["tests/test_packed.py"],
    ),
    Mutant(
        "packed-aggregate-s-tensor", "55 an [S] tensor in the packed aggregate_loss", "torch_fused/masked.py", CPU,
        [("    s = s.reshape(-1)\n", "    s = s.reshape(-1)[1:-1]  # MUTANT: the S sequences' sums\n"),
         ("    w = w.reshape(-1)\n", "    w = w.reshape(-1)[1:-1]  # MUTANT\n")],
        ["tests/test_packed.py"],
    ),
    Mutant(
        "packed-values-unchecked-compiled", "56 cu_seqlens' values unchecked in a compiled CPU call",
        "torch_fused/packed.py", CPU,
        [("    ok = (cu_seqlens[0] == 0) &", "    return  # MUTANT\n    ok = (cu_seqlens[0] == 0) &")],
        ["tests/test_packed.py"],
    ),
    # 57-64: distillation (fused::distill, fused::linear_distill): the JSD's weights swapped (beta
    # on the student's KL to the mixture), reverse KL's gradient without its -D term, the
    # student's entropy skipped at ignored rows, token-mean counting ignored positions, d weight
    # restarted at every group of the head's chunks, the reduced mode's backward not scaled by the
    # upstream gradient, the softcap's chain factor dropped in the kernel, a -inf teacher slot of
    # a top-k teacher left in the support
    Mutant(
        "distill-jsd-weights-swapped", "57 the generalized JSD's weights swapped", "torch_fused/reference.py", CPU,
        [("    return rows(beta * _plogq(pt, b - lm) * LN2 + (1.0 - beta) * kl_s, kl_s)\n",
          "    return rows((1.0 - beta) * _plogq(pt, b - lm) * LN2 + beta * kl_s, kl_s)  # MUTANT\n")],
        ["tests/test_distill.py::test_logits_match_float64"],
    ),
    Mutant(
        "distill-reverse-kl-grad-no-aux-triton", "58 reverse KL's gradient without its -D term",
        "torch_fused/kernels/distill.py", TRITON,
        [("                b_dz = tl.where(b_pa > 0.0, b_pa * ((b_a - b_b) * LN2 - aux), 0.0)\n",
          "                b_dz = tl.where(b_pa > 0.0, b_pa * ((b_a - b_b) * LN2), 0.0)  # MUTANT\n")],
        ["tests/test_distill.py::test_logits_kernels", "tests/test_distill.py::test_head_kernels"],
    ),
    Mutant(
        "distill-entropy-skipped-at-ignored-triton", "59 the student's entropy skipped at ignored rows",
        "torch_fused/kernels/distill.py", TRITON,
        [("        if not HAS_ENT:  # the entropy is made for every row; without it ignored rows are skipped\n",
          "        if True:  # MUTANT\n")],
        ["tests/test_distill.py::test_logits_kernels"],
    ),
    Mutant(
        "distill-token-mean-counts-ignored", "60 token-mean counting ignored positions", "torch_fused/ops/distill.py",
        CPU, [("    count = torch.full((1,), n, dtype=dt, device=dev) if lab is None else \\\n",
               "    count = torch.full((1,), n, dtype=dt, device=dev) if True else \\\n")],
        ["tests/test_distill.py::test_head_matches_float64"],
    ),
    Mutant(
        "distill-dweight-restarted-per-group", "61 d weight restarted at every group of chunks",
        "torch_fused/ops/distill.py", CPU,
        [("                _addmm_f32_(self.dw_acc, dz.t(), h[g0:g1], first=g0 == 0)\n",
          "                _addmm_f32_(self.dw_acc, dz.t(), h[g0:g1], first=True)  # MUTANT\n")],
        ["tests/test_distill.py::test_head_matches_float64"],
    ),
    Mutant(
        "distill-reduced-backward-unscaled", "62 the reduced mode's backward not scaled by the upstream gradient",
        "torch_fused/ops/distill.py", CPU,
        [("    return torch.mul(saved, g.to(saved.dtype), out=out)\n",
          "    return out.copy_(saved)  # MUTANT\n")],
        ["tests/test_distill.py::test_head_matches_float64"],
    ),
    Mutant(
        "distill-softcap-chain-dropped-triton", "63 the softcap's chain factor dropped in the gradient kernel",
        "torch_fused/kernels/distill.py", TRITON,
        [("                b_dx = b_dx * (1.0 - b_th * b_th)\n", "                b_dx = b_dx  # MUTANT\n")],
        ["tests/test_distill.py::test_head_kernels"],
    ),
    Mutant(
        "distill-topk-ninf-slot-kept", "64 a top-k teacher's -inf slot left in the support", "torch_fused/ops/distill.py",
        CPU, [("    valid = (ids != opts.ignore_index) & (logprobs != float(\"-inf\"))\n",
               "    valid = ids != opts.ignore_index  # MUTANT\n")],
        ["tests/test_distill.py::test_topk_teacher_logits_and_head"],
    ),
    # 65: the distillation passes' row segments (the head's chunks): the statistics of the first
    #     segment taken for the whole row
    Mutant(
        "distill-segments-first-only-triton", "65 a row's first segment taken for the whole row",
        "torch_fused/ops/distill.py", TRITON,
        [("    m_s, s_s, t_s, _, _ = lp_ops.merge_row_stats(part[..., 0], part[..., 1], part[..., 2], cs, exact, 1)\n",
          "    m_s, s_s, t_s = part[:, 0, 0], part[:, 0, 1], part[:, 0, 2]  # MUTANT\n")],
        ["tests/test_distill.py::test_head_kernels"],
    ),
    # 66-69: the sampler's support (kernels/sampler.py, the core backward's support list): a
    # negative threshold decoded without its bucket's low bits (the k-th largest of a row below
    # zero read as another value), ties with the threshold left out of the support list, the
    # listed backward placing a segment's columns without the segment's offset, and an id outside
    # the support given its log-prob gradient by the reference backward
    Mutant(
        "sampler-negative-key-bucket-triton", "66 a negative threshold decoded without its bucket's low bits",
        "torch_fused/kernels/sampler.py", TRITON,
        [("    k = tl.where(r < 0, r | ((1 << LO_BIT) - 1), r)\n", "    k = r  # MUTANT\n")],
        ["tests/test_sampler_support.py::test_threshold_kernels_match_the_rule"],
    ),
    Mutant(
        "sampler-list-ties-dropped-triton", "67 ties with the threshold left out of the support list",
        "torch_fused/kernels/sampler.py", TRITON,
        [("        keep = live & (v >= tau)\n", "        keep = live & (v > tau)  # MUTANT\n")],
        ["tests/test_sampler_support.py::test_threshold_kernels_match_the_rule"],
    ),
    Mutant(
        "sampler-listed-segment-offset-triton", "68 the listed backward's columns without the segment's offset",
        "torch_fused/kernels/logprobs.py", TRITON,
        [("        j = tl.load(p_list + 1 + i, mask=i < n, other=-1) - c0\n",
          "        j = tl.load(p_list + 1 + i, mask=i < n, other=-1)  # MUTANT\n")],
        ["tests/test_sampler_support.py::test_listed_and_streamed_backward_agree"],
    ),
    Mutant(
        "sampler-outside-id-gradient-ref", "69 an id outside the support given its log-prob gradient",
        "torch_fused/reference.py", CPU,
        [("            g2 = torch.where(inb & (x_ids < tau2), torch.zeros_like(g2), g2)\n",
          "            pass  # MUTANT\n")],
        ["tests/test_sampler_support.py::test_listed_and_streamed_backward_agree"],
    ),
    Mutant(
        "head-chunk-width-follows-n", "70 the batch-invariant head's vocabulary chunks as wide as the budget allows for N",
        "torch_fused/ops/linear_logprobs.py", TRITON,
        [("    if invariant:\n        return max(min_cols, 128)\n", "    if False:  # MUTANT\n        return max(min_cols, 128)\n")],
        ["tests/test_batch_invariance.py"],
    ),
    Mutant(
        "head-invariant-dh-overwritten", "71 the invariant GEMM's d hidden started afresh on every vocabulary chunk",
        "torch_fused/ops/linear_logprobs.py", TRITON,
        [("_matmul_into(dh, dz, w[v0:v1], accumulate=v0 != 0)", "_matmul_into(dh, dz, w[v0:v1], accumulate=False)  # MUTANT")],
        LM_HEAD_TESTS,
    ),
    # 72-74: the vocab-parallel distillation (parallel_distill.py): a plain KL merged from the
    # slices' KLs without the KL between the slices' probabilities, the JSD's per-slice divergence
    # sums not all-reduced, the heads' partial d hidden not summed over the ranks
    Mutant(
        "distill-parallel-kl-chain-term-dropped", "72 the slices' KLs merged without the KL of their shares",
        "torch_fused/parallel_distill.py", CPU,
        [("        term = torch.exp2(lp) * (d_r + (lp - lq) * ln2)\n",
          "        term = torch.exp2(lp) * d_r  # MUTANT\n")],
        ["tests/test_distill_parallel.py"],
    ),
    Mutant(
        "distill-parallel-jsd-sums-not-reduced", "73 the JSD's per-slice sums taken as the rows' values",
        "torch_fused/parallel_distill.py", CPU,
        [("    sums = P._all_reduce_sum(sums, layout) if sums.numel() else sums\n", "    pass  # MUTANT\n")],
        ["tests/test_distill_parallel.py"],
    ),
    Mutant(
        "distill-parallel-dhidden-not-reduced", "74 the heads' partial d hidden not summed over the ranks",
        "torch_fused/parallel_distill.py", CPU,
        [("            dh = LL.hidden_grad_from_rows(P._all_reduce_sum(dh, layout) if dh.numel() else dh, sh, "
          "opts.shift)\n",
          "            dh = LL.hidden_grad_from_rows(dh, sh, opts.shift)  # MUTANT\n")],
        ["tests/test_distill_parallel.py"],
    ),
    Mutant(
        "head-support-backward-full-vocabulary", "75 the head's support backward spreading d logits over the whole vocabulary",
        "torch_fused/ops/linear_logprobs.py", CPU,
        [("w.dtype, threshold=tau)", "w.dtype, threshold=None)  # MUTANT")],
        ["tests/test_sampler_support.py"],
    ),
    Mutant(
        "head-listed-backward-no-normalizer", "76 the head's listed backward without the softmax normalizer's term",
        "torch_fused/ops/linear_logprobs.py", CPU,
        [("        dz -= p * g_all[:, None]\n", "        pass  # MUTANT\n")],
        ["tests/test_sampler_support.py"],
    ),
    Mutant(
        "head-support-route-per-call", "77 the head's support backward choosing one route for the whole call",
        "torch_fused/ops/linear_logprobs.py", CPU,
        [("            _listed_backward(glp, gh, hm, w, idx2, bias, st, ent2, opts, k, *grads)\n"
          "            unlisted = st[:, 3] < 0\n",
          "            if not bool((st[:, 3] < 0).any()):  # MUTANT\n"
          "                _listed_backward(glp, gh, hm, w, idx2, bias, st, ent2, opts, k, *grads)\n"
          "                unlisted = st[:, 3] < 0\n")],
        ["tests/test_sampler_support.py"],
    ),
    # 78: the top-p band with no width around the sample's estimate of the cut (every row whose
    # estimate is off by one sample goes to the exact kernel)
    Mutant(
        "sampler-top-p-band-no-width-triton", "78 the top-p band without its width around the estimated cut",
        "torch_fused/kernels/sampler.py", TRITON,
        [("        half = z_band * se + 2.0 * w_cut\n", "        half = 0.0 * se  # MUTANT\n")],
        ["tests/test_sampler_support.py::test_top_p_band_settles_the_ordinary_rows"],
    ),
    # 79 / 80: the fused head's epilogues skip id k's [BM, BN] search where no row of the tile has
    # that id in it; skipping also a tile where exactly one row has it loses that row's id (a
    # tile where several rows have it still runs)
    Mutant(
        "lm-head-stats-id-skip-triton", "79 the stats epilogue skips a tile where one row has id k",
        "torch_fused/kernels/lm_head.py", TRITON,
        [("        if tl.max(inside.to(tl.int32), axis=0) > 0:\n",
          "        if tl.sum(inside.to(tl.int32), axis=0) > 1:  # MUTANT\n")],
        ["tests/test_linear_logprobs.py::test_matches_materialized_float64"],
    ),
    Mutant(
        "lm-head-dlogits-id-skip-triton", "80 the d logits epilogue skips a tile where one row has id k",
        "torch_fused/kernels/lm_head.py", TRITON,
        [("(i_k <= n_hi)).to(tl.int32), axis=0) > 0:\n", "(i_k <= n_hi)).to(tl.int32), axis=0) > 1:  # MUTANT\n")],
        ["tests/test_linear_logprobs.py::test_matches_materialized_float64"],
    ),
    # 81: the d logits epilogue's tile test one column short (an id on a tile's last column skipped)
    Mutant(
        "lm-head-dlogits-id-skip-edge-triton", "81 the d logits epilogue's skip test misses a tile's last column",
        "torch_fused/kernels/lm_head.py", TRITON,
        [("(i_k <= n_hi)).to(tl.int32), axis=0) > 0:\n", "(i_k < n_hi)).to(tl.int32), axis=0) > 0:  # MUTANT\n")],
        ["tests/test_linear_logprobs.py::test_ids_on_every_column_of_the_tiles"],
    ),
    # 82: the fused head's support listing counting only the top k (ties past the k-th value
    # listed as if the row kept k ids)
    Mutant(
        "head-support-kept-ties-ref", "82 the head's kept-id count blind to ties past the k-th value",
        "torch_fused/ops/linear_logprobs.py", CPU,
        [("                kept = torch.where(vals[:, k] >= tau, k + 1, kept)\n", "                pass  # MUTANT\n")],
        ["tests/test_sampler_support.py::test_fused_head_listed_and_chunked_backward_agree"],
    ),
    # 83 / 84: the fused head's epilogues loop over the K ids at run time; a bound one short
    # drops each row's last id (its log-prob, then its gradient)
    Mutant(
        "lm-head-stats-id-loop-short-triton", "83 the stats epilogue's loop over the ids one short",
        "torch_fused/kernels/lm_head.py", TRITON,
        [("    for k in range(K):\n        i_k = tl.load(p_idx + rows * K + k, mask=live",
          "    for k in range(K - 1):  # MUTANT\n        i_k = tl.load(p_idx + rows * K + k, mask=live")],
        ["tests/test_linear_logprobs.py::test_matches_materialized_float64"],
    ),
    Mutant(
        "lm-head-dlogits-id-loop-short-triton", "84 the d logits epilogue's loop over the ids one short",
        "torch_fused/kernels/lm_head.py", TRITON,
        [("        for k in range(K):\n            i_k = tl.load(p_idx + rows * K + k).to(tl.int64) - v_off\n",
          "        for k in range(K - 1):  # MUTANT\n            i_k = tl.load(p_idx + rows * K + k).to(tl.int64) - v_off\n")],
        ["tests/test_linear_logprobs.py::test_matches_materialized_float64"],
    ),
    # 85 / 86: the fused head's support listing from the threshold kernels' list: the ids read one
    # column early (the count taken for an id); a row keeping more than k ids (ties past the k-th)
    # listed with k of them
    Mutant(
        "head-support-kernel-list-offset-triton", "85 the head's listing from the kernels' list one column early",
        "torch_fused/ops/linear_logprobs.py", TRITON,
        [("ids = torch.where(inside, listed[:, 1:1 + k].to(torch.int64), v)",
          "ids = torch.where(inside, listed[:, 0:k].to(torch.int64), v)  # MUTANT")],
        ["tests/test_sampler_support.py::test_fused_head_listed_and_chunked_backward_agree"],
    ),
    Mutant(
        "head-support-kernel-list-ties-triton", "86 the head's listing from the kernels' list keeps a row with ties past k",
        "torch_fused/ops/linear_logprobs.py", TRITON,
        [("            ok = (kept > 0) & (kept <= k)\n", "            ok = kept > 0  # MUTANT\n")],
        ["tests/test_sampler_support.py::test_fused_head_listed_and_chunked_backward_agree"],
    ),
    # 87-91: the two-pass filter kernel and the listed forward: the k-th lane max's search taking
    # a count above k (a bound past the k-th largest: ids of the support never listed), the
    # appends' capacity test one past the list, the list's order from ranks off by one, a row
    # holding a NaN listed, the listed forward's gather one entry short
    Mutant(
        "sampler-lane-bound-past-k-triton", "87 the filter's lane bound from a count above k",
        "torch_fused/kernels/sampler.py", TRITON,
        [("        r = tl.where(n >= k, cand, r)\n", "        r = tl.where(n >= k - 1, cand, r)  # MUTANT\n")],
        ["tests/test_sampler_support.py"],
    ),
    Mutant(
        "sampler-append-past-capacity-triton", "88 the filter's appends one past the list's capacity",
        "torch_fused/kernels/sampler.py", TRITON,
        [("    ok = cnt <= CAP\n    tau = tl.full", "    ok = cnt <= CAP + 1  # MUTANT\n    tau = tl.full"),
         ("    put = cand & (slot < CAP)\n", "    put = cand & (slot <= CAP)  # MUTANT\n")],
        ["tests/test_sampler_support.py"],
    ),
    Mutant(
        "sampler-list-order-ranks-triton", "89 the list's order from ranks that count equal positions",
        "torch_fused/kernels/sampler.py", TRITON,
        [("            rank += tl.sum((pj[None, :] < pi[:, None]).to(tl.int32), 1)\n",
          "            rank += tl.sum((pj[None, :] <= pi[:, None]).to(tl.int32), 1)  # MUTANT\n")],
        ["tests/test_sampler_support.py"],
    ),
    Mutant(
        "sampler-nan-row-listed-triton", "90 a row holding a NaN listed (its forward then blind to the NaN)",
        "torch_fused/kernels/sampler.py", TRITON,
        [("        if has_nan == 0:\n", "        if True:  # MUTANT\n")],
        ["tests/test_sampler_support.py::test_a_row_holding_a_nan_is_not_listed"],
    ),
    Mutant(
        "logprobs-listed-forward-short-triton", "91 the listed forward's gather one entry short",
        "torch_fused/kernels/logprobs.py", TRITON,
        [("        pos = tl.load(p_list + o, mask=o < n, other=-1)\n",
          "        pos = tl.load(p_list + o, mask=o < n - 1, other=-1)  # MUTANT\n")],
        ["tests/test_sampler_support.py"],
    ),
    # 92-94: the fused head's ids beside its epilogues (more than lm_head_epilogue_ids of them): a
    # repeated id's d logit taking its own slot's gradient only, each chunk's scatter at the
    # global column (the chunk's first id not subtracted), the batch-invariant sum of the ids'
    # gradients one id short
    Mutant(
        "head-side-ids-repeat-triton", "92 the side kernel's d logit of a repeated id from its own slot only",
        "torch_fused/kernels/lm_head.py", TRITON,
        [("            d += tl.sum(tl.where(ids_j[None, :] == ids[:, None], g_j[None, :], 0.0), axis=1)\n",
          "            d += tl.sum(tl.where((j0 + o_j)[None, :] == o_k[:, None], g_j[None, :], 0.0), axis=1)  # MUTANT\n")],
        LM_HEAD_TESTS,
    ),
    Mutant(
        "head-side-ids-chunk-offset-triton", "93 the ids' scatter into a chunk at the global column",
        "torch_fused/ops/linear_logprobs.py", TRITON,
        [("        _scatter_ids(id_dz, ids, dz, v_off)\n", "        _scatter_ids(id_dz, ids, dz, 0)  # MUTANT\n")],
        LM_HEAD_TESTS,
    ),
    Mutant(
        "head-side-ids-invariant-sum-triton", "94 the batch-invariant sum of the ids' gradients one id short",
        "torch_fused/kernels/lm_head.py", TRITON,
        [("    for k in range(K):\n        a += tl.load(p_g + r * K + k, mask=live, other=0.0)\n",
          "    for k in range(K - 1):  # MUTANT\n        a += tl.load(p_g + r * K + k, mask=live, other=0.0)\n")],
        LM_HEAD_TESTS,
    ),
    # 95 / 96: the distillation head's per-token backward over vocabulary chunks: d hidden restarted
    # at every chunk, each chunk's logits given the first columns' bias
    Mutant(
        "distill-vocab-dh-restarted", "95 the vocabulary-chunk backward's d hidden restarted at every chunk",
        "torch_fused/ops/distill.py", CPU,
        [("            _addmm_f32_(dh_rows, d, s.w[v0:v1], first=v0 == 0)\n",
          "            _addmm_f32_(dh_rows, d, s.w[v0:v1], first=True)  # MUTANT\n")],
        ["tests/test_distill.py"],
    ),
    Mutant(
        "distill-vocab-bias-offset", "96 a vocabulary chunk's logits given the first columns' bias",
        "torch_fused/ops/distill.py", CPU,
        [("            z += self.b[v0:v1].to(z.dtype)\n", "            z += self.b[:z.shape[1]].to(z.dtype)  # MUTANT\n")],
        ["tests/test_distill.py"],
    ),
    Mutant(
        "distill-vocab-fp32-weight", "97 the vocabulary-chunk backward taken for an fp32 d weight (no accumulator saved)",
        "torch_fused/ops/distill.py", CPU,
        [("            if weight_grad and dw.dtype not in (torch.float32, torch.float64) else None)\n",
          "            if weight_grad else None)  # MUTANT\n")],
        ["tests/test_distill.py"],
    ),
    # 98-100: the one-pass filter (kernels/sampler.py, ONE_PASS): an overflowed row not listed
    # again, the first bound and a raised bound past the row's threshold
    Mutant(
        "sampler-one-pass-no-relist-triton", "98 the one-pass filter's overflowed row not listed again",
        "torch_fused/kernels/sampler.py", TRITON,
        [("                tl.debug_barrier()  # the count reset before any thread's appends\n"
          "                _list_pass(p_row, V, L, p_cnt_row, p_lv, p_lp, CAP, BLOCK)\n",
          "                tl.debug_barrier()  # MUTANT\n")],
        ["tests/test_sampler_support.py"],
    ),
    Mutant(
        "sampler-one-pass-warm-bound-triton", "99 the one-pass filter's first bound past the row's threshold",
        "torch_fused/kernels/sampler.py", TRITON,
        [("            L = _filter_bound(lanes, delta, top_k, HAS_MINP, HAS_TOPK, LO_BIT)\n            full = ",
          "            L = _filter_bound(lanes, delta, top_k, HAS_MINP, HAS_TOPK, LO_BIT) + 0.5  # MUTANT\n"
          "            full = ")],
        ["tests/test_sampler_support.py"],
    ),
    Mutant(
        "sampler-one-pass-raised-bound-triton", "100 the one-pass filter's raised bound past the row's threshold",
        "torch_fused/kernels/sampler.py", TRITON,
        [("                L = _filter_bound(lanes, delta, top_k, HAS_MINP, HAS_TOPK, LO_BIT)\n                seg0 = seg1\n",
          "                L = _filter_bound(lanes, delta, top_k, HAS_MINP, HAS_TOPK, LO_BIT) + 0.5  # MUTANT\n"
          "                seg0 = seg1\n")],
        ["tests/test_sampler_support.py"],
    ),
    # 101 / 102: launches the interpreter does not see (compiled for sm_90 by the compile cases):
    # the fused head's GEMM tiles upcast under EXACT_SHIFT (a GPU launch sets it for T below
    # 0.0014); the log-prob forward's support branch tested on a local that is not constexpr
    Mutant(
        "head-upcast-from-exact-shift", "101 the fused head's GEMM tiles told to upcast by EXACT_SHIFT",
        "torch_fused/kernels/lm_head.py", CPU,
        [("    z, o_m, o_n = _logits_tile(p_h, p_w, p_b, N, V, H, stride_h, stride_w, pid_m, pid_n, HAS_BIAS, _UPCAST, BM, BN, BK, PROMOTE)\n"
          "    _stats_epilogue(",
          "    z, o_m, o_n = _logits_tile(p_h, p_w, p_b, N, V, H, stride_h, stride_w, pid_m, pid_n, HAS_BIAS, EXACT_SHIFT, BM, BN, BK, PROMOTE)  # MUTANT\n"
          "    _stats_epilogue(")],
        ["tests/test_kernels_compile.py"],
    ),
    Mutant(
        "logprobs-support-branch-not-constexpr", "102 the log-prob forward's support branch on a non-constexpr local",
        "torch_fused/kernels/logprobs.py", CPU,
        [("    if HAS_SUP:\n        n_sup = tl.load(p_sup + row * sup_stride)\n        if n_sup >= 0:\n"
          "            m, s, t = _listed_statistics(p_row, p_sup + row * sup_stride + 1, n_sup, V, c, HAS_ENT, EXACT_SHIFT,\n"
          "                                         BLOCK_V, EPT)\n"
          "        else:\n"
          "            m, s, t = _row_statistics(p_row, V, c, tau, HAS_ENT, EXACT_SHIFT, HAS_TAU, BLOCK_V, EPT)\n"
          "    else:\n"
          "        m, s, t = _row_statistics(p_row, V, c, tau, HAS_ENT, EXACT_SHIFT, HAS_TAU, BLOCK_V, EPT)\n",
          "    n_sup = -1  # MUTANT\n    if HAS_SUP:\n        n_sup = tl.load(p_sup + row * sup_stride)\n    if n_sup >= 0:\n"
          "        m, s, t = _listed_statistics(p_row, p_sup + row * sup_stride + 1, n_sup, V, c, HAS_ENT, EXACT_SHIFT,\n"
          "                                     BLOCK_V, EPT)\n"
          "    else:\n"
          "        m, s, t = _row_statistics(p_row, V, c, tau, HAS_ENT, EXACT_SHIFT, HAS_TAU, BLOCK_V, EPT)\n")],
        ["tests/test_kernels_compile.py"],
    ),
    # 103 / 104: the split filter (kernels/sampler.py, SPLIT): the tail kernel reads another
    # row's working list; it cuts a one-pass list past the row's threshold
    Mutant(
        "sampler-split-tail-wrong-list-triton", "103 the split filter's tail reading the first row's working list",
        "torch_fused/kernels/sampler.py", TRITON,
        [("    p_lv = p_val + i * CAP\n    p_lp = p_pos + i * (2 * CAP)\n",
          "    p_lv = p_val  # MUTANT\n    p_lp = p_pos\n")],
        ["tests/test_sampler_support.py"],
    ),
    Mutant(
        "sampler-split-cut-past-tau-triton", "104 the split one-pass filter's tail cutting its list past the threshold",
        "torch_fused/kernels/sampler.py", TRITON,
        [("tl.load(p_ml + i * 3 + 2), KEY_MIN, CHUNK)", "tl.load(p_ml + i * 3 + 2) + 0.5, KEY_MIN, CHUNK)")],
        ["tests/test_sampler_support.py"],
    ),
    # 105: the wide digit search's per-thread sums keeping only a pass's last block
    Mutant(
        "sampler-wide-select-last-block-triton", "105 the wide digit search summing a pass's last block alone",
        "torch_fused/kernels/sampler.py", TRITON,
        [("                acc2 += tl.where(hit, wt[:, None], 0)\n", "                acc2 = tl.where(hit, wt[:, None], 0)  # MUTANT\n")],
        ["tests/test_sampler_support.py"],
    ),
    # 106 / 107: the top-p kernel's appending band pass (APPEND): the ids above the band listed as
    # well as summed; a listed support cut one key past the threshold (the interpreter's atomics hand out slots in
    # lane order, so a list left unsorted is not visible there: the CUDA tests see it)
    Mutant(
        "sampler-top-p-append-band-open-triton", "106 the appending top-p band pass listing the ids above the band too",
        "torch_fused/kernels/sampler.py", TRITON,
        [("full = _append_where((k_x >= lo) & under, ", "full = _append_where((k_x >= lo) & (o < V), ")],
        ["tests/test_sampler_support.py"],
    ),
    Mutant(
        "sampler-top-p-append-cut-past-ties-triton", "107 the appending top-p band pass's list cut past the threshold's ties",
        "torch_fused/kernels/sampler.py", TRITON,
        [("                    kept = _compact(p_val, p_pos, cnt, float(\"-inf\"), r3, CHUNK)\n",
          "                    kept = _compact(p_val, p_pos, cnt, float(\"-inf\"), r3 + (1 << LO_BIT), CHUNK)\n")],
        ["tests/test_sampler_support.py"],
    ),
    # 108: the filter's overflowed top-k row taken as settled (its tau from a list that lost ids)
    Mutant(
        "sampler-filter-overflow-settled-triton", "108 the filter's overflowed top-k row taken as settled",
        "torch_fused/kernels/sampler.py", TRITON,
        [("        if HAS_TOPK or HAS_TOPP:\n            tl.store(p_sup_row, NEEDS_EXACT)\n",
          "        if HAS_TOPK or HAS_TOPP:  # MUTANT\n            tl.store(p_sup_row, NOT_LISTED)\n"
          "            tl.store(p_tau + row64, tau)\n")],
        ["tests/test_sampler_support.py"],
    ),
]


# ---------------------------------------------------------------------------------------------
# Machinery
# ---------------------------------------------------------------------------------------------
class StaleMutant(Exception):
    pass


# A pytest plugin loaded into every run (-p mutation_guard): after collection, every imported
# torch_fused module must come from the copy, and TRITON_INTERPRET must be as the run intends.
GUARD = textwrap.dedent('''
    import os
    import sys

    import pytest


    def pytest_collection_finish(session):
        import torch_fused
        from torch_fused import _library

        root = os.path.realpath(os.environ["MUTATION_COPY"]) + os.sep
        files = {n: os.path.realpath(getattr(m, "__file__", "") or "") for n, m in list(sys.modules.items())
                 if n == "torch_fused" or n.startswith("torch_fused.")}
        outside = sorted(f"{n}: {f}" for n, f in files.items() if not f.startswith(root))
        with open(os.environ["MUTATION_GUARD_OUT"], "w") as fh:
            fh.write(f"file={os.path.realpath(torch_fused.__file__)}\\n")
            fh.write(f"modules={len(files)}\\n")
            fh.write(f"interpret={int(_library.INTERPRET)}\\n")
            fh.write("outside=" + ";".join(outside) + "\\n")
        if outside:
            pytest.exit("torch_fused modules imported from outside the copy: " + "; ".join(outside), returncode=3)
        if int(_library.INTERPRET) != int(os.environ["MUTATION_WANT_INTERPRET"]):
            pytest.exit(f"INTERPRET is {_library.INTERPRET}, not as intended", returncode=3)
        if os.environ.get("MUTATION_SHRINK") != "1":
            _no_shrink(session.items)


    def _event(kind, nodeid):
        with open(os.environ["MUTATION_EVENTS"], "a") as fh:
            fh.write(f"{kind} {nodeid}\\n")


    def pytest_runtest_logstart(nodeid, location):
        _event("START", nodeid)


    def pytest_runtest_logreport(report):
        if report.failed:
            _event("FAILED" if report.when == "call" else "ERROR", report.nodeid)
        if report.when == "teardown":
            _event("END", report.nodeid)


    def _no_shrink(items):
        """Hypothesis tests keep their examples (same profile, same derandomized generation) but
        report the first failing one instead of shrinking it: under the interpreter a shrink can
        take minutes and changes nothing about pass or fail."""
        try:
            from hypothesis import Phase, settings
        except ImportError:
            return
        done = set()
        for item in items:
            fn = getattr(item, "obj", None)
            s = getattr(fn, "_hypothesis_internal_use_settings", None)
            if s is None or id(fn) in done:
                continue
            done.add(id(fn))
            fn._hypothesis_internal_use_settings = settings(
                s, phases=[p for p in s.phases if p not in (Phase.shrink, Phase.explain)])
''')


def resolve_rev(rev: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", rev + "^{commit}"],
                          check=True, capture_output=True, text=True).stdout.strip()


def make_copy(dest: Path, sha: str | None) -> None:
    """torch_fused/, tests/, pyproject.toml of commit sha (or of the working tree if sha is None)."""
    if sha is None:
        for p in COPY_PATHS:
            src = ROOT / p
            if src.is_dir():
                shutil.copytree(src, dest / p, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis"))
            else:
                shutil.copy2(src, dest / p)
        return
    data = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", sha, *COPY_PATHS],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # pragma: no cover - old Pythons
            tar.extractall(dest)


def mutate(text: str, mutant: Mutant) -> str:
    """``text`` (the mutant's file) with the mutant's replacements applied in order; raises
    StaleMutant where an ``old`` text does not occur exactly once in the text as the earlier
    replacements left it, or a replacement changes nothing. tests/test_mutation_anchors.py runs
    this on the checkout, so that a change that moves an anchor fails the test suite."""
    for i, (old, new) in enumerate(mutant.edits):
        n = text.count(old)
        if n != 1:
            raise StaleMutant(f"{mutant.name}: replacement {i + 1} of {len(mutant.edits)}: the old text occurs "
                              f"{n} times in {mutant.file} (expected exactly once):\n{textwrap.indent(old, '    | ')}")
        if old == new:
            raise StaleMutant(f"{mutant.name}: replacement {i + 1} changes nothing")
        text = text.replace(old, new)
    return text


def mutant_source(root: Path, mutant: Mutant) -> str:
    """The mutant's file under ``root`` as the mutant leaves it (StaleMutant if it does not apply)."""
    f = root / mutant.file
    if not f.is_file():
        raise StaleMutant(f"{mutant.name}: {mutant.file} does not exist")
    return mutate(f.read_text(), mutant)


def apply_edits(root: Path, mutant: Mutant) -> None:
    (root / mutant.file).write_text(mutant_source(root, mutant))


FAILED_RE = re.compile(r"^FAILED (\S+?::.+?)(?: - .*)?$")
ERROR_RE = re.compile(r"^ERROR (\S+)(?: - .*)?$")


@dataclasses.dataclass
class RunResult:
    rc: int
    failed: list[str]
    errors: list[str]
    seconds: float
    output: str
    guard: dict
    reasons: list[str]  # the first error line of each failure
    timed_out: bool
    crashed_in: str | None  # the test that was running when pytest died (no summary then)


def run_pytest(copy: Path, tmp: Path, interpret: bool, tests: list[str], python: str, timeout: float,
               shrink: bool = False, stop_first: bool = True) -> RunResult:
    guard_dir = tmp / "_guard"
    guard_dir.mkdir(exist_ok=True)
    (guard_dir / "mutation_guard.py").write_text(GUARD)
    guard_out = tmp / "guard.txt"
    events = tmp / "events.txt"
    for f in (guard_out, events):
        if f.exists():
            f.unlink()
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "PYTHONPATH", "PYTEST_ADDOPTS", "HYPOTHESIS_PROFILE")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(copy), str(guard_dir)]),
        PYTHONDONTWRITEBYTECODE="1",
        TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
        TRITON_CACHE_DIR=str(tmp / "triton"),
        MUTATION_COPY=str(copy),
        MUTATION_GUARD_OUT=str(guard_out),
        MUTATION_EVENTS=str(events),
        MUTATION_WANT_INTERPRET="1" if interpret else "0",
        MUTATION_SHRINK="1" if shrink else "0",
    )
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    cmd = [python, "-m", "pytest", *(["-x"] if stop_first else []), *PYTEST_ARGS, "-p", "mutation_guard", *tests]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
        rc, out, timed_out = proc.returncode, proc.stdout, False
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc, out, timed_out = -9, out + f"\n[mutation_check] TIMEOUT after {timeout:.0f} s\n", True
    seconds = time.monotonic() - t0
    # failures from pytest's short summary ("FAILED ..." lines) and, should the process have died
    # before printing it, from the plugin's event log
    failed, errors = [], []
    for line in out.splitlines():
        m = FAILED_RE.match(line)
        if m:
            failed.append(m.group(1))
            continue
        m = ERROR_RE.match(line)
        if m:
            errors.append(m.group(1))
    running = None
    if events.exists():
        for line in events.read_text().splitlines():
            kind, _, nodeid = line.partition(" ")
            if kind == "FAILED" and nodeid not in failed:
                failed.append(nodeid)
            elif kind == "ERROR" and nodeid not in errors:
                errors.append(nodeid)
            running = nodeid if kind == "START" else (None if kind == "END" else running)
    crashed_in = running if (rc < 0 and not timed_out) else None
    # the first "E ..." line that names an error, per failure section of the report
    reasons, section, picked = [], None, set()
    for line in out.splitlines():
        h = re.match(r"^_{3,} (.+?) _{3,}$", line)
        if h:
            section = h.group(1)
        elif section and section not in picked and re.match(r"^E\s+\S*(Error|Exception|assert)", line):
            picked.add(section)
            reasons.append(f"{section}: {line[1:].strip()}")
    guard = {}
    if guard_out.exists():
        for line in guard_out.read_text().splitlines():
            k, _, v = line.partition("=")
            guard[k] = v
    return RunResult(rc, failed, errors, seconds, out, guard, reasons, timed_out, crashed_in)


# a failure that says the mutated code does not run at all (a name it uses is gone, a bad edit)
# proves nothing about the tests: the mutant is stale
BROKEN_RE = re.compile(r"\b(NameError|ImportError|ModuleNotFoundError|SyntaxError|IndentationError|UnboundLocalError)\b")


def guard_problem(res: RunResult, copy: Path, interpret: bool) -> str | None:
    """Why the run cannot be trusted (None if it can)."""
    if not res.guard:
        return "the guard plugin did not report (pytest did not reach collection?)"
    root = str(copy.resolve()) + os.sep
    if not res.guard.get("file", "").startswith(root):
        return f"torch_fused imported from {res.guard.get('file')}, not from the copy"
    if res.guard.get("outside"):
        return f"modules from outside the copy: {res.guard['outside']}"
    if res.guard.get("interpret") != ("1" if interpret else "0"):
        return f"TRITON_INTERPRET took effect as {res.guard.get('interpret')}, wanted {int(interpret)}"
    return None


def torch_version(python: str) -> tuple[int, int] | None:
    """(major, minor) of the torch that ``python`` imports (None where it does not say)."""
    out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    m = re.match(r"(\d+)\.(\d+)", out.stdout.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def tail(text: str, n: int = 40) -> str:
    return "\n".join(text.splitlines()[-n:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", metavar="NAME", help="run only this mutant (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--rev", default="HEAD", help="commit to copy (default HEAD, resolved once)")
    ap.add_argument("--worktree", action="store_true",
                    help="copy the working tree instead of a commit (includes uncommitted edits)")
    ap.add_argument("--all-failures", action="store_true",
                    help="run each mutant's whole test subset (no -x) and list every failing test (slower)")
    ap.add_argument("--no-control", action="store_true",
                    help="skip rerunning the failing tests on an unmutated copy")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs pytest (default: this one)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (default 900)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    ap.add_argument("--shrink", action="store_true",
                    help="let hypothesis shrink a failing example (slow under the interpreter; off by default)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every run's pytest output tail")
    args = ap.parse_args(argv)

    if args.list:  # STALE: the mutant does not apply to the working tree
        w = max(len(m.name) for m in MUTANTS)
        for m in MUTANTS:
            try:
                mutant_source(ROOT, m)
                mark = ""
            except StaleMutant:
                mark = "STALE  "
            only = f";  torch < {'.'.join(map(str, m.torch_below))} only" if m.torch_below else ""
            print(f"{mark}{m.name:<{w}}  {m.path:<18}  {m.file:<34}  bug {m.bug};  tests: {' '.join(m.tests)}{only}")
        return 0

    mutants = MUTANTS
    if args.only:
        names = {m.name for m in MUTANTS}
        unknown = [n for n in args.only if n not in names]
        if unknown:
            ap.error(f"unknown mutant(s) {unknown}; --list shows them")
        mutants = [m for m in MUTANTS if m.name in args.only]

    sha = None if args.worktree else resolve_rev(args.rev)
    source = "working tree (uncommitted edits included)" if sha is None else f"commit {sha[:12]} ({args.rev})"
    print(f"[mutation_check] source: {source}; python: {args.python}", flush=True)

    # which mutants still apply, on one copy of the source: a stale one (its text to mutate gone)
    # is reported STALE and skipped, the others run
    stale = {}
    with tempfile.TemporaryDirectory(prefix="torch_fused_mut_probe_") as d:
        make_copy(Path(d), sha)
        for m in mutants:
            try:
                mutant_source(Path(d), m)
            except StaleMutant as e:
                stale[m.name] = str(e)
    if stale:
        print(f"[mutation_check] {len(stale)} STALE mutant(s): the source no longer contains the text to mutate; "
              "update each to the code it targets (the other mutants run)\n", flush=True)
        for s in stale.values():
            print(s + "\n", flush=True)

    torch_at = torch_version(args.python) if any(m.torch_below for m in mutants) else None

    t_start = time.monotonic()
    rows = []  # (mutant, status, failed list, seconds, note)
    for i, m in enumerate(mutants, 1):
        if m.name in stale:
            print(f"[mutation_check] ({i}/{len(mutants)}) {m.name}: STALE, not run", flush=True)
            rows.append([m, "STALE", [], 0.0, "its text to mutate no longer occurs exactly once: update the mutant"])
            continue
        if m.torch_below and (torch_at is None or torch_at >= m.torch_below):
            below = ".".join(map(str, m.torch_below))
            have = ".".join(map(str, torch_at)) if torch_at else "unknown"
            note = f"only torch < {below} shows this bug (this python's torch: {have}); --python an older env runs it"
            print(f"[mutation_check] ({i}/{len(mutants)}) {m.name}: SKIPPED, {note}", flush=True)
            rows.append([m, "SKIPPED", [], 0.0, note])
            continue
        interpret = m.path == TRITON
        tmp = Path(tempfile.mkdtemp(prefix=f"torch_fused_mut_{m.name}_"))
        copy = tmp / "repo"
        copy.mkdir()
        try:
            make_copy(copy, sha)
            apply_edits(copy, m)
            print(f"[mutation_check] ({i}/{len(mutants)}) {m.name}: {m.path}, {m.file}, "
                  f"pytest {' '.join(m.tests)} ...", flush=True)
            res = run_pytest(copy, tmp, interpret, m.tests, args.python, args.timeout, args.shrink,
                             not args.all_failures)
            problem = guard_problem(res, copy, interpret)
        finally:
            if not args.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        died = (f"; then pytest died (rc={res.rc}) in {res.crashed_in}" if res.crashed_in else "")
        if problem:
            status, note = "INVALID", problem
        elif res.failed and res.reasons and all(BROKEN_RE.search(r) for r in res.reasons):
            status, note = "BROKEN", "every failure is the mutant's own code failing to run: update the mutant"
        elif res.failed:
            status, note = "caught", died.lstrip("; ")
        elif res.rc == 0:
            status, note = "SURVIVED", "no test failed"
        elif res.timed_out:
            status, note = "TIMEOUT", f"no failure within {args.timeout:.0f} s"
        elif res.crashed_in:
            status, note = "CRASHED", f"no test failed; pytest died (rc={res.rc}) in {res.crashed_in}"
        else:
            status, note = "ERROR", f"pytest rc={res.rc}, no FAILED test; errors: {res.errors or '-'}"
        rows.append([m, status, res.failed, res.seconds, note])
        print(f"[mutation_check]     -> {status} in {res.seconds:.0f} s: {', '.join(res.failed) or note}"
              + (f" ({note})" if res.failed and note else ""), flush=True)
        for why in res.reasons[:3]:
            print(f"[mutation_check]        {why[:300]}", flush=True)
        if status != "caught" or args.verbose:
            print(textwrap.indent(tail(res.output), "    | "), flush=True)

    # control: the tests that caught a mutant must pass on the unmutated code
    if not args.no_control:
        for path in (CPU, TRITON):
            nodes = sorted({n for m, st, failed, _, _ in rows if st == "caught" and m.path == path for n in failed})
            if not nodes:
                continue
            tmp = Path(tempfile.mkdtemp(prefix="torch_fused_mut_control_"))
            copy = tmp / "repo"
            copy.mkdir()
            try:
                make_copy(copy, sha)
                print(f"[mutation_check] control ({path}, unmutated): {len(nodes)} test(s) ...", flush=True)
                res = run_pytest(copy, tmp, path == TRITON, nodes, args.python, args.timeout, stop_first=False)
                problem = guard_problem(res, copy, path == TRITON)
            finally:
                if not args.keep:
                    shutil.rmtree(tmp, ignore_errors=True)
            bad = set(res.failed) | set(res.errors)
            ok = res.rc == 0 and not problem
            print(f"[mutation_check]     -> {'passed' if ok else 'FAILED'} in {res.seconds:.0f} s"
                  + (f": {problem}" if problem else "") + (f": red unmutated: {sorted(bad)}" if bad else ""),
                  flush=True)
            if not ok:
                print(textwrap.indent(tail(res.output), "    | "), flush=True)
                for row in rows:
                    m, st, failed = row[0], row[1], row[2]
                    if st == "caught" and m.path == path and (problem or res.rc != 0 and (not bad or set(failed) & bad)):
                        row[1] = "CONTROL-FAILED"
                        row[4] = "the failing test also fails unmutated" if set(failed) & bad else \
                            f"control run failed (rc={res.rc}) {problem or ''}"

    total = time.monotonic() - t_start
    header = ["mutant", "path", "file", "caught?", "first failing test(s)", "s"]
    table = [[m.name, m.path, m.file, "yes" if st == "caught" else st,
              ", ".join(failed[:3]) or note, f"{sec:.0f}"] for m, st, failed, sec, note in rows]
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(header)]
    print()
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in table:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    skipped = [r[0].name for r in rows if r[1] == "SKIPPED"]
    n_bad = sum(1 for r in rows if r[1] not in ("caught", "SKIPPED"))
    print(f"\n{len(rows) - n_bad - len(skipped)}/{len(rows) - len(skipped)} mutants caught"
          + (f" ({len(skipped)} skipped for this torch: {', '.join(skipped)})" if skipped else "")
          + f"; total {total:.0f} s; source {source}")
    if n_bad:
        print("NOT CAUGHT / NOT PROVEN: " + ", ".join(f"{r[0].name} ({r[1]})" for r in rows
                                                      if r[1] not in ("caught", "SKIPPED")))
    if stale:
        print(f"STALE (not run; their old texts are printed above): {', '.join(stale)}")
    # 1: a mutant that ran and was not caught (or its control failed); 2: stale mutants only
    if any(r[1] not in ("caught", "STALE", "SKIPPED") for r in rows):
        return 1
    return 2 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
