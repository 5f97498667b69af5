"""Hopper (sm90) body of the fused KDA decode step: the state tile lives in registers in the WGMMA
accumulator layout, so the two key-row reductions are in-thread adds, 3 shuffle rounds and one SMEM pass."""

import json
import pathlib

from pallas_kernels.kda_decode import kernel

TUNING = json.loads((pathlib.Path(__file__).parent / "tuning.json").read_text())["sm90"]


def kda_decode(qkv_B3HK, f_BHK, beta_BH, gate_BHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H, dt_bias_HK,
               o_norm_w_K, *, eps=1e-5, interpret=None):
    kernel.check_supported(qkv_B3HK, state_BHKV, conv_B3WHK)
    return kernel.decode(qkv_B3HK, f_BHK, beta_BH, gate_BHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H,
                         dt_bias_HK, o_norm_w_K, eps=eps, interpret=interpret,
                         **kernel.pick_launch(TUNING, qkv_B3HK))
