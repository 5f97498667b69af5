"""The MoE router's top-k and the token-by-expert grouping (docs/model.md §6): api, XLA reference, Mosaic GPU kernel."""

from pallas_kernels.moe_route.api import ExpertGroups, group_by_expert, route

__all__ = ["ExpertGroups", "group_by_expert", "route"]
