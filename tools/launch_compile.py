"""Compile for the Hopper target (sm_90), on this machine and without a GPU, every distinct kernel
launch that a test run under the Triton interpreter makes: each launch's own argument types,
constexpr values and warps, with the pointers it passes as None made constexpr None, as the
real launcher hands them to the compiler.

    python tools/launch_compile.py                          # the interpreter run's tests
    python tools/launch_compile.py tests/test_sampler_support.py -k top_k   # some of them

tests/test_kernels_compile.py compiles each module's ``compile_cases`` (the constexpr branches
its launchers take, written by hand). The interpreter runs the kernels as Python, so a kernel
that only compiles with a real pointer where its launcher passes None (a test on a local set
to a Python constant is a tensor to the compiler, not resolved at compile time) passes there and
fails on a GPU; this tool compiles what the launchers really pass. Step 1 runs pytest under
``TRITON_INTERPRET=1`` with a plugin that records each launch (tools/_launch_recorder.py);
step 2 compiles each distinct record. The exit status is the number of records that fail to
compile (0: all compile).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# constexprs whose value under the interpreter is not the GPU's: compiled at the GPU's value
GPU_VALUES = {"UPCAST": False}  # kernels/lm_head.py: the interpreter's dot has no bf16


def record(pytest_args, out):
    env = dict(os.environ, TRITON_INTERPRET="1", TORCH_FUSED_LAUNCH_RECORD=out,
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tools"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_launch_recorder", *pytest_args]
    return subprocess.run(cmd, cwd=os.path.join(ROOT, "tests"), env=env).returncode


def compile_records(records):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    failed = []
    for i, r in enumerate(records):
        fn = getattr(importlib.import_module(r["module"]), r["name"])
        cx = {k: GPU_VALUES.get(k, v) for k, v in r["constexprs"].items()}
        sig = dict(r["signature"], **{k: "constexpr" for k in cx})
        t0 = time.time()
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=target,
                           options={"num_warps": r["num_warps"]})
            status = "ok"
        except Exception as e:  # noqa: BLE001 - every compiler error is a finding
            status = "FAILED: " + " ".join(str(e).split())[:400]
            failed.append(r)
        nones = sorted(k for k, v in cx.items() if v is None)
        print(f"[{i + 1}/{len(records)}] {r['module'].rsplit('.', 1)[-1]}.{r['name']} warps={r['num_warps']} "
              f"None={nones} ({time.time() - t0:.1f} s): {status}", flush=True)
    return failed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    ap.add_argument("--records", default=None, help="compile this file's records (no test run)")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.records:
        path = a.records
    else:
        path = os.path.join(tempfile.mkdtemp(), "launches.json")
        args = a.pytest_args or ["."]
        rc = record(args, path)
        print(f"test run: exit status {rc}", flush=True)
    with open(path) as f:
        records = [r for r in json.load(f) if r["module"].startswith("torch_fused.")]  # not a test's own kernel
    print(f"{len(records)} distinct launches of the library's kernels (records: {path})", flush=True)
    failed = compile_records(records)
    print(f"{len(records) - len(failed)}/{len(records)} compile for sm_90", flush=True)
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
