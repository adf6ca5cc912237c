"""Compile for the Hopper target (sm_90), on this machine and without a GPU, every distinct kernel
launch that a test run under the Triton interpreter makes: each launch's own argument types,
constexpr values and warps, with the pointers it passes as None made constexpr None, as the
real launcher hands them to the compiler.

    python tools/launch_compile.py                          # the interpreter run's tests
    python tools/launch_compile.py test_sampler_support.py -k top_k   # some of them (from tests/)
    python tools/launch_compile.py --records FILE           # a recorded run's launches

The test suite's interpreter run does the same for its own launches (tests/test_interpreter.py,
with tests/_launch_recorder.py); this tool runs it for a chosen subset and prints each launch.
The exit status is the number of launches that fail to compile (0: all compile).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import _launch_recorder as recorder  # noqa: E402


def record(pytest_args, out):
    env = dict(os.environ, TRITON_INTERPRET="1", TORCH_FUSED_LAUNCH_RECORD=out,
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_launch_recorder", "-m", "not cuda",
           *pytest_args]
    return subprocess.run(cmd, cwd=os.path.join(ROOT, "tests"), env=env).returncode


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", default=None, help="compile this file's records (no test run)")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("tools/launch_compile.py compiles the kernels: run it without TRITON_INTERPRET=1 (it "
                         "starts the interpreter run itself)")
    if a.records:
        path = a.records
    else:
        path = os.path.join(tempfile.mkdtemp(), "launches.json")
        rc = record([x for x in a.pytest_args if x != "--"] or ["."], path)
        print(f"test run: exit status {rc}", flush=True)
    records, dropped = recorder.load_records(path)
    for d in dropped:
        print(f"not recorded: {d}", flush=True)
    records = recorder.gpu_variants(records)
    print(f"{len(records)} distinct launches of the library's kernels, EXACT_SHIFT both ways where they have it "
          f"(records: {path})", flush=True)

    def progress(i, r, failure):
        print(f"[{i + 1}/{len(records)}] {r['module'].rsplit('.', 1)[-1]}.{r['name']} warps={r['num_warps']} "
              f"None={sorted(k for k, v in r['constexprs'].items() if v is None)}: "
              f"{'ok' if failure is None else 'FAILED: ' + failure}", flush=True)

    failed = recorder.compile_records(records, progress=progress)
    print(f"{len(records) - len(failed)}/{len(records)} compile for sm_90", flush=True)
    return min(len(failed) + len(dropped), 255)


if __name__ == "__main__":
    sys.exit(main())
