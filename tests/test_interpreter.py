"""Run the whole CPU suite a second time with TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. at import, so the
interpreter run needs a fresh process. In it, torch_fused registers its Triton implementations
for CPU tensors too: every op test (forward, backward, opcheck, torch.compile) then drives the
real kernels instead of the plain-PyTorch reference.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torch_fused._library import HAS_TRITON, INTERPRET


@pytest.mark.skipif(INTERPRET, reason="this is the launcher of the interpreter run")
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_suite_under_triton_interpreter(tmp_path):
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda",
         "--deselect", "tests/test_interpreter.py", "tests"],
        cwd=root, env=env, capture_output=True, text=True, timeout=1800,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter run failed:\n{tail}"
    assert " passed" in proc.stdout, tail
