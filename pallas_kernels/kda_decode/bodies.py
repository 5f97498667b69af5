"""What a body (sm90.py, sm100.py) gives the api: the four ops, launched by that body's tuning.json entry.

The kernels are shared (kernel.py: decode; verify_kernel.py: verify and commit); a body differs only in its
tile register layout and launch table, which is data.
"""

import json
import pathlib

from pallas_kernels.kda_decode import kernel, reference, verify_kernel


def load_tuning(arch: str) -> dict:
    return json.loads((pathlib.Path(__file__).parent / "tuning.json").read_text())[arch]


def _launch(launch: dict, interpret) -> dict:
    """A tuning entry as the kernels take it. Interpret mode (CPU tests) has no peer-SMEM stores, so a "dsmem"
    gather runs as "gmem" there: the same split and cluster barrier, o exchanged through a GMEM buffer instead
    (the dsmem store itself is tested on the GPU)."""
    if interpret is not None and launch.get("gather") == "dsmem":
        return dict(launch, gather="gmem")
    return launch


def entry_points(tuning: dict):
    """-> (kda_decode, kda_decode_gates, kda_verify, kda_commit) with the api's signatures (plus `interpret`
    for CPU tests)."""

    def kda_decode(qkv_B3HK, f_BHK, beta_BH, gate_BHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H,
                   dt_bias_HK, o_norm_w_K, *, eps=1e-5, interpret=None):
        kernel.check_supported(qkv_B3HK, state_BHKV, conv_B3WHK)
        return kernel.decode(qkv_B3HK, f_BHK, beta_BH, gate_BHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H,
                             dt_bias_HK, o_norm_w_K, eps=eps, interpret=interpret,
                             **_launch(kernel.pick_launch(tuning, qkv_B3HK), interpret))

    def kda_decode_gates(qkv_B3HK, fa_BR, f_b_RHK, x_BD, b_DH, gate_BHK, state_BHKV, conv_B3WHK, conv_w_3HKW,
                         A_log_H, dt_bias_HK, o_norm_w_K, *, eps=1e-5, interpret=None):
        """Up to tuning's "fuse_gates_max_batch" and "fuse_gates_max_heads" (absent: any) the two projections
        run inside the decode kernel; beyond either, XLA's GEMVs (as the model runs them), then the decode
        kernel. The heads limit: each CTA reads its head's column of b [D, H], a stride of H elements, so at
        96 heads every element is its own 32-byte sector. Fused, a CTA keeps one warpgroup: each would redo the
        gate GEMVs (H200, 8 x 12: 9.79 us with two warpgroups, 9.34 with one)."""
        kernel.check_supported(qkv_B3HK, state_BHKV, conv_B3WHK)
        rest = (gate_BHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H, dt_bias_HK, o_norm_w_K)
        launch = _launch(kernel.pick_launch(tuning, qkv_B3HK), interpret)
        B, _, H, _ = qkv_B3HK.shape
        if B <= tuning.get("fuse_gates_max_batch", 0) and H <= tuning.get("fuse_gates_max_heads", H):
            return kernel.decode_gates(qkv_B3HK, fa_BR, f_b_RHK, x_BD, b_DH, *rest, eps=eps, interpret=interpret,
                                       **dict(launch, warpgroups=1))
        f, beta = reference.gates(fa_BR, f_b_RHK, x_BD, b_DH)
        return kernel.decode(qkv_B3HK, f, beta, *rest, eps=eps, interpret=interpret, **launch)

    def kda_verify(qkv_BT3HK, f_BTHK, beta_BTH, gate_BTHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H,
                   dt_bias_HK, o_norm_w_K, *, eps=1e-5, interpret=None):
        """The decode launch table: same tiles, and the state is still the traffic."""
        verify_kernel.check_supported(qkv_BT3HK, state_BHKV, conv_B3WHK)
        return verify_kernel.verify(qkv_BT3HK, f_BTHK, beta_BTH, gate_BTHK, state_BHKV, conv_B3WHK,
                                    conv_w_3HKW, A_log_H, dt_bias_HK, o_norm_w_K, eps=eps, interpret=interpret,
                                    **_launch(verify_kernel.pick_launch(tuning, qkv_BT3HK), interpret))

    def kda_commit(state_BHKV, conv_B3WHK, commit_data, accepted_B, *, interpret=None):
        """Reads and writes each tile once, like a decode step: the decode launch table applies as is.
        Refused where the tuning says "commit": "xla" (XLA's one fused commit kernel measured faster)."""
        if tuning.get("commit") == "xla":
            raise NotImplementedError("tuning.json: XLA's fused commit measured faster on this GPU")
        qkv_BT3HK = commit_data["new_inputs_BT3HK"]
        verify_kernel.check_supported(qkv_BT3HK, state_BHKV, conv_B3WHK)
        return verify_kernel.commit(state_BHKV, conv_B3WHK, commit_data, accepted_B, interpret=interpret,
                                    **verify_kernel.pick_launch(tuning, qkv_BT3HK, split=False))

    return kda_decode, kda_decode_gates, kda_verify, kda_commit
