#!/usr/bin/env bash
# One device call: the CUDA tests, then (only if they pass) the benchmarks; everything lands
# in $OUT. Used as:  run(command="bash benchmarks/device_run.sh [bench args]", carry=[".whl"])
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
TESTS=${TESTS:-tests}
HYPOTHESIS_PROFILE=cuda timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -m cuda -p no:cacheprovider $TESTS 2>&1 | tail -40 | tee "$OUT/tests.log"
rc=${PIPESTATUS[0]}
if [ "$rc" != "0" ]; then
  echo "CUDA tests failed (rc=$rc): no benchmark is reported"
  exit 1
fi
[ "${NOBENCH:-0}" = "1" ] && exit 0
python3 -m torch_fused.bench --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -vE "^\|" | tail -80
