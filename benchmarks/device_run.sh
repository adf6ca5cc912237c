#!/usr/bin/env bash
# The CUDA tests, then (only if they all pass) python -m torch_fused.bench.
#
#   bash benchmarks/device_run.sh [bench options, e.g. --only mask_reduce --quick]
#
# Run from the repository root on a machine with a CUDA device. Results go to $OUT (default
# benchmarks/results): <suite>.json/.md/.png from the benchmark, and gpu.txt with the GPU,
# its driver, and the torch and triton versions. Settings, all optional:
#   TESTS=...          test paths to run first (default: tests)
#   TEST_TIMEOUT=900   seconds allowed for the tests (the whole -m cuda suite takes over 450 s on
#                      an H100 host)
#   NOBENCH=1          run the tests only
#   TORCH_FUSED_BENCH_SINKGD_COMPILE=0  skip the slow-to-compile torch.compile SinkGD baseline
#   SHARDED=1          then python -m torch_fused.bench.sinkgd_sharded --out $OUT (one rank's
#                      shard of four Llama-3-8B layers, both sharded paths, against the fused step)
# If a .whl/ folder of wheels is present (dependencies for a machine without network access),
# they are installed into /tmp/site first.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
TESTS=${TESTS:-tests}
HYPOTHESIS_PROFILE=cuda timeout "${TEST_TIMEOUT:-900}" python3 -m pytest -q -x -m cuda -p no:cacheprovider $TESTS 2>&1 | tail -40
rc=${PIPESTATUS[0]}
if [ "$rc" != "0" ]; then
  echo "CUDA tests failed (rc=$rc): no benchmark is reported"
  exit 1
fi
[ "${NOBENCH:-0}" = "1" ] && exit 0
# progress lines to the terminal; the tables themselves are in $OUT/<suite>.md
python3 -m torch_fused.bench --out "$OUT" "$@" 2>&1 | grep -vE "^\|"
rc=${PIPESTATUS[0]}
if [ "${SHARDED:-0}" = "1" ]; then
  python3 -m torch_fused.bench.sinkgd_sharded --out "$OUT" 2>&1 | tail -30
  [ "${PIPESTATUS[0]}" = "0" ] || rc=1
fi
exit "$rc"
