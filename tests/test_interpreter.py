"""Run the whole CPU suite a second time with TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. at import, so the
interpreter run needs a fresh process. In it, torch_fused registers its Triton implementations
for CPU tensors too: every op test (forward, backward, opcheck, torch.compile) then drives the
real kernels instead of the plain-PyTorch reference. Shapes are small there (tests/conftest.py
shrinks the tiles so that small shapes still reach every kernel branch).

The child process starts when the pytest session starts (tests/conftest.py), so that on a machine with
two cores it runs beside the plain CPU suite; this test waits for it and streams its progress.
"""

import sys

import pytest

from torch_fused._library import HAS_TRITON, INTERPRET


@pytest.mark.skipif(INTERPRET, reason="this is the launcher of the interpreter run")
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_suite_under_triton_interpreter(request):
    import conftest

    proc = conftest.interpreter_run(request.config)
    out = []
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        sys.stdout.write("\n\n==== interpreter run (TRITON_INTERPRET=1): the same tests through the real Triton "
                         "kernels, a second pytest process; its own summary follows ====\n")
        for line in proc.stdout:
            out.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()
    proc.wait(timeout=60)
    tail = "".join(out)[-6000:]
    assert proc.returncode == 0, f"interpreter run failed:\n{tail}"
    assert " passed" in tail, tail
