import contextlib
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

import torch_fused  # noqa: F401  (registers the ops)
from torch_fused import _library
from torch_fused.settings import override

INTERPRET = _library.INTERPRET
HAS_CUDA = torch.cuda.is_available()

# Bounded example counts keep the CPU job within minutes; the interpreter runs the real kernels
# one program at a time in Python, so it gets fewer (and smaller) examples.
settings.register_profile(
    "ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile(
    "interpret", max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("cuda", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "interpret" if INTERPRET else "ci"))

# numpy warns about inf * 0 in lanes the interpreter computes and then masks off
warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")


# The interpreter run: every kernel takes its smallest tiles (settings.small_tiles), so that small
# shapes still cover every path of the kernels (several unmasked full blocks with the prefetch
# loop, then a masked tail; several programs and trips per matrix); backward rows wider than 48
# columns split into segments of 48 (three 16-column blocks), the last one ragged, so the
# segmented launch runs in every backward test past that width.
# The sampler's threshold kernels are a setting (on by default on CUDA): the interpreter run and
# the CUDA tests drive them whatever the environment says.
_RUN_SETTINGS = (dict(logprobs_bwd_segment=48, small_tiles=True, sampler_kernels=True) if INTERPRET
                 else dict(sampler_kernels=True) if HAS_CUDA else {})


@pytest.fixture(autouse=True)
def _poison_outputs():
    """Fill every fresh op output with NaN before the kernel writes it (FLA's trick); and the
    interpreter run's settings."""
    with override(poison=True, **_RUN_SETTINGS):
        yield


@pytest.fixture
def settings_override():
    """``settings_override(name=value, ...)``: torch_fused settings for the rest of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(override(**values))


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
    # The test that waits for the interpreter run goes last: every other test of this run then
    # runs beside the interpreter run instead of after it (in file order it would wait before
    # most of them).
    items.sort(key=lambda item: ("test_suite_under_triton_interpreter" in item.nodeid)
               + 2 * ("test_interpreter_runs_launches_compile" in item.nodeid))  # that one after it


# The interpreter run (tests/test_interpreter.py) is a second pytest process. It starts with the
# pytest session, so that it runs beside this one, and the test that owns it waits for it.
_INTERPRETER = {}


def interpreter_run(config):
    """The interpreter run's process (started if it is not running yet); stdout is a text pipe."""
    if "proc" not in _INTERPRETER:
        root = Path(__file__).resolve().parent.parent
        cache = tempfile.mkdtemp(prefix="torch_fused_interp_")
        launches = os.path.join(cache, "launches.json")  # its kernel launches (tests/_launch_recorder.py)
        _INTERPRETER["launches"] = launches
        env = dict(os.environ, TRITON_INTERPRET="1", TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   PYTHONUNBUFFERED="1", TORCH_FUSED_LAUNCH_RECORD=launches,
                   PYTHONPATH=os.pathsep.join([str(root / "tests"), os.environ.get("PYTHONPATH", "")]))
        _INTERPRETER["proc"] = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_launch_recorder",
             "-m", "not cuda", "--deselect", "tests/test_interpreter.py", "tests"],
            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        )
    return _INTERPRETER["proc"]


def pytest_collection_finish(session):
    if (not INTERPRET and _library.HAS_TRITON and not session.config.getoption("collectonly")
            and any("test_suite_under_triton_interpreter" in i.nodeid for i in session.items)):
        interpreter_run(session.config)


def pytest_unconfigure(config):
    proc = _INTERPRETER.pop("proc", None)
    if proc is not None and proc.poll() is None:
        proc.kill()


def interpreter_report(lines) -> None:
    """Keep the interpreter run's output for this run's summary."""
    _INTERPRETER["report"] = lines


def pytest_terminal_summary(terminalreporter):
    """The interpreter run's report as one section; skips summarized by cause (one line per
    reason, with its count), not one per test."""
    from collections import Counter

    report = _INTERPRETER.get("report")
    if report:
        terminalreporter.write_sep("=", "interpreter run (TRITON_INTERPRET=1): the same tests through the real "
                                        "Triton kernels, a second pytest process")
        for line in report:
            terminalreporter.write(line)

    reasons = Counter()
    for rep in terminalreporter.stats.get("skipped", []):
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("-", "skipped, by cause")
        for reason, n in reasons.most_common():
            terminalreporter.write_line(f"{n:5d}  {reason}")
