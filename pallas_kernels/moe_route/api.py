"""The MoE routing step after the sigmoid (docs/model.md §6): top-k of the biased scores, weights from the unbiased
ones. The grouping of the chosen (token, expert) pairs by expert is pallas_kernels/moe/grouping.py.

route dispatches through the decode policy: the Mosaic GPU kernel (kernel.py) where the policy asks for
kernels and the kernel takes the call, else the XLA reference (reference.py, today's model code). Both give
the same sel (exactly; lax.top_k's order) and the same weights up to the order of the fp32 sum.
route_gathered is the same op on the block the tensor-parallel ranks' one all-gather returns (the kernel reads
the scores out of it itself: no XLA slice kernel between the gather and the top-k).
"""

from pallas_kernels import common
from pallas_kernels import policy as policy_lib
from pallas_kernels.moe_route import reference
from pallas_kernels.policy import XLA, DecodePolicy


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


def _kernel_gpu():
    arch = common.gpu_arch()
    if arch is None or arch[0] not in (9, 10):
        raise NotImplementedError(f"no GPU to run Mosaic GPU on (compute capability {arch}; sm90 or sm100)")


def _kernel(scores_TE, biased_TE, bias_E, k, renormalize, scaling):
    _kernel_gpu()
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


def route_gathered(block_TX, *, ranks, e_local, k, renormalize=True, scaling=1.0, policy: DecodePolicy = XLA):
    """route() on the ranks' all-gathered routing block [T, ranks x W] (reference.split_block: each rank's piece
    starts with its E_l scores, then its E_l biased scores) -> (sel [T, k] int32, w [T, k] fp32). The kernel
    reads the block itself where it can (kernel.check_gathered), else the scores sliced out by XLA."""
    if block_TX.ndim != 2 or block_TX.shape[1] % ranks or block_TX.shape[1] // ranks < 2 * e_local:
        raise ValueError(
            f"the routing block must be [T, ranks x W] with W >= 2 E_l = {2 * e_local} (ranks = {ranks}), "
            f"got shape {list(block_TX.shape)}"
        )
    scaling = float(scaling)
    scores, biased = reference.split_block(block_TX, ranks, e_local)
    _check_inputs(scores, biased, None, k)

    def kernel_path():
        _kernel_gpu()
        from pallas_kernels.moe_route import kernel

        try:
            kernel.check_gathered(block_TX, ranks, e_local, k)
        except NotImplementedError:  # the scores sliced out by XLA, then the plain kernel
            return _kernel(scores, biased, None, k, renormalize, scaling)
        return kernel.route_gathered(
            block_TX, ranks=ranks, e_local=e_local, k=k, renormalize=renormalize, scaling=scaling
        )

    return policy_lib.dispatch(
        "moe_route",
        policy,
        kernel_path,
        lambda: reference.route(scores, biased, k=k, renormalize=renormalize, scaling=scaling),
    )
