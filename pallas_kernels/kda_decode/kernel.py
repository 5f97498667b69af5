"""The fused KDA decode step as one Mosaic GPU kernel; sm90.py and sm100.py pick register layout and tuning.

One CTA (one warpgroup, 128 threads) per (b, h). The step is state-bandwidth bound: each 128 x 128 fp32 state
tile (64 KiB) is read once and written once, straight between HBM and registers; everything else is O(K).

One read of S is enough because the update is linear in S (decay on key rows, rank-1 write):
    delta = v - (diag(e) S)ᵀ k̂          = v - Sᵀ (e ⊙ k̂)
    o     = S_newᵀ q̂                    = Sᵀ (e ⊙ q̂) + beta (k̂ · q̂) delta
    S_new = diag(e) S + beta k̂ deltaᵀ   with e = exp(g)
so the two K-reductions Sᵀ kd and Sᵀ qd run on the loaded tile, and S_new is formed and stored from the same
registers. The O(K) work (conv window, SiLU, gate, beta, L2 norms) runs with thread t owning channel t
(WG_STRIDED layout), and its results reach the tile layout through a 3 KiB SMEM buffer.

Shapes it handles: K = V = 128 (the release), any B and H, bf16 or f32 compute dtype; anything else raises
NotImplementedError so the api falls back to the reference.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
_CONV_TAPS = 4
_LANE = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def check_supported(qkv_B3HK, state_BHKV, conv_B3WHK):
    B, three, H, K = qkv_B3HK.shape
    if three != 3 or state_BHKV.shape != (B, H, K, K) or conv_B3WHK.shape != (B, 3, _CONV_TAPS - 1, H, K):
        raise NotImplementedError(f"unexpected shapes qkv={qkv_B3HK.shape} state={state_BHKV.shape} "
                                  f"conv={conv_B3WHK.shape}")
    if K != 128:
        raise NotImplementedError(f"kernel needs K = V = 128 (one channel per thread), got {K}")
    if qkv_B3HK.dtype not in (jnp.bfloat16, jnp.float32) or state_BHKV.dtype != F32:
        raise NotImplementedError(f"dtypes {qkv_B3HK.dtype}/{state_BHKV.dtype} not handled")


def pick_launch(tuning, qkv_B3HK):
    """The first launch entry of a tuning.json body whose max_tiles (null = any) covers the B*H tiles."""
    tiles = qkv_B3HK.shape[0] * qkv_B3HK.shape[2]
    entry = next(e for e in tuning["launch"] if e["max_tiles"] is None or tiles <= e["max_tiles"])
    return dict(tile_layout=getattr(plgpu.Layout, tuning["layout"]), v_chunk=entry["v_chunk"], tma=entry["tma"])


def _body(qkv_ref, f_ref, beta_ref, gate_ref, state_ref, conv_ref, w_ref, alog_ref, dtb_ref, onw_ref,
          y_ref, new_state_ref, new_conv_ref, vec_smem, *tma_scratch, tile_layout, v_chunk, eps, dtype):
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    K = vec_smem.shape[-1]
    V = new_state_ref.shape[-1]
    row_layout, col_layout = tile_layout.reduce(1), tile_layout.reduce(0)

    if tma_scratch:  # the whole tile HBM -> SMEM by one TMA, issued first: in flight during the prologue
        tile_smem, tile_bar = tma_scratch
        plgpu.copy_gmem_to_smem(state_ref.at[b, h], tile_smem, tile_bar)

    def load_state(c):  # columns [c*v_chunk, (c+1)*v_chunk) into registers
        cols = pl.ds(c * v_chunk, v_chunk)
        if tma_scratch:  # swizzled SMEM -> WGMMA layout: the conflict-free path of matmul epilogues
            return plgpu.load(tile_smem.at[:, cols], layout=tile_layout)
        return plgpu.load(state_ref.at[b, h, :, cols], layout=tile_layout, optimized=False)  # ld.global

    # Without TMA, issue the first state read before the O(K) prologue, which then hides its latency.
    S_next = None if tma_scratch else load_state(0)

    # Short conv + SiLU for q, k, v (§4.2); thread t owns channel t.
    x = []
    for i in range(3):
        window = [conv_ref.at[b, i, j, h][...] for j in range(_CONV_TAPS - 1)] + [qkv_ref.at[b, i, h][...]]
        y = sum(plgpu.load(w_ref.at[i, h, :, j]) * u.astype(F32) for j, u in enumerate(window))
        x.append((y * _sigmoid(y)).astype(dtype).astype(F32))
        for j in range(_CONV_TAPS - 1):  # the window slides by one: keep the newest three pre-conv inputs
            new_conv_ref.at[b, i, j, h][...] = window[j + 1]
    q, k, v = x

    # Gate, beta, L2 norms (§4.3).
    g = -5.0 * _sigmoid(jnp.exp(alog_ref[h]) * (f_ref.at[b, h][...].astype(F32) + dtb_ref.at[h][...]))
    beta = _sigmoid(beta_ref[b, h].astype(F32))
    qn = q * lax.rsqrt(jnp.sum(q * q) + 1e-6) * (K ** -0.5)
    kn = k * lax.rsqrt(jnp.sum(k * k) + 1e-6)
    decay = jnp.exp(g)
    vec_smem.at[0][...] = decay * kn
    vec_smem.at[1][...] = decay * qn
    vec_smem.at[2][...] = decay
    vec_smem.at[3][...] = beta * kn
    vec_smem.at[4][...] = v
    o_gain = beta * jnp.sum(kn * qn)

    tile = (K, v_chunk)

    def bcast(vec, dim):  # layout_cast tells the lowering which tile layout the broadcast must produce
        return plgpu.layout_cast(lax.broadcast_in_dim(vec, tile, (dim,)), tile_layout)

    kd, qd, decay_r, bk = (bcast(plgpu.load(vec_smem.at[i], layout=row_layout), 0) for i in range(4))
    if tma_scratch:
        plgpu.barrier_wait(tile_bar)
        S_next = load_state(0)

    # Recurrence (§4.4) from one read of S, v_chunk columns at a time (columns are independent given k̂, q̂),
    # the next chunk's read in flight while this one is reduced and written.
    for c in range(V // v_chunk):
        S_KC = S_next
        if c + 1 < V // v_chunk:
            S_next = load_state(c + 1)
        cols = pl.ds(c * v_chunk, v_chunk)
        delta_C = plgpu.load(vec_smem.at[4, cols], layout=col_layout) - jnp.sum(S_KC * kd, axis=0)
        o_C = jnp.sum(S_KC * qd, axis=0) + o_gain * delta_C
        S_new = S_KC * decay_r + bk * bcast(delta_C, 1)
        if tma_scratch:  # in place in SMEM, then one TMA store of the tile
            tile_smem.at[:, cols][...] = S_new
        else:
            new_state_ref.at[b, h, :, cols][...] = S_new
        vec_smem.at[5, cols][...] = o_C.astype(dtype).astype(F32)
    if tma_scratch:
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(tile_smem, new_state_ref.at[b, h])

    # Gated RMSNorm (§4.6): o rounded to the compute dtype, then fp32 to one final rounding.
    o = vec_smem.at[5][...]
    n = o * lax.rsqrt(jnp.sum(o * o) * (1.0 / K) + eps) * onw_ref[...]
    y_ref.at[b, h][...] = (n * _sigmoid(gate_ref.at[b, h][...].astype(F32))).astype(dtype)
    if tma_scratch:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM must outlive the store's reads, not its writes


# f32 tile in 128-byte swizzled (8, 32) tiles: TMA writes it, WGMMA-layout loads/stores hit no bank conflicts.
_SWIZZLED = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


@functools.partial(jax.jit, static_argnames=("eps", "tile_layout", "v_chunk", "tma", "interpret"))
def decode(qkv_B3HK, f_BHK, beta_BH, gate_BHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H, dt_bias_HK,
           o_norm_w_K, *, eps, tile_layout, v_chunk=128, tma=False, interpret=None):
    """The state tile streams straight HBM <-> registers in v_chunk column pieces, or (tma=True) is staged
    whole through 64 KiB of SMEM by TMA, which keeps it in flight without holding registers."""
    B, _, H, K = qkv_B3HK.shape
    V = state_BHKV.shape[-1]
    if V % v_chunk or v_chunk % (32 if tma else 8):
        raise NotImplementedError(f"v_chunk={v_chunk} does not tile V={V} (tma={tma})")
    dtype = qkv_B3HK.dtype
    scratch = [plgpu.SMEM((6, K), F32)]
    if tma:
        scratch += [plgpu.SMEM((K, V), F32, transforms=_SWIZZLED), plgpu.Barrier()]
    kernel = plgpu.kernel(
        functools.partial(_body, tile_layout=tile_layout, v_chunk=v_chunk, eps=eps, dtype=dtype),
        out_type=(jax.ShapeDtypeStruct((B, H, K), dtype), jax.ShapeDtypeStruct(state_BHKV.shape, F32),
                  jax.ShapeDtypeStruct(conv_B3WHK.shape, dtype)),
        scratch_types=scratch,
        grid=(B, H), grid_names=("b", "h"),
        compiler_params=_LANE, interpret=interpret,
    )
    return kernel(qkv_B3HK, f_BHK, beta_BH, gate_BHK, state_BHKV, conv_B3WHK, conv_w_3HKW.astype(F32),
                  A_log_H.astype(F32), dt_bias_HK.astype(F32), o_norm_w_K.astype(F32))
