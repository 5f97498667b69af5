"""What a body (sm90.py, sm100.py) gives the api: its ops, launched by that body's tuning.json entry.

The kernels are shared (kernel.py: decode; verify_kernel.py: verify and commit); a body differs only in its
tile register layout and launch table, which is data.
"""

import json
import pathlib
from collections.abc import Callable
from typing import NamedTuple

import jax

from pallas_kernels import common
from pallas_kernels.gemv import api as gemv_api
from pallas_kernels.gemv import kernel as gemv
from pallas_kernels.kda_decode import kernel, reference, verify_kernel
from pallas_kernels.policy import XLA, DecodePolicy


class Ops(NamedTuple):
    """A body's ops, with the api's signatures (plus `interpret` for CPU tests)."""

    kda_decode: Callable
    kda_decode_gates: Callable
    kda_decode_x: Callable
    kda_verify: Callable
    kda_commit: Callable


def load_tuning(arch: str) -> dict:
    return json.loads((pathlib.Path(__file__).parent / "tuning.json").read_text())[arch]


def kernel_launch(launch: dict, interpret) -> dict:
    """A tuning entry as the kernels take it. Interpret mode (CPU tests) has no peer-SMEM stores, so a "dsmem"
    gather runs as "gmem" there: the same split and cluster barrier, o exchanged through a GMEM buffer instead
    (the dsmem store itself is tested on the GPU)."""
    if interpret is not None and launch.get("gather") == "dsmem":
        return dict(launch, gather="gmem")
    return launch


def entry_points(tuning: dict, policy: DecodePolicy = XLA) -> Ops:
    """The body's ops, launched by its tuning (the policy's gemv tuning for the projections it runs)."""

    def fuses_gates(B, H):  # tuning's "fuse_gates_max_batch" and "fuse_gates_max_heads" (absent: any)
        return B <= tuning.get("fuse_gates_max_batch", 0) and H <= tuning.get("fuse_gates_max_heads", H)

    def kda_decode(
        qkv_B3HK,
        f_BHK,
        beta_BH,
        gate_BHK,
        state_BHKV,
        conv_B3WHK,
        conv_w_3HKW,
        A_log_H,
        dt_bias_HK,
        o_norm_w_K,
        active_B=None,
        *,
        eps=1e-5,
        interpret=None,
    ):
        kernel.check_supported(qkv_B3HK, state_BHKV, conv_B3WHK)
        return kernel.decode(
            qkv_B3HK,
            f_BHK,
            beta_BH,
            gate_BHK,
            state_BHKV,
            conv_B3WHK,
            conv_w_3HKW,
            A_log_H,
            dt_bias_HK,
            o_norm_w_K,
            active_B,
            eps=eps,
            interpret=interpret,
            **kernel_launch(kernel.pick_launch(tuning, qkv_B3HK), interpret),
        )

    def kda_decode_gates(
        qkv_B3HK,
        fa_BR,
        f_b_RHK,
        x_BD,
        b_HD,
        gate_BHK,
        state_BHKV,
        conv_B3WHK,
        conv_w_3HKW,
        A_log_H,
        dt_bias_HK,
        o_norm_w_K,
        active_B=None,
        *,
        eps=1e-5,
        interpret=None,
    ):
        """Up to tuning's "fuse_gates_max_batch" and "fuse_gates_max_heads" (absent: any) the two projections
        run inside the decode kernel (b out-major [H, D]: a head's row is contiguous); beyond either, XLA's GEMVs
        (as the model runs them), then the decode kernel. Many heads lose fused: every CTA of a head rereads its
        f_b and b, where XLA's GEMVs read them once. Fused, a CTA keeps one warpgroup: each would redo the gate
        GEMVs."""
        kernel.check_supported(qkv_B3HK, state_BHKV, conv_B3WHK)
        rest = (gate_BHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H, dt_bias_HK, o_norm_w_K)
        launch = kernel_launch(kernel.pick_launch(tuning, qkv_B3HK), interpret)
        B, _, H, _ = qkv_B3HK.shape
        if fuses_gates(B, H):
            return kernel.decode_gates(
                qkv_B3HK,
                fa_BR,
                f_b_RHK,
                x_BD,
                b_HD,
                *rest,
                active_B,
                eps=eps,
                interpret=interpret,
                **dict(launch, warpgroups=1),
            )
        f, beta = reference.gates(fa_BR, f_b_RHK, x_BD, b_HD)
        return kernel.decode(qkv_B3HK, f, beta, *rest, active_B, eps=eps, interpret=interpret, **launch)

    def kda_decode_x(
        x_BD,
        qkvg_4HKD,
        f_a_RD,
        f_b_RHK,
        b_HD,
        state_BHKV,
        conv_B3WHK,
        conv_w_3HKW,
        A_log_H,
        dt_bias_HK,
        o_norm_w_K,
        active_B=None,
        *,
        eps=1e-5,
        interpret=None,
    ):
        """With tuning "gemv_projections" (where the GEMV takes the shapes): the decode GEMV
        (pallas_kernels.gemv) runs q/k/v/g and f_a in one launch, as fp32 partials. Where the gate projections
        fuse, the decode kernel sums and rounds them itself (two launches in all); above that batch, where the
        GEMV's tuning has a launch, one XLA fusion per operand sums them, then kda_decode_gates. Otherwise (more
        heads than the gates fuse at, or a batch or dtype the GEMV refuses) the model's GEMMs, then
        kda_decode_gates."""
        rest = (state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H, dt_bias_HK, o_norm_w_K)
        if tuning.get("gemv_projections"):
            try:
                return _from_gemv(
                    x_BD, qkvg_4HKD, f_a_RD, f_b_RHK, b_HD, *rest, active_B=active_B, eps=eps, interpret=interpret
                )
            except NotImplementedError as e:
                common.log_once("kda_decode_x", f"projections by XLA: {e}")
        qkvg_B4HK, fa_BR = reference.project(x_BD, qkvg_4HKD, f_a_RD)
        # qkvg goes in whole as both qkv and gate (kernel.check_supported): slicing it made XLA copy q/k/v and g
        # into operands of their own before the custom call (two more kernels)
        return kda_decode_gates(
            qkvg_B4HK, fa_BR, f_b_RHK, x_BD, b_HD, qkvg_B4HK, *rest, active_B, eps=eps, interpret=interpret
        )

    def _from_gemv(x_BD, qkvg_4HKD, f_a_RD, f_b_RHK, b_HD, *rest, active_B, eps, interpret):
        B, D = x_BD.shape
        state_BHKV, conv_B3WHK = rest[:2]
        H, K = conv_B3WHK.shape[-2:]
        if H > tuning.get("fuse_gates_max_heads", H):  # TP1's 96 heads: not measured with the GEMV
            raise NotImplementedError(
                f"{B} x {H}: the GEMV projections are tuned at <= {tuning['fuse_gates_max_heads']} heads"
            )
        ws = (qkvg_4HKD.reshape(-1, D), f_a_RD)
        g = gemv_api.pick_launch(B, D, policy=policy)
        gemv.check_supported(x_BD, ws, **g)
        qkv_B3HK = jax.ShapeDtypeStruct((B, 3, H, K), x_BD.dtype)  # what the kernel checks and tiles by
        kernel.check_supported(qkv_B3HK, state_BHKV, conv_B3WHK)
        qkvg_parts, fa_parts = gemv.partials(x_BD, ws, **g, interpret=interpret)  # [S, N, T], x_stream "M" [S, T, N]
        layout = "TN" if g["x_stream"] == "M" else "NT"
        if fuses_gates(B, H):
            launch = kernel_launch(kernel.pick_launch(tuning, qkv_B3HK), interpret)
            return kernel.decode_gates(
                qkvg_parts,
                fa_parts,
                f_b_RHK,
                x_BD,
                b_HD,
                qkvg_parts,
                *rest,
                active_B,
                eps=eps,
                from_gemv=layout,
                interpret=interpret,
                **dict(launch, warpgroups=1),
            )  # one warpgroup, fused gates

        def summed(parts):  # XLA sums the partials (one rounding, as the model's GEMMs round) -> [B, N]
            return (parts[:, :B] if layout == "TN" else parts[..., :B].transpose(0, 2, 1)).sum(0).astype(x_BD.dtype)

        qkvg, fa = summed(qkvg_parts).reshape(B, 4, H, K), summed(fa_parts)  # qkvg goes to the kernel whole
        return kda_decode_gates(qkvg, fa, f_b_RHK, x_BD, b_HD, qkvg, *rest, active_B, eps=eps, interpret=interpret)

    def kda_verify(
        qkv_BT3HK,
        f_BTHK,
        beta_BTH,
        gate_BTHK,
        state_BHKV,
        conv_B3WHK,
        conv_w_3HKW,
        A_log_H,
        dt_bias_HK,
        o_norm_w_K,
        *,
        eps=1e-5,
        interpret=None,
    ):
        """The decode launch table: same tiles, and the state is still the traffic."""
        verify_kernel.check_supported(qkv_BT3HK, state_BHKV, conv_B3WHK)
        return verify_kernel.verify(
            qkv_BT3HK,
            f_BTHK,
            beta_BTH,
            gate_BTHK,
            state_BHKV,
            conv_B3WHK,
            conv_w_3HKW,
            A_log_H,
            dt_bias_HK,
            o_norm_w_K,
            eps=eps,
            interpret=interpret,
            **kernel_launch(verify_kernel.pick_launch(tuning, qkv_BT3HK), interpret),
        )

    def kda_commit(state_BHKV, conv_B3WHK, commit_data, accepted_B, *, interpret=None):
        """Reads and writes each tile once, like a decode step: the decode launch table applies as is.
        Refused where the tuning says "commit": "xla" (XLA's one fused commit kernel is faster there)."""
        if tuning.get("commit") == "xla":
            raise NotImplementedError("tuning.json: XLA's fused commit measured faster on this GPU")
        qkv_BT3HK = commit_data["new_inputs_BT3HK"]
        verify_kernel.check_supported(qkv_BT3HK, state_BHKV, conv_B3WHK)
        return verify_kernel.commit(
            state_BHKV,
            conv_B3WHK,
            commit_data,
            accepted_B,
            interpret=interpret,
            **verify_kernel.pick_launch(tuning, qkv_BT3HK, split=False),
        )

    return Ops(kda_decode, kda_decode_gates, kda_decode_x, kda_verify, kda_commit)
