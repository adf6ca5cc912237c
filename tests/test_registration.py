"""The ops register on every torch the package supports (torch >= 2.6, pyproject.toml).

torch.library.custom_op infers an op's schema from its function's annotations, and torch 2.6's
inference accepts ``typing.List[...]`` but not the builtin generic ``list[...]``: one such
annotation and ``import torch_fused`` fails there. CI installs the newest torch, which accepts
both, so this test reads the annotations instead of relying on the torch it runs on."""

from __future__ import annotations

import inspect
import re
import sys

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
