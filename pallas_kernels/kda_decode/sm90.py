"""Hopper (sm90) body of the fused KDA decode step: the state tile lives in registers in the WGMMA
accumulator layout, so the two key-row reductions are in-thread adds, 3 shuffle rounds and one SMEM pass."""

from pallas_kernels.kda_decode import bodies

TUNING = bodies.load_tuning("sm90")
kda_decode, kda_decode_gates, kda_decode_x, kda_verify, kda_commit = bodies.entry_points(TUNING)
