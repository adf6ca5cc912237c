"""Run the whole CPU suite a second time with TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. at import, so the
interpreter run needs a fresh process. In it, torch_fused registers its Triton implementations
for CPU tensors too: every op test (forward, backward, opcheck, torch.compile) then drives the
real kernels instead of the plain-PyTorch reference. Shapes are small there (tests/conftest.py
shrinks the tiles so that small shapes still reach every kernel branch).

The child process starts when the pytest session starts (tests/conftest.py), so that on a machine with
two cores it runs beside the plain CPU suite; this test, which the collection puts last (so that
every other plain test runs beside it, none after it), waits for it, and its report (progress
and summary) is printed once, as a section of this run's summary, not inside this run's
progress line.
"""

import os

import pytest

from torch_fused._library import HAS_TRITON, INTERPRET


@pytest.mark.skipif(INTERPRET, reason="this is the launcher of the interpreter run")
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_suite_under_triton_interpreter(request):
    import conftest

    proc = conftest.interpreter_run(request.config)
    out = list(proc.stdout)  # its report is printed once, in this run's summary (conftest)
    proc.wait(timeout=60)
    conftest.interpreter_report(out)
    tail = "".join(out)[-6000:]
    assert proc.returncode == 0, f"interpreter run failed:\n{tail}"
    assert " passed" in tail, tail


@pytest.mark.skipif(INTERPRET, reason="compiles the interpreter run's launches in a process without it")
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_interpreter_runs_launches_compile_for_sm90(request):
    """Every distinct kernel launch the interpreter run made (its argument types, constexprs, the
    pointers it passed as None, warps; tests/_launch_recorder.py) compiles for sm_90, as the same
    launch would on a GPU: the interpreter runs kernels as Python and passes code that does not
    compile for the arguments the launchers really pass."""
    import conftest
    from _launch_recorder import compile_records, gpu_variants, load_records
    from test_kernels_compile import _kernel_modules, _launched_kernels

    proc = conftest.interpreter_run(request.config)
    if proc.poll() is None:  # (selected without the run's own test: wait for the run here)
        for _ in proc.stdout:
            pass
        proc.wait()
    path = conftest._INTERPRETER["launches"]
    assert os.path.exists(path), f"the interpreter run recorded no launches (exit status {proc.returncode})"
    records, dropped = load_records(path)
    assert not dropped, "launches the recorder could not record:\n" + "\n".join(dropped[:10])
    seen = {(r["module"], r["name"]) for r in records}
    kernels = {(m.__name__, n) for m in _kernel_modules() for n in _launched_kernels(m) if "tma" not in n}
    assert not kernels - seen, f"kernels the interpreter run never launched: {sorted(kernels - seen)}"
    jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    variants = gpu_variants(records)
    failed = compile_records(variants, jobs=jobs)
    assert not failed, (f"{len(failed)} of {len(variants)} launches do not compile for sm_90:\n"
                        + "\n".join(failed[:10]))
