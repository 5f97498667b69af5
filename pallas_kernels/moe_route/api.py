"""The MoE routing step after the sigmoid (docs/model.md §6): top-k of the biased scores, weights from the unbiased
ones; and the grouping of the chosen (token, expert) pairs by expert that a grouped-experts kernel reads.

route dispatches through the decode policy: the Mosaic GPU kernel (kernel.py) where the policy asks for
kernels and the kernel takes the call, else the XLA reference (reference.py, today's model code). Both give
the same sel (exactly; lax.top_k's order) and the same weights up to the order of the fp32 sum.
"""

from pallas_kernels import common
from pallas_kernels import policy as policy_lib
from pallas_kernels.moe_route import grouping, reference
from pallas_kernels.moe_route.reference import ExpertGroups
from pallas_kernels.policy import XLA, DecodePolicy

GROUP_IMPLS = {"argsort": reference.group_by_expert, "keys": grouping.group_by_keys, "rank": grouping.group_by_rank}


def _check_inputs(scores_TE, biased_TE, bias_E, k):
    if scores_TE.ndim != 2:
        raise ValueError(f"scores must be [T, E] (tokens, experts), got shape {list(scores_TE.shape)}")
    T, E = scores_TE.shape
    if (biased_TE is None) == (bias_E is None):
        raise ValueError("give exactly one of biased_TE (scores + selection bias, [T, E]) or bias_E ([E])")
    if biased_TE is not None and biased_TE.shape != scores_TE.shape:
        raise ValueError(f"biased_TE must have the scores' shape {[T, E]}, got {list(biased_TE.shape)}")
    if bias_E is not None and bias_E.shape != (E,):
        raise ValueError(f"bias_E must be [E] = [{E}], got {list(bias_E.shape)}")
    if not 1 <= k <= E:
        raise ValueError(f"k = {k}: pick 1..E = {E} experts per token")


def _kernel(scores_TE, biased_TE, bias_E, k, renormalize, scaling):
    arch = common.gpu_arch()
    if arch is None or arch[0] not in (9, 10):
        raise NotImplementedError(f"no GPU to run Mosaic GPU on (compute capability {arch}; sm90 or sm100)")
    from pallas_kernels.moe_route import kernel

    kernel.check_supported(scores_TE, biased_TE, bias_E, k)
    return kernel.route(scores_TE, biased_TE, bias_E, k=k, renormalize=renormalize, scaling=scaling)


def route(scores_TE, biased_TE=None, *, bias_E=None, k, renormalize=True, scaling=1.0, policy: DecodePolicy = XLA):
    """-> (sel [T, k] int32, w [T, k] fp32). scores: the router's fp32 sigmoid scores [T, E]; the selection
    bias either already added (biased_TE = scores + bias) or as bias_E [E]. sel = lax.top_k(biased, k)'s
    indices (ties to the lower index); w = the unbiased scores there, / (their sum + 1e-20) where renormalize
    and k > 1, then times scaling."""
    _check_inputs(scores_TE, biased_TE, bias_E, k)
    scaling = float(scaling)

    def xla():
        biased = biased_TE if bias_E is None else scores_TE + bias_E
        return reference.route(scores_TE, biased, k=k, renormalize=renormalize, scaling=scaling)

    return policy_lib.dispatch(
        "moe_route",
        policy,
        lambda: _kernel(scores_TE, biased_TE, bias_E, k, renormalize, scaling),
        xla,
    )


def default_group_impl(num_pairs: int) -> str:
    """Not measured yet (bench/moe_route.py --groups times all three): the sort-free form while its [P, P]
    compare stays small, the single-key sort above."""
    return "rank" if num_pairs <= 1024 else "keys"


def group_by_expert(sel_Tk, num_experts, *, impl=None) -> ExpertGroups:
    """The T*k (token, slot) pairs of sel [T, k] grouped by expert, on device (see ExpertGroups). impl: one of
    GROUP_IMPLS (all XLA, all the same result), None = default_group_impl."""
    if sel_Tk.ndim != 2:
        raise ValueError(f"sel must be [T, k] expert ids, got shape {list(sel_Tk.shape)}")
    impl = impl or default_group_impl(sel_Tk.size)
    if impl not in GROUP_IMPLS:
        raise ValueError(f"group impl must be one of {sorted(GROUP_IMPLS)}, got {impl!r}")
    return GROUP_IMPLS[impl](sel_Tk, num_experts)
