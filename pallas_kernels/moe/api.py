"""Dispatch for the routed experts of the latent MoE: the Hopper (sm90) or Blackwell (sm100, GB300 included)
kernel where the policy asks for kernels and the body takes the call (MXFP4 experts, bf16 activations, shapes it
tiles), the XLA reference (policy.moe_impl: "packed" or "gather") otherwise; the refusal is logged once and recorded
(pallas_kernels.policy). Each body launches by its own tuning.json section (body.ARCH).
"""

from pallas_kernels import common
from pallas_kernels import policy as policy_lib
from pallas_kernels.moe import reference
from pallas_kernels.policy import XLA, DecodePolicy

OP = "moe_routed_experts"


def _body():
    arch = common.gpu_arch()
    if arch is None:
        raise NotImplementedError("no GPU device (the routed-experts kernel needs sm90 or sm100)")
    if arch[0] == 9:
        from pallas_kernels.moe import sm90

        return sm90
    if arch[0] == 10:  # B200 / GB200 (10.0), GB300 (10.3)
        from pallas_kernels.moe import sm100

        return sm100
    raise NotImplementedError(f"no routed-experts body for compute capability {arch} (sm90 and sm100 only)")


def _check(experts, z_TL, sel_Tk, w_Tk):
    if z_TL.ndim != 2 or sel_Tk.ndim != 2 or w_Tk.shape != sel_Tk.shape or sel_Tk.shape[0] != z_TL.shape[0]:
        raise ValueError(
            f"routed_experts takes z [T, L], sel [T, k] and w [T, k]; got z {list(z_TL.shape)}, "
            f"sel {list(sel_Tk.shape)}, w {list(w_Tk.shape)}"
        )
    if not ({"w1", "w3", "w2"} <= set(experts) or {"w1_codes", "w1_scales", "w3_codes", "w2_codes"} <= set(experts)):
        raise ValueError(f"experts need w1/w3/w2 (dense) or w1/w3/w2 _codes + _scales (MXFP4), got {sorted(experts)}")


def routed_experts(experts, z_TL, sel_Tk, w_Tk, *, situ_beta, situ_linear_beta, policy: DecodePolicy = XLA):
    """This rank's partial of sum_k w[t, k] * W2_e(SiTU-GLU(W1_e z_t, W3_e z_t)) (e = sel[t, k]) in z's dtype.

    experts: w1/w3/w2 `_codes` uint8 [E, out, in/2] + `_scales` uint8 [E, out, in/32] (MXFP4), or dense
    w1/w3/w2 [E, out, in] (the kernel takes the MXFP4 form). z [T, L], sel int [T, k], w fp32 [T, k]."""
    _check(experts, z_TL, sel_Tk, w_Tk)
    beta = dict(situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)

    def kernel():
        body = _body()
        tuning = policy.table("moe")
        least = tuning[body.ARCH].get("serve_min_tokens", 1)
        if z_TL.shape[0] < least:
            raise NotImplementedError(
                f"{z_TL.shape[0]} tokens: the kernel is served from {least} (tuning.json serve_min_tokens), "
                "XLA's packed path measured faster below"
            )
        scale_max = policy.expert_scale_max
        return body.routed_experts(experts, z_TL, sel_Tk, w_Tk, **beta, tuning=tuning, scale_max=scale_max)

    def ref():
        return reference.routed_experts(experts, z_TL, sel_Tk, w_Tk, **beta, impl=policy.moe_impl)

    return policy_lib.dispatch(OP, policy, kernel, ref)
