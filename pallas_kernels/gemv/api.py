"""Dispatch for the decode GEMV: the Hopper kernel where the decode policy asks for kernels and it applies
(sm90, bf16, a batch that the policy's gemv tuning has a launch for: <= 64), the XLA reference otherwise
(pallas_kernels.policy.dispatch: the reason logged once on logger "k3jax.backends"). gemv: one x against several
weights, an output each; gemv_sum: several (x_j, w_j) pairs sharing N summed into one output (the MoE's finish)."""

from pallas_kernels import common
from pallas_kernels import policy as policy_lib
from pallas_kernels.gemv import reference
from pallas_kernels.policy import XLA, DecodePolicy

MAX_BATCH = 64  # the kernel's largest batch (kernel.MAX_TOKENS, kept off this import): past it a GEMM


def pick_launch(B, D, table="launch", policy: DecodePolicy = XLA) -> dict:
    """tuning.json's sm90 launch for batch B over D -> dict(block_k, split_k, steps, x_stream): the first
    entry of `table` ("launch", or "o_proj_launch" for o_proj's short D) whose [min_batch, max_batch] holds B;
    NotImplementedError where none does."""
    entries = policy.table("gemv")["sm90"].get(table, [])
    entry = next((e for e in entries if e.get("min_batch", 1) <= B <= e["max_batch"]), None)
    if entry is None:
        raise NotImplementedError(
            f"batch {B}: no GEMV {table} entry in tuning.json (it serves batches "
            f"{[(e.get('min_batch', 1), e['max_batch']) for e in entries]})"
        )
    # split D only where it divides: o_proj's short D (768 at TP16) has row blocks enough without it
    split_k = entry["split_k"] if D % (entry["split_k"] * entry["block_k"]) == 0 else 1
    return dict(
        block_k=entry["block_k"],
        split_k=split_k,
        steps=entry["steps"],
        x_stream=entry.get("x_stream", "N"),
    )


def run_kernel(x_BD, ws_ND, table="launch", policy: DecodePolicy = XLA, out_dtypes=None):
    """The kernel itself: NotImplementedError where it does not take the call (gemv then runs the reference)."""
    arch = common.gpu_arch()
    if arch is None or arch[0] != 9:
        raise NotImplementedError(f"GEMV kernel is Hopper-only (sm90), got {arch}")
    from pallas_kernels.gemv import kernel

    launch = pick_launch(*x_BD.shape, table=table, policy=policy)
    kernel.check_supported(x_BD, ws_ND, **launch)
    out_dtypes = reference.out_dtypes_for(x_BD, ws_ND, out_dtypes)
    return kernel.gemv(x_BD, tuple(ws_ND), out_dtypes=out_dtypes, **launch)


def gemv(x_BD, ws_ND, *, out_dtypes=None, names=None, policy: DecodePolicy = XLA, table="launch"):
    """x [B, D] times each out-major weight [N_i, D] -> tuple of [B, N_i], fp32 sums, each rounded to its
    out_dtypes entry: x's dtype (the default) or fp32 (unrounded). table: the tuning's launch list to pick from
    (pick_launch). names: the reference's named scope per output (reference.gemv)."""
    reference.out_dtypes_for(x_BD, ws_ND, out_dtypes)  # a bad request is the caller's error, not a fallback
    return policy_lib.dispatch(
        f"gemv {table}",
        policy,
        lambda: run_kernel(x_BD, ws_ND, table, policy, out_dtypes),
        lambda: reference.gemv(x_BD, ws_ND, out_dtypes, names),
    )


def run_sum_kernel(xs_BK, ws_NK, table="moe_out_launch", policy: DecodePolicy = XLA):
    """The pairs' kernel itself: NotImplementedError where it does not take the call (gemv_sum then runs the
    reference). The table's entry is picked by the batch and the widest pair's K."""
    arch = common.gpu_arch()
    if arch is None or arch[0] != 9:
        raise NotImplementedError(f"GEMV kernel is Hopper-only (sm90), got {arch}")
    from pallas_kernels.gemv import kernel

    launch = pick_launch(xs_BK[0].shape[0], max(x.shape[1] for x in xs_BK), table=table, policy=policy)
    kernel.check_sum_supported(xs_BK, ws_NK, **launch)
    return kernel.gemv_sum(tuple(xs_BK), tuple(ws_NK), **launch)


def gemv_sum(xs_BK, ws_NK, *, names=None, policy: DecodePolicy = XLA, table="moe_out_launch"):
    """Σ_j x_j [B, K_j] @ w_jᵀ for out-major w_j [N, K_j] -> [B, N] in x's dtype: each product rounded to x's
    dtype, then added in order (reference.gemv_sum), in one launch where the policy's table has an entry for the
    batch. names: the reference's named scope per product."""
    return policy_lib.dispatch(
        f"gemv_sum {table}",
        policy,
        lambda: run_sum_kernel(xs_BK, ws_NK, table, policy),
        lambda: reference.gemv_sum(xs_BK, ws_NK, names),
    )
