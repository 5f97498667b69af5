"""Speculative verify and commit of KDA decode as two Mosaic GPU kernels: the maths of reference.kda_verify and
reference.kda_commit, with kernel.py's one-read algebra of a step.

verify: T = 1..8 new tokens. One CTA (one warpgroup) per (b, h), or a cluster of v_split CTAs each owning
V / v_split state columns, like kernel.py. The state tile is read from HBM once and never written. First the
O(K) vectors of every token are formed, one channel per thread, and parked in SMEM. Then the tile comes to
registers v_chunk columns at a time (columns are independent given those vectors), and all T steps run on each
piece there; the running state S_1..S_{T-1} never leaves the chip.
Per step, on the running S (kernel.py's rearrangement, one pass over S):
    delta_t = v_t - Sᵀ (e_t ⊙ k̂_t),   o_t = Sᵀ (e_t ⊙ q̂_t) + beta_t (k̂_t · q̂_t) delta_t,
    S      <- diag(e_t) S + beta_t k̂_t delta_tᵀ
It returns y for every position plus reference.kda_verify's commit data: per token k̂, decay, beta and delta,
O(T (K + V)) per head instead of T states.

commit: each state tile read once, the first accepted_B[b] rank-1 updates S <- diag(decay_t) S + beta_t k̂_t
delta_tᵀ replayed in registers (a loop of dynamic length: rejected tokens cost no FMAs, only their O(K)
vectors are read), the tile written once; the conv window slides by the accepted inputs. The commit streams
the tile HBM <-> registers by ld/st.global, the next piece's read in flight.

Verify stages the tile like that, or (tma=True) whole through 64 KiB of swizzled SMEM by one TMA load issued at
kernel start, or by its own rows path (tma="rows", steps_rows; the body's from tuning.json
"verify_rows_min_tiles" tiles on): one TMA per 32 key rows, then the whole tile in registers with thread t owning
state column t for all T steps, so both K-reductions are sums inside a thread, no cross-warp reductions (about
twice the column pieces' speed once the tiles fill the GPU, bench/results/kda_verify_rows.json).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.kda_decode import kernel
from pallas_kernels.kda_decode.kernel import CONV_TAPS, F32, LANE_PARAMS, SWIZZLED, sigmoid

MAX_T = 8  # SMEM holds 7 vectors per token; the speculative block is anchor + up to 7 drafts
_W = CONV_TAPS - 1  # cached pre-conv inputs


def check_supported(qkv_BT3HK, state_BHKV, conv_B3WHK):
    if qkv_BT3HK.ndim != 5 or not 1 <= qkv_BT3HK.shape[1] <= MAX_T:
        raise NotImplementedError(f"verify kernel needs qkv [B, T<={MAX_T}, 3, H, K], got {qkv_BT3HK.shape}")
    B, _, three, H, K = qkv_BT3HK.shape
    kernel.check_supported(jax.ShapeDtypeStruct((B, three, H, K), qkv_BT3HK.dtype), state_BHKV, conv_B3WHK)


def pick_launch(tuning, qkv_BT3HK, split=True):
    """Verify from tuning's "verify_rows_min_tiles" B*H tiles on: its own rows path (steps_rows, k_chunk 32).
    Otherwise kernel.pick_launch by the B*H tiles (the T tokens do not change how many tiles there are),
    without the per-slice TMA ("chunked", "rows") and the split over warpgroups, which only the decode kernel
    has (whole-tile TMA and one warpgroup per CTA here); split=False (commit) also drops the cluster split of V,
    the rows path and the TMA staging, which only decode and verify have."""
    B, _, three, H, K = qkv_BT3HK.shape
    launch = kernel.pick_launch(tuning, jax.ShapeDtypeStruct((B, three, H, K), qkv_BT3HK.dtype))
    if split and B * H >= tuning.get("verify_rows_min_tiles", float("inf")):  # verify's own rows path
        return dict(tile_layout=launch["tile_layout"], tma="rows", k_chunk=32)
    launch["tma"] = bool(launch["tma"])
    for key in ("warpgroups", "in_place", *kernel.ROWS_KEYS):  # decode-only launch keys
        launch.pop(key, None)
    if not split:  # the commit: one CTA per tile, the tile by ld/st.global
        del launch["v_split"], launch["gather"], launch["tma"]
    return launch


def _tile_reader(state_ref_KV, tma_scratch, tile_layout, v_chunk):
    """-> (load(c): columns [c*v_chunk, (c+1)*v_chunk) in registers, wait(): call once before the first load).

    With TMA the whole tile's load is issued here, so it is in flight during the O(K) prologue."""
    if tma_scratch:
        tile_smem, tile_bar = tma_scratch
        plgpu.copy_gmem_to_smem(state_ref_KV, tile_smem, tile_bar)
        return (
            lambda c: plgpu.load(tile_smem.at[:, pl.ds(c * v_chunk, v_chunk)], layout=tile_layout),
            lambda: plgpu.barrier_wait(tile_bar),
        )
    return (
        lambda c: plgpu.load(state_ref_KV.at[:, pl.ds(c * v_chunk, v_chunk)], layout=tile_layout, optimized=False),
        lambda: None,
    )


def _bcaster(tile_layout, K, v_chunk):
    def bcast(vec, dim):  # layout_cast tells the lowering which tile layout the broadcast must produce
        return plgpu.layout_cast(lax.broadcast_in_dim(vec, (K, v_chunk), (dim,)), tile_layout)

    return bcast


# vec_smem rows per token of the verify kernel: the four the tile steps broadcast along key rows, then
# v (read per column piece), o and delta (written per column piece).
_KD, _QD, _DECAY, _BK, _V, _O, _DELTA = range(7)


def _verify_body(*refs, tile_layout, v_chunk, eps, dtype, v_split=1, gather="gmem", fences=True, k_rows=0):
    """Inputs qkv, f, beta, gate, state, conv, conv_w, A_log, dt_bias, o_norm_w; outputs y and the commit data
    (k̂, decay, beta, delta) (+ o_xchg with v_split and gmem); scratch vec_smem, gain_smem (+ the cluster
    barrier with v_split) (+ TMA tile and barrier). With v_split, CTA s runs the T steps on its columns and
    writes their delta; CTA 0 writes the per-token vectors and, after gathering o as kernel.py does, y.
    k_rows > 0: the tile comes by one TMA per slice of k_rows rows and stays in registers, thread t owning
    state column t, for all T steps (steps_rows)."""
    qkv_ref, f_ref, beta_ref, gate_ref, state_ref, conv_ref, w_ref, alog_ref, dtb_ref, onw_ref = refs[:10]
    y_ref, kn_ref, decay_ref, beta_out_ref, delta_ref, *rest = refs[10:]
    split = v_split > 1
    o_xchg_ref = rest.pop(0) if split and gather == "gmem" else None
    vec_smem, gain_smem, *rest = rest
    xchg_bar = rest.pop(0) if split else None
    tma_scratch = rest
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    s = lax.axis_index("s") if split else 0
    T, _, K = vec_smem.shape
    V = state_ref.shape[-1]
    Vs = V // v_split
    col0 = s * Vs  # this CTA's first state column
    row_layout, col_layout = tile_layout.reduce(1), tile_layout.reduce(0)
    # O(K) work of every token (docs/model.md §4.2, §4.3), thread t owning channel t. Token t convolves the 3 pre-conv
    # inputs before it: the cached window, then the new tokens themselves.
    # Every GMEM load of every token first (the norm's too): a load written after a GMEM store (the commit
    # vectors below, y) waits for that store, as far as the compiler knows, so per-token loads would cost one
    # HBM round trip per token twice over.
    taps = [[plgpu.load(w_ref.at[i, h, :, j]) for j in range(CONV_TAPS)] for i in range(3)]
    inputs = [
        [conv_ref.at[b, i, j, h][...] for j in range(_W)] + [qkv_ref.at[b, t, i, h][...] for t in range(T)]
        for i in range(3)
    ]  # per stream: the cached window, oldest first, then the T new tokens
    f_T = [f_ref.at[b, t, h][...] for t in range(T)]
    beta_T = [beta_ref[b, t, h] for t in range(T)]
    gate_T = [gate_ref.at[b, t, h][...] for t in range(T)]
    a_log, dt_bias, onw = alog_ref[h], dtb_ref.at[h][...], onw_ref[...]
    # then the state's read: issued after these small loads so they do not queue behind a whole wave's state
    # traffic (as in kernel.py)
    if k_rows:
        tile_smem, tile_bar = tma_scratch
        for c in range(K // k_rows):  # one TMA per row slice: contiguous in GMEM and SMEM alike
            plgpu.copy_gmem_to_smem(state_ref.at[b, h, pl.ds(c * k_rows, k_rows)], tile_smem.at[c], tile_bar.at[c])
    else:
        load_state, wait_state = _tile_reader(state_ref.at[b, h, :, pl.ds(col0, Vs)], tma_scratch, tile_layout, v_chunk)
        S_next = None if tma_scratch else load_state(0)  # the first ld.global read hides behind the prologue
    for t in range(T):
        x = []
        for i in range(3):
            y = sum(w * u.astype(F32) for w, u in zip(taps[i], inputs[i][t : t + CONV_TAPS], strict=True))
            x.append((y * sigmoid(y)).astype(dtype).astype(F32))
        q, k, v = x
        g = -5.0 * sigmoid(jnp.exp(a_log) * (f_T[t].astype(F32) + dt_bias))
        beta = sigmoid(beta_T[t].astype(F32))
        qn = q * lax.rsqrt(jnp.sum(q * q) + 1e-6) * (K**-0.5)
        kn = k * lax.rsqrt(jnp.sum(k * k) + 1e-6)
        decay = jnp.exp(g)

        def commit_vectors(t=t, kn=kn, decay=decay, beta=beta):
            kn_ref.at[b, t, h][...] = kn
            decay_ref.at[b, t, h][...] = decay
            beta_out_ref[b, t, h] = beta

        if split:
            pl.when(s == 0)(commit_vectors)
        else:
            commit_vectors()
        vec_smem.at[t, _KD][...] = decay * kn
        vec_smem.at[t, _QD][...] = decay * qn
        vec_smem.at[t, _DECAY][...] = decay
        vec_smem.at[t, _BK][...] = beta * kn
        vec_smem.at[t, _V][...] = v
        gain_smem[t] = beta * jnp.sum(kn * qn)

    bcast = _bcaster(tile_layout, K, v_chunk)

    def rows(t, i):
        return bcast(plgpu.load(vec_smem.at[t, i], layout=row_layout), 0)

    if not split:
        o_rows = vec_smem.at[:, _O]
    elif gather == "dsmem":
        o_rows = plgpu.cluster_ref(vec_smem, {"s": 0}).at[:, _O]
    else:
        o_rows = o_xchg_ref.at[b, :, h]

    def step(cols, t, S_KC):  # token t on one column piece of the running state
        delta_C = plgpu.load(vec_smem.at[t, _V, cols], layout=col_layout) - jnp.sum(S_KC * rows(t, _KD), 0)
        o_C = jnp.sum(S_KC * rows(t, _QD), axis=0) + gain_smem[t] * delta_C
        o_rows.at[t, cols][...] = o_C.astype(dtype).astype(F32)
        if split:  # this CTA's columns of delta straight out; one CTA writes whole rows below
            delta_ref.at[b, t, h, cols][...] = delta_C
        else:
            vec_smem.at[t, _DELTA, cols][...] = delta_C
        return S_KC * rows(t, _DECAY) + rows(t, _BK) * bcast(delta_C, 1)  # unused after the last token

    # The T steps (§4.4): the rows path unrolls them on the tile it holds in registers; otherwise on each column
    # piece of the tile, the next piece's read in flight meanwhile, in a loop over tokens, not unrolled (the
    # code stays the size of the decode kernel's).
    if k_rows:
        steps_rows(*tma_scratch, vec_smem, gain_smem, dtype)
    else:
        wait_state()
        if tma_scratch:
            S_next = load_state(0)
        n_chunks = Vs // v_chunk
        for c in range(n_chunks):
            S_KC = S_next
            if c + 1 < n_chunks:
                S_next = load_state(c + 1)
            lax.fori_loop(0, T, functools.partial(step, pl.ds(col0 + c * v_chunk, v_chunk)), S_KC)

    # Gated RMSNorm (§4.6) per token, and delta out as whole coalesced rows.
    def norm_rows():
        o_src = o_xchg_ref.at[b, :, h] if split and gather == "gmem" else vec_smem.at[:, _O]
        for t in range(T):
            o = o_src.at[t][...]
            n = o * lax.rsqrt(jnp.sum(o * o) * (1.0 / K) + eps) * onw
            y_ref.at[b, t, h][...] = (n * sigmoid(gate_T[t].astype(F32))).astype(dtype)
            if not split:
                delta_ref.at[b, t, h][...] = vec_smem.at[t, _DELTA][...]

    if split:
        common.cluster_sync(xchg_bar, fences)
        pl.when(s == 0)(norm_rows)
    else:
        norm_rows()


def steps_rows(tile_smem, tile_bar, vec_smem, gain_smem, dtype):
    """The T steps with thread t owning state column t (kernel._recurrence_rows' layout): the whole tile, one
    [V] row per key channel, stays in registers (K of them) from the first step to the last, and both
    K-reductions of a step are sums inside each thread over scalars broadcast from SMEM: no shuffles, no
    cross-warp barriers, where the column-piece path pays two cross-warp reductions per token per piece.
    The sums run one chain per slice (independent FMA chains), as kernel._recurrence_rows does."""
    n, rows = tile_smem.shape[:2]
    T = vec_smem.shape[0]
    S = []
    for c in range(n):
        plgpu.barrier_wait(tile_bar.at[c])
        S += [tile_smem.at[c, j][...] for j in range(rows)]

    def reduced(t, i):  # Sᵀ vec_smem[t, i] as one partial sum per slice, then their total
        parts = []
        for c in range(n):
            acc = S[c * rows] * vec_smem[t, i, c * rows]
            for j in range(c * rows + 1, (c + 1) * rows):
                acc = acc + S[j] * vec_smem[t, i, j]
            parts.append(acc)
        return functools.reduce(lambda a, p: a + p, parts)

    for t in range(T):
        delta = vec_smem.at[t, _V][...] - reduced(t, _KD)
        vec_smem.at[t, _O][...] = (reduced(t, _QD) + gain_smem[t] * delta).astype(dtype).astype(F32)
        vec_smem.at[t, _DELTA][...] = delta
        if t + 1 < T:  # the last token's state is never needed: verify leaves S as it was
            S = [S[j] * vec_smem[t, _DECAY, j] + vec_smem[t, _BK, j] * delta for j in range(len(S))]


def _tma_scratch(tma, K, V, k_chunk=32):
    """tma=True: the whole tile (or a CTA's V columns of it) in 128-byte swizzled SMEM + barrier; "rows": row
    slices [K / k_chunk, k_chunk, V], unswizzled (a thread's column is one bank), a barrier each."""
    if tma == "rows":
        return [plgpu.SMEM((K // k_chunk, k_chunk, V), F32), plgpu.Barrier(num_barriers=K // k_chunk)]
    return [plgpu.SMEM((K, V), F32, transforms=SWIZZLED), plgpu.Barrier()] if tma else []


def _check_chunk(V, v_chunk, tma, v_split=1, gather="gmem", interpret=None, K=128, k_chunk=32):
    if tma == "rows":
        if v_split > 1 or V != 128 or K % k_chunk:
            raise NotImplementedError(
                f"tma='rows' takes one CTA per tile, a thread per state column (V = 128) "
                f"and k_chunk dividing K: v_split={v_split}, V={V}, K={K}, "
                f"k_chunk={k_chunk}"
            )
        return
    if V % v_split or (V // v_split) % v_chunk or v_chunk % (32 if tma else 8):
        raise NotImplementedError(f"v_chunk={v_chunk}, v_split={v_split} do not tile V={V} (tma={tma})")
    if gather not in ("gmem", "dsmem") or (gather == "dsmem" and interpret is not None):
        raise NotImplementedError(f"gather={gather!r}: GPU interpret mode has no peer-SMEM stores, use 'gmem'")


@functools.partial(
    jax.jit, static_argnames=("eps", "tile_layout", "v_chunk", "tma", "v_split", "gather", "interpret", "k_chunk")
)
def verify(
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
    eps,
    tile_layout,
    v_chunk=32,
    tma=False,
    v_split=1,
    gather="gmem",
    interpret=None,
    k_chunk=32,
):
    """-> (y_BTHK, commit_data) as reference.kda_verify; state_BHKV is only read. v_split, gather: kernel.decode's
    cluster split of V (the T steps on a CTA's columns are the serial chain it shortens). tma="rows": the tile
    by one TMA per k_chunk rows, held in registers a column per thread for all T steps (steps_rows)."""
    B, T, _, H, K = qkv_BT3HK.shape
    V = state_BHKV.shape[-1]
    _check_chunk(V, v_chunk, tma, v_split, gather, interpret, K, k_chunk)
    dtype = qkv_BT3HK.dtype
    out_type = [
        jax.ShapeDtypeStruct((B, T, H, K), dtype),
        jax.ShapeDtypeStruct((B, T, H, K), F32),
        jax.ShapeDtypeStruct((B, T, H, K), F32),
        jax.ShapeDtypeStruct((B, T, H), F32),
        jax.ShapeDtypeStruct((B, T, H, V), F32),
    ]
    scratch = [plgpu.SMEM((T, 7, K), F32), plgpu.SMEM((T,), F32)]
    cluster = {}
    if v_split > 1:
        if gather == "gmem":
            out_type.append(jax.ShapeDtypeStruct((B, T, H, V), F32))
        scratch.append(plgpu.ClusterBarrier(collective_axes=("s",), num_arrivals=1))
        cluster = dict(cluster=(v_split,), cluster_names=("s",))
    kernel_fn = plgpu.kernel(
        functools.partial(
            _verify_body,
            tile_layout=tile_layout,
            v_chunk=v_chunk,
            eps=eps,
            dtype=dtype,
            v_split=v_split,
            gather=gather,
            fences=interpret is None,
            k_rows=k_chunk if tma == "rows" else 0,
        ),
        out_type=tuple(out_type),
        scratch_types=[*scratch, *_tma_scratch(tma, K, V // v_split, k_chunk)],
        grid=(B, H),
        grid_names=("b", "h"),
        **cluster,
        compiler_params=LANE_PARAMS,
        interpret=interpret,
    )
    y, kn, decay, beta, delta, *_ = kernel_fn(
        qkv_BT3HK,
        f_BTHK,
        beta_BTH,
        gate_BTHK,
        state_BHKV,
        conv_B3WHK,
        conv_w_3HKW.astype(F32),
        A_log_H.astype(F32),
        dt_bias_HK.astype(F32),
        o_norm_w_K.astype(F32),
    )
    return y, dict(kn_BTHK=kn, decay_BTHK=decay, beta_BTH=beta, delta_BTHV=delta, new_inputs_BT3HK=qkv_BT3HK)


def _commit_body(
    accepted_ref,
    state_ref,
    conv_ref,
    qkv_ref,
    kn_ref,
    decay_ref,
    beta_ref,
    delta_ref,
    new_state_ref,
    new_conv_ref,
    vec_smem,
    window_smem,
    *,
    tile_layout,
    v_chunk,
):
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    T, _, K = vec_smem.shape
    V = state_ref.shape[-1]
    row_layout, col_layout = tile_layout.reduce(1), tile_layout.reduce(0)
    load_state, _ = _tile_reader(state_ref.at[b, h], (), tile_layout, v_chunk)
    S_next = load_state(0)
    n = jnp.maximum(jnp.minimum(accepted_ref[b], T), 0)  # also keeps the window index in range

    # All T tokens' vectors, unrolled so their reads overlap (a loop to n would chain T HBM latencies).
    for t in range(T):
        vec_smem.at[t, 0][...] = decay_ref.at[b, t, h][...]
        vec_smem.at[t, 1][...] = beta_ref[b, t, h] * kn_ref.at[b, t, h][...]
        vec_smem.at[t, 2][...] = delta_ref.at[b, t, h][...]

    # Conv window: the last 3 of (old window + n accepted inputs), i.e. positions n..n+2 of the W + T
    # pre-conv inputs; SMEM makes the dynamic position an index (each thread reads back its own channel).
    for i in range(3):
        for j in range(_W):
            window_smem.at[i, j][...] = conv_ref.at[b, i, j, h][...]
        for t in range(T):
            window_smem.at[i, _W + t][...] = qkv_ref.at[b, t, i, h][...]
        for j in range(_W):
            new_conv_ref.at[b, i, j, h][...] = window_smem.at[i, n + j][...]

    bcast = _bcaster(tile_layout, K, v_chunk)

    def step(cols, t, S_KC):  # S <- diag(decay_t) S + (beta_t k̂_t) delta_tᵀ on one column piece
        decay_r = bcast(plgpu.load(vec_smem.at[t, 0], layout=row_layout), 0)
        bk = bcast(plgpu.load(vec_smem.at[t, 1], layout=row_layout), 0)
        delta_C = plgpu.load(vec_smem.at[t, 2, cols], layout=col_layout)
        return S_KC * decay_r + bk * bcast(delta_C, 1)

    for c in range(V // v_chunk):
        S_KC = S_next
        if c + 1 < V // v_chunk:
            S_next = load_state(c + 1)
        cols = pl.ds(c * v_chunk, v_chunk)
        new_state_ref.at[b, h, :, cols][...] = lax.fori_loop(0, n, functools.partial(step, cols), S_KC)


@functools.partial(jax.jit, static_argnames=("tile_layout", "v_chunk", "interpret"))
def commit(state_BHKV, conv_B3WHK, commit_data, accepted_B, *, tile_layout, v_chunk=32, interpret=None):
    """-> (new_state_BHKV, new_conv_B3WHK) as reference.kda_commit: accepted_B[b] in [0, T] tokens. The tile
    streams HBM <-> registers by ld/st.global, v_chunk columns at a time, the next piece's read in flight."""
    qkv_BT3HK = commit_data["new_inputs_BT3HK"]
    B, T, _, H, K = qkv_BT3HK.shape
    V = state_BHKV.shape[-1]
    _check_chunk(V, v_chunk, False)
    kernel_fn = plgpu.kernel(
        functools.partial(_commit_body, tile_layout=tile_layout, v_chunk=v_chunk),
        out_type=(
            jax.ShapeDtypeStruct(state_BHKV.shape, F32),
            jax.ShapeDtypeStruct(conv_B3WHK.shape, conv_B3WHK.dtype),
        ),
        scratch_types=[
            plgpu.SMEM((T, 3, K), F32),
            plgpu.SMEM((3, _W + T, K), conv_B3WHK.dtype),
        ],
        grid=(B, H),
        grid_names=("b", "h"),
        compiler_params=LANE_PARAMS,
        interpret=interpret,
    )
    return kernel_fn(
        accepted_B.astype(jnp.int32),
        state_BHKV,
        conv_B3WHK,
        qkv_BT3HK.astype(conv_B3WHK.dtype),
        commit_data["kn_BTHK"],
        commit_data["decay_BTHK"],
        commit_data["beta_BTH"],
        commit_data["delta_BTHV"],
    )
