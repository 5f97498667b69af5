"""Dispatch for the MLA decode attention: a Mosaic GPU kernel where the decode policy asks for kernels and it takes
the call (Hopper, sm90.py: a cache of 64 positions or more; Blackwell, compute capability 10.x incl. GB300's 10.3,
sm100.py: 128 or more; bf16 or fp32 compute; fp8 e4m3 or bf16 rows), the XLA reference otherwise
(pallas_kernels.policy.dispatch: the reason logged once on logger "k3jax.backends").

The op is the weight-absorbed attention core of an MLA layer (reference.py has the maths): the caller absorbs
W_UK into the queries before and W_UV into the output after.
"""

import importlib

import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels import policy as policy_lib
from pallas_kernels.mla_decode import reference
from pallas_kernels.policy import XLA, DecodePolicy

OP = "mla_decode_attention"
ROWS_OP = "mla_write_rows"
BODIES = {9: "sm90", 10: "sm100"}  # compute capability major -> the body's module (and tuning.json section)


def _body_name(policy: DecodePolicy) -> str:
    """The body (tuning.json section) for the GPU we compile for; NotImplementedError where none serves."""
    arch = common.gpu_arch()
    if arch is None:
        raise NotImplementedError("no GPU device (Mosaic GPU needs sm90 or sm100)")
    name = BODIES.get(arch[0])
    if name is None:
        raise NotImplementedError(f"no MLA decode body for compute capability {arch} (the kernels are sm90, sm100)")
    section = policy.table("mla_decode").get(name)
    if section is None:
        raise NotImplementedError(f"the policy's mla_decode tuning has no {name!r} section")
    if not section.get("serve", True):
        raise NotImplementedError(f"the MLA decode kernels are switched off (tuning.json {name} 'serve': false)")
    return name


def _kernel_op(policy: DecodePolicy):
    body = importlib.import_module(f"pallas_kernels.mla_decode.{_body_name(policy)}")
    return body.ops(policy)


def _check(q_lat_BTHR, q_pe_BTHE, entry, key_len_BT):
    if not isinstance(entry, dict) or "rows" not in entry:
        raise ValueError("entry must be a cache entry dict: {'rows': [B, S, R + E]} (+ 'scales': [B, S, 2] for fp8)")
    rows = entry["rows"]
    if q_lat_BTHR.ndim != 4 or q_pe_BTHE.shape[:3] != q_lat_BTHR.shape[:3]:
        raise ValueError(f"q_lat [B, T, H, R] and q_pe [B, T, H, E], got {q_lat_BTHR.shape} and {q_pe_BTHE.shape}")
    B, T, _, R = q_lat_BTHR.shape
    E = q_pe_BTHE.shape[-1]
    if rows.ndim != 3 or rows.shape[0] != B or rows.shape[2] != R + E:
        raise ValueError(f"cache rows must be [B={B}, S, R + E = {R + E}], got {list(rows.shape)}")
    if "scales" in entry and entry["scales"].shape != rows.shape[:2] + (2,):
        raise ValueError(f"cache scales must be [B, S, 2] beside rows {list(rows.shape)}, got {entry['scales'].shape}")
    if key_len_BT.shape != (B, T) or not jnp.issubdtype(key_len_BT.dtype, jnp.integer):
        raise ValueError(
            f"key_len_BT must be an integer array of shape ({B}, {T}), got {key_len_BT.dtype}{key_len_BT.shape}"
        )


def mla_decode_attention(
    q_lat_BTHR, q_pe_BTHE, entry, key_len_BT, *, scale, kv_offset=0, return_lse=False, policy: DecodePolicy = XLA
):
    """Absorbed MLA attention of T query tokens per sequence over the latent cache -> o_lat [B, T, H, R] in q's
    dtype.

    q_lat [B, T, H, R] (W_UKᵀ q_nope), q_pe [B, T, H, E] in the compute dtype; entry: the layer's cache entry
    {"rows": [B, S, R + E] fp8 e4m3 or bf16, "scales": [B, S, 2] fp32 (fp8 only)} as k3jax.cache keeps it (read
    as stored: the kernel never dequantises the whole cache); key_len_BT [B, T]: token t sees the global
    positions below key_len[b, t] (causal decoding: its position + 1; verify: causal inside the block).

    Context parallelism: the entry's rows may be a slice holding the global positions kv_offset .. kv_offset +
    S - 1; with return_lse the op returns that slice's part (o fp32 normalised over the slice, lse [B, T, H]
    fp32, -inf where nothing was visible) and `combine` merges the slices' parts.
    """
    _check(q_lat_BTHR, q_pe_BTHE, entry, key_len_BT)
    args = (q_lat_BTHR, q_pe_BTHE, entry, key_len_BT)
    kwargs = dict(scale=scale, kv_offset=kv_offset, return_lse=return_lse)
    return policy_lib.dispatch(
        OP,
        policy,
        lambda: _kernel_op(policy)(*args, **kwargs),
        lambda: reference.mla_decode_attention(*args, **kwargs),
    )


def combine(parts, dtype=None):
    """Merge the (o fp32, lse) parts of disjoint position slices (return_lse results) into the attention over
    their union: o = Σ_i exp(lse_i - lse) o_i with lse = log Σ_i exp(lse_i). -> o in `dtype` (None: fp32)."""
    o_s = jnp.stack([o for o, _ in parts])
    lse_s = jnp.stack([lse for _, lse in parts])
    top = jnp.max(lse_s, axis=0)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    w = jnp.exp(lse_s - top)
    total = jnp.sum(w, axis=0)
    o = jnp.sum(o_s * w[..., None], axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return o if dtype is None else o.astype(dtype)


def mla_write_rows(kv_BTC, kv_norm_w_R, entry, pos_BT, valid_BT, *, eps, policy: DecodePolicy = XLA):
    """The MLA layer's new cache rows: kv_a's output [B, T, R + E] -> [RMSNorm(c) | k_pe] (kv_norm_w_R the norm's
    weight), stored at pos_BT (absolute positions) where valid_BT, quantised by the FP8 row rule for an fp8
    entry -> the new entry. One Mosaic GPU launch writing the cache in place where the policy asks for kernels
    (rows_kernel.py; the same on sm90 and sm100), else XLA's norm, quantisation and scatters (reference.py).
    A token that is not valid, or whose position is past the cache, writes nothing."""
    if not isinstance(entry, dict) or "rows" not in entry:
        raise ValueError("entry must be a cache entry dict: {'rows': [B, S, R + E]} (+ 'scales': [B, S, 2] for fp8)")
    B, T, C = kv_BTC.shape
    if entry["rows"].shape[0] != B or entry["rows"].shape[2] != C or kv_norm_w_R.shape[0] >= C:
        raise ValueError(
            f"kv [B, T, C] = {list(kv_BTC.shape)} against cache rows {list(entry['rows'].shape)} and a "
            f"norm weight of {kv_norm_w_R.shape[0]}: the cache rows must be [B, S, C], R < C"
        )
    for name, a in (("pos_BT", pos_BT), ("valid_BT", valid_BT)):
        if a.shape != (B, T):
            raise ValueError(f"{name} must have shape ({B}, {T}), one entry per new token, got {list(a.shape)}")
    args = (kv_BTC, kv_norm_w_R, entry, pos_BT, valid_BT)

    def kernel():
        name = _body_name(policy)
        if not policy.table("mla_decode")[name].get("write_rows", False):
            raise NotImplementedError(f"the rows kernel is switched off (tuning.json {name} 'write_rows': false)")
        from pallas_kernels.mla_decode import rows_kernel

        return rows_kernel.write_rows(*args, eps=eps)

    return policy_lib.dispatch(ROWS_OP, policy, kernel, lambda: reference.mla_write_rows(*args, eps=eps))
