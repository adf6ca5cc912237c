"""Without TRL installed, its integration names the install command instead of a bare
ModuleNotFoundError (simulated here: ``sys.modules["trl"] = None`` makes ``import trl`` fail)."""

from __future__ import annotations

import sys

import pytest


def test_patch_without_trl_names_the_install_command(monkeypatch):
    from torch_fused.integrations import trl as tf_trl

    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.setattr(tf_trl, "_STATE", None)
    with pytest.raises(ImportError, match=r"needs TRL: pip install 'trl' .*pip install -e '\.\[trl\]'"):
        tf_trl.patch()
