"""The mutation check's anchors (tools/mutation_check.py, tools/README.md).

Each mutant there is a known bug written as exact text replacements in one source file. The
tool runs outside CI, so a change that edits a mutant's line would otherwise stop it silently
until someone runs it. Here, in the normal test suite, every mutant must still apply to the
checkout: each of its ``old`` texts occurs exactly once in its file (in order, as the tool
applies them), and the tests it names still exist. Nothing is run; the tool is only imported.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "mutation_check.py"

# the tool's copies of the sources hold torch_fused/ and tests/ only
pytestmark = pytest.mark.skipif(not TOOL.is_file(), reason="tools/mutation_check.py is not in this tree")


def _load_tool():
    if not TOOL.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_mutation_check", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


mc = _load_tool()
MUTANTS = mc.MUTANTS if mc is not None else []

UPDATE = ("Update the mutant in tools/mutation_check.py in the same change: point its old text at the line "
          "that now holds the code its bug breaks (the bug is described in tools/README.md and in the comment "
          "above the mutant), so that it injects the same bug; or, if that bug can no longer occur, delete the "
          "mutant and say why in tools/README.md. Then run it: python tools/mutation_check.py --worktree --only NAME")


def test_the_mutants_have_distinct_names():
    names = [m.name for m in MUTANTS]
    assert names, "no mutants found in tools/mutation_check.py"
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


def test_every_mutant_applies_to_the_checkout():
    """Every ``old`` text of every mutant occurs exactly once in its file (the tool's own rule,
    replacements applied in order), and each mutant changes its file. One test for all of them
    (each named in the message), so that the check costs a few milliseconds."""
    stale = []
    for m in MUTANTS:
        try:
            mutated = mc.mutant_source(ROOT, m)
        except mc.StaleMutant as e:
            stale.append(f"[bug {m.bug}] {e}")
            continue
        if mutated == (ROOT / m.file).read_text():
            stale.append(f"mutant {m.name!r} (bug {m.bug}) changes nothing in {m.file}")
    if stale:
        pytest.fail("\n\n".join(stale) + f"\n\n{UPDATE}", pytrace=False)


_DEF = "(?:def|class) {}\\b"


def test_every_mutant_runs_tests_that_exist():
    """The test files (and test functions) each mutant runs are still there: a renamed test would
    leave the mutant's run collecting nothing."""
    missing = []
    for m in MUTANTS:
        for node in m.tests:
            path, *names = node.split("::")
            f = ROOT / path
            if not f.is_file():
                missing.append(f"mutant {m.name!r} runs {node}, but {path} does not exist")
                continue
            text = f.read_text()
            missing += [f"mutant {m.name!r} runs {node}, but {path} defines no {name}"
                        for name in (n.split("[", 1)[0] for n in names)
                        if not re.search(_DEF.format(re.escape(name)), text)]
    if missing:
        pytest.fail("\n".join(missing) + f"\n\n{UPDATE}", pytrace=False)
