"""Optimizers built on torch_fused ops."""

from .sinkgd import SinkGD, sinkgd_param_groups

__all__ = ["SinkGD", "sinkgd_param_groups"]
