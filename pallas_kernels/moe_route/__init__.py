"""The MoE router's top-k and the token-by-expert grouping (K3_SPEC §6): api, XLA reference, Mosaic GPU kernel."""

from pallas_kernels.moe_route.api import ExpertGroups, group_by_expert, route

__all__ = ["ExpertGroups", "group_by_expert", "route"]
