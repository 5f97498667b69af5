"""Hopper (sm90) body of the fused KDA decode step: the state tile lives in registers in the WGMMA
accumulator layout, so the two key-row reductions are in-thread adds, 3 shuffle rounds and one SMEM pass."""

from pallas_kernels.kda_decode import bodies

ARCH = "sm90"
TUNING = bodies.load_tuning(ARCH)  # the default policy's entry (tests and benchmarks launch by it)
kda_decode, kda_decode_gates, kda_decode_x, kda_verify, kda_commit = bodies.entry_points(TUNING)


def ops(policy) -> bodies.Ops:
    """The ops launched by the policy's kda_decode tuning for this arch (and its gemv tuning)."""
    return bodies.entry_points(policy.table("kda_decode")[ARCH], policy)
