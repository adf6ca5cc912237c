"""``python -m torch_fused.bench``: time the fused ops against same-run baselines on a CUDA device.

Writes <out>/<suite>.json, <suite>.md and <suite>.png for each suite (suites named as arguments,
or with --only); ``--sweep`` writes
<out>/sweep_<suite>.json instead. ``python -m torch_fused.bench --help`` explains every option.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

import torch

from . import common

SUITES = ("logprobs", "temperature", "sampler", "small", "model_logits", "lm_head", "agreement", "vocab_parallel", "mask_reduce",
          "sinkgd", "step", "step_8b", "train", "distill", "distill_step")
# run when no suite is named: all but step_8b (an 8B-parameter model: most of an H200's memory) and train
# (a training-quality sweep of many minutes), which are named explicitly
DEFAULT_SUITES = tuple(s for s in SUITES if s not in ("step_8b", "train"))

DESCRIPTION = """\
Benchmark the torch_fused ops on a CUDA device against baselines timed in the same run
(torch eager, torch.compile of the plain formula, TRL's looped/chunked versions, fused AdamW).

Each row reports the time, the bandwidth and the fraction of the memory floor: the fewest bytes
the op must move (each input read once, each output written once) divided by the
device-to-device copy bandwidth measured at the start of the same run, over the measured time.
1.0 means the op runs as fast as a copy of the bytes it cannot avoid moving.

Suites:
  logprobs     selective_log_softmax, entropy_from_logits, logprobs_and_entropy (bf16 logits)
  temperature  selective_log_softmax forward+backward with a float temperature, a tensor one
               without grad and one with d T (bf16 logits)
  sampler      selective_log_softmax forward+backward over the sampler's support (top_k, top_p,
               min_p) against the full vocabulary and the handwritten torch rule (bf16 logits)
  small        the same public functions from [64, 1024] to [4096, 32000]: wall time per call
               against torch's formula, eager and a compiled GRPO-style loss, the raw ops and an
               empty-kernel op registered the same way (the registration's floor)
  model_logits logprobs_and_entropy forward+backward on a matmul's [B, L+1, V] output:
               shift=True against the [:, :-1] slice, eager and compiled
  lm_head      linear_logprobs_and_entropy against the bare GEMMs of the same run (its floor)
               and the materialized logits; peak memory beyond inputs and returned gradients
  agreement    the fused lm_head under its batch_invariant / promote settings (time against
               the bare GEMMs), its log-prob error against float64 beside an fp32 head's, and
               rows alone against rows inside the batch, bit for bit
  vocab_parallel
               one rank's local work of the vocab-parallel ops (2 ranks, no process group, the
               collectives not timed): the per-row partial statistics and their merge forward,
               the local backward, on a [N, V/2] bf16 shard of V = 151936 against the single-GPU
               op on the full logits (fractions of each one's floor); the fused head with a
               [V/2, H] weight shard against its shard's bare GEMMs
  mask_reduce  fused::mask_reduce against torch.where(...).sum and its torch.compile
  sinkgd       one SinkGD optimizer step against torch.optim.AdamW(fused=True)
  step         one GRPO training step of an 8-layer transformer (hidden 2048, vocab 151936,
               4096 tokens per sequence, bf16), eager and compiled: materialized logits +
               AdamW(fused=True), TRL's chunked lm_head (trl.kernels.ChunkedLogProbFunction,
               skipped without trl) + AdamW(fused=True), and torch_fused's fused head +
               aggregate_loss + SinkGD; step time, tokens/s and peak memory at one micro-batch,
               then the largest micro-batch each path fits (eager) and tokens/s there; PASS/FAIL
               against its targets. About 5 minutes on an H200, compilation included
  distill      the distillation heads, forward+backward (linear_distill reduced and per-token, a
               top-k teacher at k 1 / 20 / 100) against the four bare GEMMs of the same run (the
               student's three for a top-k teacher), TRL's ChunkedDivergenceFunction, Liger's
               LigerFusedLinearJSD (skipped without liger_kernel) and the materialized formula, at
               N 8192 / 16384 / 32768 with V 151936 / 128256 / 32000, student hidden 2048, teacher
               4096 and 2048, bf16: time, multiple of the GEMMs, peak extra memory, error against
               float64; PASS/FAIL against its targets
  distill_step one distillation training step: a student of Llama-3.2-1B's shape against a frozen
               teacher of Llama-3.2-3B's shape, sequences of 4096, random weights, AdamW(fused):
               the materialized loss, TRL's _chunked_divergence_loss (DistillationTrainer's) and
               linear_distill; step time, tokens/s and peak memory at micro-batch 2, then the
               largest micro-batch each fits and tokens/s there
  step_8b      (not run by default) the step suite at Llama-3-8B's shape (32 layers, hidden 4096,
               vocab 128256, bf16, activation checkpointing per block), eager, SinkGD with
               stochastic rounding on the torch_fused path: memory held between steps
               (parameters + optimizer state), peak, the largest micro-batch and tokens/s there
  train        training quality (not run by default): a byte-level LLaMA-style LM on the
               standard library's sources, AdamW against SinkGD (plain and spectral) at equal
               tokens, lr swept per optimizer and width; best validation loss and lr, tokens
               to AdamW's final loss, hidden-state RMS, optimizer step time and state
               (python -m torch_fused.bench.train runs it on any device; --quick on a CPU;
               python -m torch_fused.bench.seed_compare trains our SinkGD beside axolotl's)

Results go to <out>/<suite>.json, <suite>.md and <suite>.png (the plot needs matplotlib:
pip install -e '.[bench]').

Run the CUDA tests first and benchmark only when they pass; benchmarks/device_run.sh does both."""

EPILOG = """\
examples:
  python -m torch_fused.bench                                  every suite but train, results in a new folder
  python -m torch_fused.bench --only mask_reduce --out /tmp/r  one suite, results in /tmp/r
  python -m torch_fused.bench step                             one suite, named as an argument
  python -m torch_fused.bench step --quick                     2 layers, S 2048, eager only: about a minute
  python -m torch_fused.bench distill distill_step             the distillation suites
  python -m torch_fused.bench --quick                          a fast smoke run over fewer shapes
  python -m torch_fused.bench --sweep --only logprobs          block-size sweep of the log-prob kernels
  bash benchmarks/device_run.sh                                CUDA tests, then every suite

multi-GPU (one process per device; NCCL, or gloo with --device cpu):
  torchrun --nproc-per-node 2 -m torch_fused.bench --distributed [--quick] [--out DIR]
                       the vocab-parallel ops and SinkGD under FSDP2 on two ranks against one device,
                       with correctness checks (torch_fused/bench/distributed.py; --help there)

environment:
  TORCH_FUSED_BENCH_SINKGD_COMPILE=0  skip the torch.compile'd SinkGD loop baseline of the sinkgd suite
                       (its compilation takes minutes)"""


def _suites(only: str | None, positional: list[str]) -> list[str]:
    if only is not None and positional:
        raise SystemExit(f"suites: name them as arguments or with --only, not both (got {positional} and "
                         f"--only {only})")
    names = [s for s in only.split(",") if s] if only is not None else list(positional) or list(DEFAULT_SUITES)
    where = "--only" if only is not None else "suites"
    for s in names:
        if s not in SUITES:
            raise SystemExit(f"{where}: unknown suite {s!r}; choose from {', '.join(SUITES)}")
    return names


def main(argv: list[str] | None = None) -> None:
    import sys

    args_in = sys.argv[1:] if argv is None else list(argv)
    if "--distributed" in args_in:  # torchrun ... -m torch_fused.bench --distributed [its options]
        from .distributed import run_and_exit

        run_and_exit([a for a in args_in if a != "--distributed"])
    ap = argparse.ArgumentParser(
        prog="python -m torch_fused.bench",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "suites", nargs="*", metavar="SUITE",
        help=f"suites to run, in this order (default: all of {' '.join(DEFAULT_SUITES)}); the same as --only")
    ap.add_argument(
        "--only", default=None, metavar="SUITES",
        help=f"comma-separated suites to run, in this order (default: all of {','.join(DEFAULT_SUITES)})")
    ap.add_argument(
        "--out", default=None, metavar="DIR",
        help="folder for the result files, created if missing (default: a new folder "
             "torch_fused_bench_<date>_<time> in the working directory, so that no earlier results are "
             "overwritten; benchmarks/results holds the committed ones)")
    ap.add_argument(
        "--quick", action="store_true",
        help="fewer shapes: the first shape of logprobs and mask_reduce, sinkgd without its "
             "4-layer case, step with 2 layers at S 2048, eager only, distill at its first shape with "
             "the wider teacher, distill_step with 4 layers per model at S 2048; a fast smoke run, not "
             "the published figures")
    ap.add_argument(
        "--sweep", action="store_true",
        help="instead of the benchmark tables, time each kernel configuration (block size, warps) "
             "of the selected suites that offer a sweep (logprobs, lm_head, mask_reduce) and write <out>/sweep_<suite>.json; "
             "suites without a sweep are skipped")
    ap.add_argument(
        "--sweep-shape", default=None, metavar="INTS",
        help="comma-separated input shape of the sweep; for logprobs B,L,V (default: 4,4096,151936)")
    ap.add_argument(
        "--distributed", action="store_true",
        help="instead of the suites, the multi-GPU benchmark: run under torchrun, one process per device "
             "(torchrun --nproc-per-node 2 -m torch_fused.bench --distributed [--quick] [--out DIR]; NCCL, or "
             "gloo with --device cpu): the vocab-parallel ops and SinkGD under FSDP2 against one device, with "
             "correctness checks; its own options: --distributed --help")
    args = ap.parse_args(argv)
    suites = _suites(args.only, args.suites)
    if not torch.cuda.is_available():
        raise SystemExit("python -m torch_fused.bench needs a CUDA device (none is visible to torch)")
    out = Path(args.out if args.out is not None else time.strftime("torch_fused_bench_%Y%m%d_%H%M%S"))
    print(f"results: {out.resolve()}", flush=True)
    copy = common.copy_bandwidth_gbps()
    print(f"copy bandwidth (read+write): {copy:.0f} GB/s", flush=True)
    for suite in suites:
        mod = importlib.import_module(f".{suite}", __package__)
        if args.sweep:
            sweep = getattr(mod, "sweep", None)
            if sweep is None:
                print(f"{suite}: no sweep offered, skipped", flush=True)
                continue
            shape = None if args.sweep_shape is None else tuple(int(t) for t in args.sweep_shape.split(","))
            res = sweep(copy, shape)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"sweep_{suite}.json").write_text(json.dumps(res, indent=1))
            continue
        report = common.new_report()
        report.copy_gbps = copy
        mod.run(report, copy, quick=args.quick)
        # a suite whose results are not rows of memory-floor fractions (step) writes its own files
        getattr(mod, "save", common.save)(report, out, suite)
        print(getattr(mod, "markdown", common.markdown)(report), flush=True)
    print(f"results written to {out.resolve()}", flush=True)


if __name__ == "__main__":
    main()
