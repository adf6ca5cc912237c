"""Importing torch_fused with an older torch than it supports gives its version warning, not a
schema error from torch.

torch.library.custom_op infers an op's schema from its function's annotations, and torch 2.6's
inference accepts ``typing.List[...]`` but not the builtin generic ``list[...]``: one such
annotation and ``import torch_fused`` fails there before the warning is seen. CI installs the
newest torch, which accepts both, so this test reads the annotations instead of relying on the
torch it runs on."""

from __future__ import annotations

import inspect
import re
import sys

import pytest

from torch._library.custom_ops import CustomOpDef

import torch_fused  # noqa: F401  (imports every module that defines an op)

_BUILTIN_GENERIC = re.compile(r"\b(list|tuple|dict|set)\[")


def _custom_op_functions():
    found = {}
    for name, mod in list(sys.modules.items()):
        if name.startswith("torch_fused") and mod is not None:
            for value in vars(mod).values():
                if isinstance(value, CustomOpDef):
                    found[value._qualname] = value._init_fn
    return found


def test_every_custom_op_schema_is_inferred_from_annotations_torch_2_6_reads():
    functions = _custom_op_functions()
    assert len(functions) >= 7, f"found only {sorted(functions)}"
    bad = []
    for qualname, fn in functions.items():
        for p in inspect.signature(fn).parameters.values():
            annotation = p.annotation if isinstance(p.annotation, str) else repr(p.annotation)
            if _BUILTIN_GENERIC.search(annotation):
                bad.append(f"{qualname}({p.name}: {annotation})")
    assert not bad, "use typing.List / typing.Tuple (torch 2.6 cannot infer a schema from these): " + ", ".join(bad)


@pytest.mark.parametrize("version, warns", [("2.6.0+cu124", True), ("2.7.1", True), ("2.9.1", True), ("2.10.0", False),
                                            ("2.11.0+cu130", False), ("2.14.1", False), ("2.12.0a0+git1234", False),
                                            ("local.build", False)])
def test_an_older_torch_gets_the_version_warning(version, warns):
    message = torch_fused._torch_version_warning(version)
    assert (message is not None) == warns
    if warns:
        assert version in message and "2.10" in message
