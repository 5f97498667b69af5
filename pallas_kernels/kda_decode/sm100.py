"""Blackwell (sm100) body of the fused KDA decode step. No MMA pays here (two GEMVs in fp32), so it is
the sm90 algorithm with the tile in the TCGEN05 register layout (a warp owns 32 rows instead of 16; not yet
measured on Blackwell) and its own tuning entry."""

import json
import pathlib

from pallas_kernels.kda_decode import kernel, verify_kernel

TUNING = json.loads((pathlib.Path(__file__).parent / "tuning.json").read_text())["sm100"]


def kda_decode(qkv_B3HK, f_BHK, beta_BH, gate_BHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H, dt_bias_HK,
               o_norm_w_K, *, eps=1e-5, interpret=None):
    kernel.check_supported(qkv_B3HK, state_BHKV, conv_B3WHK)
    return kernel.decode(qkv_B3HK, f_BHK, beta_BH, gate_BHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H,
                         dt_bias_HK, o_norm_w_K, eps=eps, interpret=interpret,
                         **kernel.pick_launch(TUNING, qkv_B3HK))


def kda_verify(qkv_BT3HK, f_BTHK, beta_BTH, gate_BTHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H, dt_bias_HK,
               o_norm_w_K, *, eps=1e-5, interpret=None):
    """Speculative verify with the decode launch table: same tiles, and the state is still the traffic."""
    verify_kernel.check_supported(qkv_BT3HK, state_BHKV, conv_B3WHK)
    return verify_kernel.verify(qkv_BT3HK, f_BTHK, beta_BTH, gate_BTHK, state_BHKV, conv_B3WHK, conv_w_3HKW,
                                A_log_H, dt_bias_HK, o_norm_w_K, eps=eps, interpret=interpret,
                                **verify_kernel.pick_launch(TUNING, qkv_BT3HK))


def kda_commit(state_BHKV, conv_B3WHK, commit_data, accepted_B, *, interpret=None):
    """Commit reads and writes each tile once, like a decode step: the decode launch table applies as is."""
    qkv_BT3HK = commit_data["new_inputs_BT3HK"]
    verify_kernel.check_supported(qkv_BT3HK, state_BHKV, conv_B3WHK)
    return verify_kernel.commit(state_BHKV, conv_B3WHK, commit_data, accepted_B, interpret=interpret,
                                **verify_kernel.pick_launch(TUNING, qkv_BT3HK))
