"""Blackwell (sm100) body of the fused KDA decode step. No MMA pays here (two GEMVs in fp32), so it is
the sm90 algorithm with the tile in the TCGEN05 register layout (a warp owns 32 rows instead of 16; not yet
measured on Blackwell) and its own tuning entry."""

import json
import pathlib

from pallas_kernels.kda_decode import kernel

TUNING = json.loads((pathlib.Path(__file__).parent / "tuning.json").read_text())["sm100"]


def kda_decode(qkv_B3HK, f_BHK, beta_BH, gate_BHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H, dt_bias_HK,
               o_norm_w_K, *, eps=1e-5, interpret=None):
    kernel.check_supported(qkv_B3HK, state_BHKV, conv_B3WHK)
    return kernel.decode(qkv_B3HK, f_BHK, beta_BH, gate_BHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H,
                         dt_bias_HK, o_norm_w_K, eps=eps, interpret=interpret,
                         **kernel.pick_launch(TUNING, qkv_B3HK))
