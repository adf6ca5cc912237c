"""Optimizers built on torch_fused ops."""

from ..ops.sinkgd import SinkGDCache
from .sinkgd import SinkGD, sinkgd_param_groups, sinkgd_step

__all__ = ["SinkGD", "SinkGDCache", "sinkgd_param_groups", "sinkgd_step"]
