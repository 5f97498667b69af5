"""The MoE router's top-k (docs/model.md §6): api, XLA reference, Mosaic GPU kernel. The grouping by expert is
pallas_kernels/moe/grouping.py."""

from pallas_kernels.moe_route.api import route, route_gathered

__all__ = ["route", "route_gathered"]
