"""Integrations of torch_fused into training libraries.

Each integration is a submodule that imports its library only when used:

- :mod:`torch_fused.integrations.trl`: ``patch()`` / ``unpatch()`` route TRL's log-prob and
  entropy functions, its chunked lm_head and its distillation divergence (``DistillationTrainer``,
  ``GKDTrainer``) to the fused ops.
"""
