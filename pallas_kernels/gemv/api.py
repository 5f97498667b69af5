"""Dispatch for the decode GEMV: the kernel of the GPU's body (compute capability 9: kernel.py, Hopper WGMMA; 10:
kernel_sm100.py, Blackwell tcgen05) where the decode policy asks for kernels and it applies (bf16, a batch that
the policy's gemv tuning has a launch for in that body's section: <= 64), the XLA reference otherwise
(pallas_kernels.policy.dispatch: the reason logged once on logger "k3jax.backends"). gemv: one x against several
weights, an output each; gemv_sum: several (x_j, w_j) pairs sharing N summed into one output (the MoE's finish)."""

from pallas_kernels import common
from pallas_kernels import policy as policy_lib
from pallas_kernels.gemv import reference
from pallas_kernels.policy import XLA, DecodePolicy

MAX_BATCH = 64  # the kernel's largest batch (kernel.MAX_TOKENS, kept off this import): past it a GEMM


BODIES = {9: "sm90", 10: "sm100"}  # compute capability major -> the body (tuning.json's section)


def body(arch=None):
    """(tuning.json's section, kernel module) of the body for `arch` ((major, minor); default the GPU we compile
    for): NotImplementedError off Hopper and Blackwell."""
    arch = common.gpu_arch() if arch is None else arch
    if arch is None or arch[0] not in BODIES:
        raise NotImplementedError(f"GEMV kernel: sm90 (Hopper) or sm100 (Blackwell) only, got {arch}")
    if arch[0] == 9:
        from pallas_kernels.gemv import kernel as module
    else:
        from pallas_kernels.gemv import kernel_sm100 as module
    return BODIES[arch[0]], module


def pick_launch(B, D, table="launch", policy: DecodePolicy = XLA, arch="sm90") -> dict:
    """tuning.json's launch for batch B over D in the body's section `arch` ("sm90", the default, or "sm100") ->
    dict(block_k, split_k, steps, x_stream): the first entry of `table` ("launch", or "o_proj_launch" for o_proj's
    short D) whose [min_batch, max_batch] holds B; NotImplementedError where none does."""
    entries = policy.table("gemv").get(arch, {}).get(table, [])
    entry = next((e for e in entries if e.get("min_batch", 1) <= B <= e["max_batch"]), None)
    if entry is None:
        raise NotImplementedError(
            f"batch {B}: no GEMV {table} entry in tuning.json's {arch} (it serves batches "
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
    arch, kernel = body()
    launch = pick_launch(*x_BD.shape, table=table, policy=policy, arch=arch)
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


def run_sum_kernel(xs_BK, ws_NK, table="moe_out_launch", policy: DecodePolicy = XLA, x_starts=None):
    """The pairs' kernel itself: NotImplementedError where it does not take the call (gemv_sum then runs the
    reference). The table's entry is picked by the batch and the widest pair's K. x windows (x_starts) are read
    in place where the body can (Hopper's X_WINDOWS), else sliced first."""
    arch, kernel = body()
    windows = reference.x_windows(xs_BK, ws_NK, x_starts)
    launch = pick_launch(windows[0].shape[0], max(x.shape[1] for x in windows), table=table, policy=policy, arch=arch)
    kernel.check_sum_supported(windows, ws_NK, **launch)
    if x_starts and getattr(kernel, "X_WINDOWS", False):
        return kernel.gemv_sum(tuple(xs_BK), tuple(ws_NK), x_starts=tuple(x_starts), **launch)
    return kernel.gemv_sum(windows, tuple(ws_NK), **launch)


def gemv_sum(xs_BK, ws_NK, *, x_starts=None, names=None, policy: DecodePolicy = XLA, table="moe_out_launch"):
    """Σ_j x_j [B, K_j] @ w_jᵀ for out-major w_j [N, K_j] -> [B, N] in x's dtype: each product rounded to x's
    dtype, then added in order (reference.gemv_sum), in one launch where the policy's table has an entry for the
    batch. x_starts: per pair None or where x_j's K_j-wide window starts (reference.x_windows). names: the
    reference's named scope per product."""
    return policy_lib.dispatch(
        f"gemv_sum {table}",
        policy,
        lambda: run_sum_kernel(xs_BK, ws_NK, table, policy, x_starts),
        lambda: reference.gemv_sum(xs_BK, ws_NK, names, x_starts),
    )
