"""Latency-specialized all-reduce for decode (Pallas Mosaic GPU, no multicast) with an XLA fallback."""

from pallas_kernels.collectives.api import (
    all_reduce,
    all_reduce_add_rmsnorm,
    plan_add_rmsnorm,
    plan_all_reduce,
)

__all__ = ["all_reduce", "all_reduce_add_rmsnorm", "plan_add_rmsnorm", "plan_all_reduce"]
