"""``torchrun --nproc-per-node 2 -m torch_fused.bench --distributed``: the two-rank checks and
timings run end to end (gloo on CPU at --quick sizes; NCCL on two GPUs where a machine has them),
every check passing: the vocab-parallel ops and SinkGD under FSDP2 against one device."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from torch_fused._library import INTERPRET

pytestmark = [pytest.mark.skipif(INTERPRET, reason="the plain run covers it (a subprocess of its own)"),
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                 reason="needs torch.distributed with the gloo backend")]


def _run(tmp_path, device):
    torchrun = shutil.which("torchrun") or None
    cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--standalone", "--nproc-per-node", "2", "-m", "torch_fused.bench", "--distributed", "--quick",
        "--device", device, "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for attempt in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        # a second attempt only where the launch itself failed (no results written: a process group
        # that could not form); a failed check writes its results and is never retried
        if proc.returncode == 0 or (tmp_path / "distributed.json").exists():
            break
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "distributed.json").read_text())
    cases = [r["case"] for r in res["results"]]
    assert cases == ["vocab-parallel logits", "vocab-parallel fused head", "SinkGD FSDP2, plain",
                     "SinkGD FSDP2, stochastic rounding", "SinkGD FSDP2, spectral"], cases
    for r in res["results"]:
        assert r["ok"], r
        # the vocabulary-parallel rows: one all-gather forward (and the head's one all-reduce of d
        # hidden backward); a SinkGD step: at least one all-reduce of its row and column sums
        want = {"vocab-parallel logits": 1, "vocab-parallel fused head": 2}.get(r["case"])
        if want is None:
            assert r["collectives"] >= 1, r
        else:
            assert r["collectives"] == want, r
    return res


def test_two_ranks_on_cpu(tmp_path):
    res = _run(tmp_path, "cpu")
    assert res["meta"]["backend"] == "gloo"


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_nccl(tmp_path):
    res = _run(tmp_path, "cuda")
    assert res["meta"]["backend"] == "nccl"


def test_bench_help_lists_the_distributed_option(capsys):
    """``python -m torch_fused.bench --help`` names --distributed among its options, not only in an example."""
    from torch_fused.bench.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    options = capsys.readouterr().out.split("\noptions:\n", 1)[1].split("\nexamples:\n", 1)[0]
    assert "\n  --distributed " in options, options
