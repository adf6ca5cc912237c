"""Integrations of torch_fused into training libraries.

Each integration is a submodule that imports its library only when used:

- :mod:`torch_fused.integrations.trl`: ``patch()`` / ``unpatch()`` route TRL's log-prob and
  entropy functions (and, opt-in, its chunked lm_head) to the fused ops.
"""
