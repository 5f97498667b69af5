"""Blackwell (sm100) body of the fused KDA decode step. No MMA pays here (two GEMVs in fp32), so it is
the sm90 algorithm with the tile in the TCGEN05 register layout (a warp owns 32 rows instead of 16; not yet
measured on Blackwell) and its own tuning entry."""

from pallas_kernels.kda_decode import bodies

ARCH = "sm100"
TUNING = bodies.load_tuning(ARCH)  # the default policy's entry (tests and benchmarks launch by it)
kda_decode, kda_decode_gates, kda_decode_x, kda_verify, kda_commit = bodies.entry_points(TUNING)


def ops(policy) -> bodies.Ops:
    """The ops launched by the policy's kda_decode tuning for this arch (and its gemv tuning)."""
    return bodies.entry_points(policy.table("kda_decode")[ARCH], policy)
