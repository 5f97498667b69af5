"""MLA decode attention in plain XLA (docs/model.md §5.3): the weight-absorbed core over the latent cache.

Glossary: B batch, T query tokens per sequence, H local heads, R latent rank (512), E rope dim (64), S cached
positions, C = R + E the cached row. The queries come absorbed (q_lat = W_UKᵀ q_nope, done by the caller), the
value is the latent itself, and the output stays latent-width (the caller applies W_UV):

    score_s[h] = (q_lat[h] · c_s + q_pe[h] · k_pe_s) · scale       over the positions s < key_len
    o_lat[h]   = Σ_s softmax(score)[h]_s · c_s

This is the model's XLA path (it was the core of k3jax.layers.mla.mla_cached): the cache dequantised to the
compute dtype, bf16 GEMMs with fp32 sums (common.dot), the softmax in fp32, the probabilities rounded to the
compute dtype before P·V (§5.2's eager numerics), the output rounded once.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.common import dot, rms_norm

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


# ----------------------------------------------------------------------------- the new rows into the cache
def latent_rows(kv_BTC, kv_norm_w_R, eps):
    """kv_a's output [B, T, R + E] -> the cache rows [RMSNorm(c) | k_pe] in its dtype (k_pe neither normalised
    nor rotated: NoPE)."""
    R = kv_norm_w_R.shape[0]
    return jnp.concatenate([rms_norm(kv_BTC[..., :R], kv_norm_w_R, eps), kv_BTC[..., R:]], axis=-1)


def quantize_rows(rows_BTC, R: int):
    """The FP8 row rule (k3jax.cache): c = rows[..., :R] and k_pe = rows[..., R:] each get the fp32 scale
    max|x| / 448 (at least 1e-30), so each uses e4m3's whole range and nothing saturates; the codes are x / scale
    rounded to e4m3. -> (codes [..., C] fp8, scales [..., 2] fp32)."""

    def q(v):
        scale = jnp.maximum(jnp.max(jnp.abs(v.astype(F32)), axis=-1, keepdims=True) / FP8_MAX, 1e-30)
        return (v.astype(F32) / scale).astype(FP8), scale

    qc, sc = q(rows_BTC[..., :R])
    qp, sp = q(rows_BTC[..., R:])
    return jnp.concatenate([qc, qp], axis=-1), jnp.concatenate([sc, sp], axis=-1)


def write_rows(entry: dict, rows_BTC, pos_BT, valid_BT, R: int) -> dict:
    """The rows stored at their absolute positions (quantised where the entry is fp8); a token that is not valid,
    or whose position is past the cache, writes nothing."""
    S = entry["rows"].shape[1]
    pos = jnp.where(valid_BT, pos_BT, S)  # out of range -> dropped
    b = jnp.arange(rows_BTC.shape[0])[:, None]
    out = dict(entry)
    if "scales" in entry:
        q, s = quantize_rows(rows_BTC, R)
        out["rows"] = entry["rows"].at[b, pos].set(q, mode="drop")
        out["scales"] = entry["scales"].at[b, pos].set(s, mode="drop")
    else:
        out["rows"] = entry["rows"].at[b, pos].set(rows_BTC.astype(entry["rows"].dtype), mode="drop")
    return out


def mla_write_rows(kv_BTC, kv_norm_w_R, entry, pos_BT, valid_BT, *, eps):
    """The op's reference: latent_rows of kv_a's output, written into the layer's cache entry -> the new entry."""
    return write_rows(entry, latent_rows(kv_BTC, kv_norm_w_R, eps), pos_BT, valid_BT, kv_norm_w_R.shape[0])


# ----------------------------------------------------------------------------- attention over the cache


def dequantize(entry: dict, R: int, dtype):
    """The cache entry's rows [B, S, C] in `dtype`: fp8 rows times their two per-row scales (c[:R], k_pe[R:]),
    or the rows as stored (quantize_rows' inverse; k3jax.cache.read_rows is this)."""
    rows = entry["rows"]
    if "scales" not in entry:
        return rows.astype(dtype)
    sc = entry["scales"]
    f = rows.astype(F32)
    return jnp.concatenate([f[..., :R] * sc[..., :1], f[..., R:] * sc[..., 1:]], axis=-1).astype(dtype)


def local_lengths(key_len_BT, kv_offset, S):
    """How many of this entry's rows (global positions kv_offset .. kv_offset + S - 1) each token sees."""
    return jnp.clip(key_len_BT - kv_offset, 0, S).astype(jnp.int32)


def mla_decode_attention(q_lat_BTHR, q_pe_BTHE, entry, key_len_BT, *, scale, kv_offset=0, return_lse=False):
    """-> o_lat [B, T, H, R] in q's dtype. key_len_BT[b, t]: token t of sequence b sees the global positions
    below it (causal decoding: its own position + 1; any visibility prefix works, which verify uses).

    The entry's rows hold the global positions kv_offset .. kv_offset + S - 1 (a context-parallel slice). With
    return_lse the result is this slice's part: (o_lat fp32 normalised over the slice, lse [B, T, H] fp32 =
    log Σ_s exp(score_s), -inf where the slice holds no visible position, whose o is 0); `combine` in api.py
    merges the parts of several slices."""
    dtype = q_lat_BTHR.dtype
    R = q_lat_BTHR.shape[-1]
    rows_BSC = dequantize(entry, R, dtype)
    S = rows_BSC.shape[1]
    c_BSR, k_pe_BSE = rows_BSC[..., :R], rows_BSC[..., R:]
    s_BHTS = (dot("bthr,bsr->bhts", q_lat_BTHR, c_BSR) + dot("bthe,bse->bhts", q_pe_BTHE, k_pe_BSE)) * scale
    lens_BT = local_lengths(key_len_BT, kv_offset, S)
    mask = jnp.arange(S)[None, None, None, :] < lens_BT[:, None, :, None]
    s_BHTS = jnp.where(mask, s_BHTS, -jnp.inf)
    if not return_lse:
        probs = jax.nn.softmax(s_BHTS, axis=-1).astype(dtype)
        return dot("bhts,bsr->bthr", probs, c_BSR).astype(dtype)
    m = jnp.max(s_BHTS, axis=-1, keepdims=True)
    m = jnp.where(m == -jnp.inf, 0.0, m)  # a slice with nothing visible: p = 0, lse = -inf
    p = jnp.exp(s_BHTS - m)
    l_BHT1 = jnp.sum(p, axis=-1, keepdims=True)
    o = dot("bhts,bsr->bthr", p / jnp.where(l_BHT1 > 0, l_BHT1, 1.0), c_BSR.astype(F32))
    lse = (m + jnp.log(l_BHT1))[..., 0]  # [B, H, T]
    return o, jnp.swapaxes(lse, 1, 2)
