#!/usr/bin/env bash
# The CUDA checks of the paths whose defaults wait for a GPU measurement (docs/MAINTAINERS.md,
# "Settings"): their CUDA tests with the settings on, then the benchmarks that decide the
# defaults and hold the figures BENCHMARKS.md lacks. Run from the repository root on a CUDA
# machine with the peers installed (pip install -e '.[test,trl]' liger-kernel); every step has
# its own time limit, writes its log under OUT (default ./gpu_checks_<date>), and a failing or
# timed-out step does not stop the next. Usage: bash tools/gpu_checks.sh [OUT]; STEPS="name ..."
# runs only the steps named (e.g. STEPS="sampler_first head_support" for a short run).
set -u
OUT=${1:-gpu_checks_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step() {
    local name=$1 limit=$2; shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - start)) s (log: $OUT/logs/$name.log)"
    grep -E "FAILED|ERROR| passed| failed" "$OUT/logs/$name.log" | grep -vE "^(DEBUG|INFO)" | tail -12
}
# 0. the sampler's filter kernel (two streaming passes), the listed forward and the fused head's
#    ids beside its epilogues (lm_head_epilogue_ids), not yet run on a GPU: their CUDA tests at the
#    defaults, the filter's launch configurations, the logits ops' timings (distill_quick below
#    times the top-k teacher with its ids beside the GEMMs and inside the epilogues)
step sampler_first 600 bash -c "python -m pytest -q -m cuda -p no:cacheprovider -rf tests/test_sampler_support.py \
    tests/test_logprobs_cuda.py tests/test_linear_logprobs.py tests/test_distill.py && \
    python tools/sampler_sweep.py --out '$OUT' && python tools/sampler_routes.py"
# 1. the new GPU paths' tests, with batch invariance and promotion on (the sampler kernels are on
#    by default)
TORCH_FUSED_BATCH_INVARIANT=1 TORCH_FUSED_LM_HEAD_PROMOTE=1 step tests_settings_on 900 \
    python -m pytest -v -m cuda -p no:cacheprovider -rf tests/test_sampler_support.py \
    tests/test_batch_invariance.py tests/test_linear_logprobs.py tests/test_distill.py tests/test_distill_parallel.py \
    tests/test_trl_distill.py tests/test_packed.py
# 2. the benchmarks: the settings' cost and errors, the sampler's support, the distillation heads
#    and step; first the two quick ones that time the latest untimed changes (the head's support
#    list from the threshold kernels; the top-k teacher's epilogues looping over the ids)
step head_support 600 python tools/sampler_routes.py --head-only --profile
step distill_quick 600 python -m torch_fused.bench --only distill --quick --out "$OUT/bench_quick"
step bench_agreement 900 python -m torch_fused.bench --only agreement --out "$OUT/bench"
step bench_sampler 600 python -m torch_fused.bench --only sampler --out "$OUT/bench"
step sampler_routes 600 python tools/sampler_routes.py --profile
step distill_chunks 600 python tools/distill_chunks.py --profile
step bench_distill 1200 python -m torch_fused.bench --only distill --out "$OUT/bench"
step bench_distill_step 1200 python -m torch_fused.bench --only distill_step --out "$OUT/bench"
# 3. the whole CUDA suite at the defaults
step tests_cuda 1800 python -m pytest -q -m cuda -p no:cacheprovider -rf tests
