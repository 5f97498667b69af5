"""Fused KDA decode step (docs/model.md §4.2-4.6): api, XLA reference, Hopper (sm90) and Blackwell (sm100) bodies."""

from pallas_kernels.kda_decode.api import kda_commit, kda_decode, kda_verify

__all__ = ["kda_commit", "kda_decode", "kda_verify"]
