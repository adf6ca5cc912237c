"""``python -m torch_fused.bench``: benchmarks against same-run baselines (CUDA only)."""
