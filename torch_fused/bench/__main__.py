"""python -m torch_fused.bench [--only logprobs,mask_reduce,sinkgd] [--sweep] [--quick] [--out DIR]

Writes <out>/<suite>.json, .md and .png per suite. Refuses to report while the CUDA tests
are red: run `pytest -m cuda` first (the device script does).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from . import common

SUITES = ("logprobs", "mask_reduce", "sinkgd")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m torch_fused.bench")
    ap.add_argument("--only", default=",".join(SUITES))
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sweep", action="store_true", help="block-size sweep of the log-prob kernels")
    ap.add_argument("--sweep-shape", default="4,4096,151936", help="B,L,V of the sweep")
    ap.add_argument("--quick", action="store_true", help="first shape of each suite only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torch_fused.bench needs a CUDA device")
    out = Path(args.out)
    copy = common.copy_bandwidth_gbps()
    print(f"copy bandwidth (read+write): {copy:.0f} GB/s", flush=True)
    if args.sweep:
        from . import logprobs

        b, l, v = (int(t) for t in args.sweep_shape.split(","))
        res = logprobs.sweep(copy, b, l, v)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"sweep_logprobs_V{v}.json").write_text(
            json.dumps(dict(copy_gbps=copy, shape=[b, l, v], results=res), indent=1))
    for suite in [s for s in args.only.split(",") if s]:
        if suite not in SUITES:
            raise SystemExit(f"--only: unknown suite {suite!r}; choose from {SUITES}")
        import importlib

        mod = importlib.import_module(f".{suite}", __package__)
        report = common.new_report()
        report.copy_gbps = copy
        mod.run(report, copy, quick=args.quick)
        common.save(report, out, suite)
        print(common.markdown(report), flush=True)


if __name__ == "__main__":
    main()
