"""The fused KDA decode step as one Mosaic GPU kernel; sm90.py and sm100.py pick register layout and tuning.

One CTA (one warpgroup, 128 threads) per (b, h), or at small B*H its columns split over a cluster of CTAs
(v_split) or over the warpgroups of the CTA (warpgroups; see decode). The step is state-bandwidth bound: each
128 x 128 fp32 state tile (64 KiB) is read once and written once; everything else is O(K).

One read of S is enough because the update is linear in S (decay on key rows, rank-1 write):
    delta = v - (diag(e) S)ᵀ k̂          = v - Sᵀ (e ⊙ k̂)
    o     = S_newᵀ q̂                    = Sᵀ (e ⊙ q̂) + beta (k̂ · q̂) delta
    S_new = diag(e) S + beta k̂ deltaᵀ   with e = exp(g)
so the two K-reductions Sᵀ kd and Sᵀ qd run on the loaded tile, and S_new is formed and stored from the same
registers. The O(K) work (conv window, SiLU, gate, beta, L2 norms) runs with thread t owning channel t
(WG_STRIDED layout), and its results reach the tile layout through a 3 KiB SMEM buffer.

Two tile paths: column slices in the body's register layout (WGMMA on sm90), reduced across threads
(_recurrence; at small B*H, where one CTA's chain is the time), or row slices with thread t owning state
column t, reduced inside each thread (tma="rows", _recurrence_rows; the faster one once the tiles fill the GPU).

Shapes it handles: K = V = 128 (the release), any B and H, bf16 or f32 compute dtype; anything else raises
NotImplementedError so the api falls back to the reference.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common

F32 = jnp.float32
CONV_TAPS = 4
LANE_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


# f32 per warpgroup, as Pallas's default (2 KiB): a [K, 32] chunk's column sum runs in two rounds of two of its
# four 1 KiB register groups; more buys nothing and then costs occupancy (kda_red_scratch.json@721adb5)
RED_SCRATCH = 512


def _sum(x, axis=None, *, scratch=None, tile_layout=None):
    """jnp.sum(x, axis): axis None sums a whole WG_STRIDED vector to a scalar, axis 0 or 1 reduces a
    tile_layout tile. With scratch (a split over warpgroups, on a GPU) the same reduction in Mosaic GPU through
    this warpgroup's own SMEM: Pallas's lowering gives all warpgroups of a CTA one reduction scratch (they
    would race on it) and refuses whole-vector sums once there are several."""
    if scratch is None:
        return jnp.sum(x, axis)
    if axis is None:
        layout = plgpu.Layout.WG_STRIDED(x.shape, vec_size=1)
        out = plgpu.ShapeDtypeStruct((), x.dtype, layout=plgpu.Layout.WG_SPLAT(()))
    else:
        layout = tile_layout
        out = plgpu.ShapeDtypeStruct((x.shape[1 - axis],), x.dtype, layout=layout.reduce(axis))

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType()), return_type=out)
    def reduce(ctx, x, scratch):
        del ctx
        return x.reduce("add", tuple(range(len(x.shape))) if axis is None else axis, scratch)

    return reduce(x, scratch)


def check_supported(qkv_B3HK, state_BHKV, conv_B3WHK):
    """qkv_B3HK: [B, 3, H, K], or the layer's whole qkvg [B, 4, H, K] (the kernel then reads the gate from it)."""
    B, three, H, K = qkv_B3HK.shape
    if three not in (3, 4) or state_BHKV.shape != (B, H, K, K) or conv_B3WHK.shape != (B, 3, CONV_TAPS - 1, H, K):
        raise NotImplementedError(
            f"unexpected shapes qkv={qkv_B3HK.shape} state={state_BHKV.shape} conv={conv_B3WHK.shape}"
        )
    if K != 128:
        raise NotImplementedError(f"kernel needs K = V = 128 (one channel per thread), got {K}")
    if qkv_B3HK.dtype not in (jnp.bfloat16, jnp.float32) or state_BHKV.dtype != F32:
        raise NotImplementedError(f"dtypes {qkv_B3HK.dtype}/{state_BHKV.dtype} not handled")


TMA_STAGINGS = (False, "chunked", "rows")  # the state by ld/st.global, by one TMA per column or per row slice
ROWS_KEYS = ("k_chunk", "keep_slices")  # launch keys of tma="rows" only (see _recurrence_rows)


def pick_launch(tuning, qkv_B3HK):
    """The first launch entry of a tuning.json body whose max_tiles (null = any) covers the B*H tiles."""
    tiles = qkv_B3HK.shape[0] * qkv_B3HK.shape[2]
    entry = next(e for e in tuning["launch"] if e["max_tiles"] is None or tiles <= e["max_tiles"])
    return dict(
        tile_layout=getattr(plgpu.Layout, tuning["layout"]),
        v_chunk=entry.get("v_chunk", 32),
        tma=entry["tma"],
        v_split=entry.get("v_split", 1),
        gather=entry.get("gather", "gmem"),
        warpgroups=entry.get("warpgroups", 1),
        in_place=tuning.get("state_in_place", False),
        **{key: entry[key] for key in ROWS_KEYS if key in entry},
    )


def _body(
    *refs,
    tile_layout,
    v_chunk,
    eps,
    dtype,
    fuse_gates=False,
    from_gemv=False,
    chunked=False,
    v_split=1,
    gather="gmem",
    warpgroups=1,
    idle_mask=False,
    on_gpu=True,
    k_rows=0,
    keep_slices=0,
    in_place=False,
):
    """One CTA per (b, h), its columns split over its warpgroups (warpgroups > 1, WG s owning state columns
    [s V/warpgroups, (s+1) V/warpgroups), o gathered in WG 0's SMEM behind one CTA barrier), or with v_split > 1
    a cluster of v_split CTAs per (b, h), CTA s owning the columns [s V/v_split, (s+1) V/v_split), whose o
    reaches CTA 0 through GMEM or (gather="dsmem") straight into CTA 0's SMEM. Inputs: qkv, then (f, beta) or
    with fuse_gates (fa, f_b, x, b_w), then gate, state, conv, conv_w, A_log, dt_bias, o_norm_w (+ with
    idle_mask, active: int32 [B], a sequence whose entry is 0 keeps its state and conv window); outputs y, state,
    conv (in_place: y only, the state and conv inputs written in place: see _launch) (+ o_xchg with v_split and
    gmem); scratch vec_smem (one per warpgroup) (+ the cluster or CTA barrier of a split) (+ the TMA slices and
    a barrier each: chunked, v_chunk column slices, each loaded and stored by its own TMA; k_rows > 0, slices of
    k_rows state rows, see _recurrence_rows).
    keep_slices (k_rows): see _recurrence_rows. The state's TMA goes out whole before the prologue.
    from_gemv: qkv and gate are both the projection GEMV's fp32 partials (pallas_kernels.gemv.kernel.partials)
    and fa its partials: "NT" [S, 4 H K, T] and [S, R, T] (token b in column b), "TN" [S, T, 4 H K] and
    [S, T, R] (token-major, the GEMV's x_stream "M" launch): this kernel sums and rounds them (once, as the
    model's projections round), so no glue kernel runs."""
    n_in = (12 if fuse_gates else 10) + idle_mask
    qkv_ref, *gate_in, gate_ref, state_ref, conv_ref, w_ref, alog_ref, dtb_ref, onw_ref = refs[: n_in - idle_mask]
    active_ref = refs[n_in - 1] if idle_mask else None
    y_ref, *rest = refs[n_in:]
    state_out, conv_out = (state_ref, conv_ref) if in_place else (rest.pop(0), rest.pop(0))
    o_xchg_ref = rest.pop(0) if v_split > 1 and gather == "gmem" else None
    vec_all = rest.pop(0)
    xchg_bar = rest.pop(0) if v_split > 1 or warpgroups > 1 else None
    red_all = rest.pop(0) if warpgroups > 1 and on_gpu else None
    tma_scratch = rest
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    parts = v_split * warpgroups  # the tile's columns split over this many warpgroups (one of the two is 1)
    s = lax.axis_index("wg") if warpgroups > 1 else lax.axis_index("s") if v_split > 1 else 0
    vec_smem = vec_all.at[s] if warpgroups > 1 else vec_all  # each warpgroup's own O(K) vectors
    total = functools.partial(_sum, scratch=None if red_all is None else red_all.at[s], tile_layout=tile_layout)
    V = state_ref.shape[-1]
    n_chunks = V // parts // v_chunk
    col0 = s * (V // parts)  # this warpgroup's first state column

    def gcols(c):  # chunk c's columns in the whole tile (state in GMEM, vec_smem rows)
        return pl.ds(col0 + c * v_chunk, v_chunk)

    def slot(c):  # chunk c's TMA slice (with warpgroups the CTA's SMEM holds every warpgroup's slices)
        return s * n_chunks + c if warpgroups > 1 else c

    def issue_state_tma():  # the tile HBM -> SMEM by TMA: in flight during the prologue
        if k_rows:  # one TMA per row slice: row slices are contiguous in GMEM and SMEM alike
            for c in range(state_ref.shape[-2] // k_rows):
                plgpu.copy_gmem_to_smem(state_ref.at[b, h, pl.ds(c * k_rows, k_rows)], tile_smem.at[c], tile_bar.at[c])
        else:  # one TMA per column slice, so slice 0's compute need not wait for the whole tile
            for c in range(n_chunks):
                plgpu.copy_gmem_to_smem(state_ref.at[b, h, :, gcols(c)], tile_smem.at[slot(c)], tile_bar.at[slot(c)])

    if tma_scratch:
        tile_smem, tile_bar = tma_scratch

    def load_state(c):  # chunk c's v_chunk columns into registers
        if chunked:  # swizzled SMEM -> WGMMA layout: the conflict-free path of matmul epilogues
            plgpu.barrier_wait(tile_bar.at[slot(c)])
            return plgpu.load(tile_smem.at[slot(c)], layout=tile_layout)
        return plgpu.load(state_ref.at[b, h, :, gcols(c)], layout=tile_layout, optimized=False)  # ld.global

    # The prologue's small GMEM loads go out before the state's read, so they do not queue behind a whole
    # wave's state traffic (kda_loads_first.json@721adb5).
    H, K = conv_ref.shape[-2:]
    if from_gemv:

        def projected(i):  # stream i (q, k, v, g) of (b, h): its S fp32 partials, loaded (summed by `resolve`)
            rows = pl.ds((i * H + h) * K, K)
            at = (lambda p: qkv_ref.at[p, b, rows]) if from_gemv == "TN" else (lambda p: qkv_ref.at[p, rows, b])
            return tuple(plgpu.load(at(p)) for p in range(qkv_ref.shape[0]))
    else:  # qkv [B, 3, H, K] and gate [B, H, K], or qkvg [B, 4, H, K] whole (passed as both)

        def projected(i):
            return (gate_ref.at[b, h] if i == 3 and qkv_ref.shape[1] == 3 else qkv_ref.at[b, i, h])[...]

    def resolve(v):  # the partials summed (in the GEMV glue's order) and rounded once, as the model's GEMMs
        return common.sum_in_order(lambda p: v[p], len(v)).astype(dtype) if isinstance(v, tuple) else v

    gate_K, onw_K = projected(3), onw_ref[...]  # the norm's inputs: issued now, used at the end
    active_b = None if active_ref is None else active_ref[b]  # compared only after the TMA issue: a use waits
    pro_in = _prologue_loads(projected, conv_ref.at[b, :, :, h], w_ref, alog_ref, dtb_ref, h)
    f_beta = None if fuse_gates else (gate_in[0].at[b, h][...].astype(F32), gate_in[1][b, h])
    if tma_scratch:
        issue_state_tma()
    # The partials' sums come after the state's TMA issue: a warp issues in order, so the first add, waiting
    # for its loads, would hold the tile's request back a loaded-memory round trip (kda_layer_b64_stream.json).
    gate_K = resolve(gate_K)
    pro_in = ([[*w[:-1], resolve(w[-1])] for w in pro_in[0]], *pro_in[1:])
    active = True if active_b is None else active_b != 0  # True: no mask, no branches
    # Without TMA, issue the first state read before the O(K) prologue, which then hides its latency.
    S_0 = None if tma_scratch else load_state(0)

    def first_chunk():
        return load_state(0) if chunked else S_0

    with jax.named_scope("prologue"):
        with jax.named_scope("gates"):  # nested: a phase of its own in profiles (bench/kda_profile.py@721adb5)
            f, beta = (
                _gates(
                    _fa_of(gate_in[0], b, from_gemv, dtype, vec_smem.at[7] if vec_smem.shape[-2] > 7 else None),
                    *gate_in[1:],
                    b,
                    h,
                    vec_smem,
                    dtype,
                    total,
                )
                if fuse_gates
                else f_beta
            )
        o_gain = _prologue(pro_in, f, beta, vec_smem, dtype, total, active=active)
    # The window is written by one warpgroup of a split. In place, every warpgroup of the split has read it in
    # its prologue, so the writer waits for the split's barrier; to a fresh output, right away.
    write_conv = functools.partial(_slide_conv, pro_in[0], conv_out.at[b, :, :, h], active, in_place)
    late_conv = in_place and parts > 1
    if not late_conv:
        write_conv() if parts == 1 else pl.when(s == 0)(write_conv)

    def store_state(c, S_new):
        if chunked:  # in place in the slice's SMEM; its write starts while the next slice is computed
            tile_smem.at[slot(c)][...] = S_new
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tile_smem.at[slot(c)], state_out.at[b, h, :, gcols(c)])
        else:
            state_out.at[b, h, :, gcols(c)][...] = S_new

    # o goes where the gated norm reads it: vec_smem row 5 of this CTA, of WG 0, of the cluster's CTA 0, or GMEM
    if warpgroups > 1:
        o_dst = vec_all.at[0, 5]
    elif v_split == 1:
        o_dst = vec_smem.at[5]
    elif gather == "dsmem":
        o_dst = plgpu.cluster_ref(vec_smem, {"s": 0}).at[5]
    else:
        o_dst = o_xchg_ref.at[b, h]

    def put_o(c, o_C):
        o_dst.at[gcols(c)][...] = o_C

    with jax.named_scope("recurrence"):
        if k_rows:
            _recurrence_rows(
                tile_smem,
                tile_bar,
                state_out.at[b, h],
                vec_smem,
                o_gain,
                dtype,
                keep=keep_slices,
            )
        else:
            _recurrence(
                first_chunk,
                load_state,
                store_state,
                put_o,
                vec_smem,
                o_gain,
                tile_layout=tile_layout,
                v_chunk=v_chunk,
                n_chunks=n_chunks,
                col0=col0,
                dtype=dtype,
                total=total,
            )
    with jax.named_scope("gated_norm"):
        if parts == 1:
            _gated_norm(vec_smem.at[5], gate_K, onw_K, y_ref.at[b, h], eps, dtype, total)
        else:
            if warpgroups > 1:  # one CTA: every thread arrives (release) and waits (acquire) on the mbarrier
                plgpu.barrier_arrive(xchg_bar)
                plgpu.barrier_wait(xchg_bar)
            else:
                common.cluster_sync(xchg_bar, on_gpu)
            if late_conv:
                pl.when(s == 0)(write_conv)  # every warpgroup's prologue read the window before the barrier
            o_src = vec_all.at[0, 5] if warpgroups > 1 else vec_smem.at[5] if gather == "dsmem" else o_xchg_ref.at[b, h]
            pl.when(s == 0)(lambda: _gated_norm(o_src, gate_K, onw_K, y_ref.at[b, h], eps, dtype, total))
    if tma_scratch:
        with jax.named_scope("store_wait"):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM must outlive the store's reads


def _fa_of(fa_ref, b, from_gemv, dtype, fa_smem=None):
    """r -> fa[b, r] in fp32: a [B, R] input, or summed from the GEMV's partials ([S, R, T], or token-major
    [S, T, R]) and rounded. With fa_smem (an SMEM row of R = K words): each partial as one vector (thread t
    loading fa[t]), summed and rounded once, and broadcast to every thread through fa_smem, so the f gate's R
    scalars are SMEM loads, not S x R scalar GMEM loads each summed before its use. _gates reads them only
    after the beta logit's total(), a warpgroup barrier (the rows path reads vec_smem behind the same kind)."""
    if from_gemv:
        S = fa_ref.shape[0]
        if fa_smem is not None:
            at = (lambda p: fa_ref.at[p, b]) if from_gemv == "TN" else (lambda p: fa_ref.at[p, :, b])
            fa_smem[...] = common.sum_in_order(lambda p: plgpu.load(at(p)), S).astype(dtype).astype(F32)
            return lambda r: fa_smem[r]
        at = (lambda p, r: fa_ref[p, b, r]) if from_gemv == "TN" else (lambda p, r: fa_ref[p, r, b])
        return lambda r: common.sum_in_order(lambda p: at(p, r), S).astype(dtype).astype(F32)
    return lambda r: fa_ref[b, r].astype(F32)


def _gates(fa_of, fb_ref, x_ref, bw_ref, b, h, vec_smem, dtype, total=jnp.sum):
    """The two gate projections in-kernel (issue 6 stretch goal), thread t owning output channel t:
    f[t] = sum_r fa[r] f_b[r, h, t] (rank R, fa = x @ f_a computed once per token outside) and the beta
    logit sum_d x[d] b[h, d] in 128-wide slices (b out-major since table version 4: a head's row is
    contiguous, 14 KB at D = 7168; in-major [D, H] it was 7168 strided 2-byte reads, ~86 KB of sectors at
    H = 6); fa_of(r) gives fa[r] in fp32 (_fa_of). fp32 sums rounded to the activation dtype, as the model's
    projections. Every load is independent of the sums, so they issue back to back. f (through vec_smem row 6,
    which rounds it to the activation dtype) and the beta logit are returned as values."""
    R, D, K = fb_ref.shape[0], x_ref.shape[1], vec_smem.shape[-1]
    acc = None
    for c in range(D // K):
        cols = pl.ds(c * K, K)
        term = x_ref.at[b, cols][...].astype(F32) * bw_ref.at[h, cols][...].astype(F32)
        acc = term if acc is None else acc + term
    beta = total(acc).astype(dtype)  # first: a warpgroup barrier before fa_of reads an SMEM row (_fa_of)
    f = fa_of(0) * fb_ref.at[0, h][...].astype(F32)
    for r in range(1, R):
        f = f + fa_of(r) * fb_ref.at[r, h][...].astype(F32)
    vec_smem.at[6][...] = f.astype(dtype).astype(F32)
    return vec_smem.at[6][...], beta


def _prologue_loads(projected, conv_33K, w_ref, alog_ref, dtb_ref, h):
    """The prologue's GMEM loads, all issued before any store: stores may alias them as far as the compiler
    knows (the window's do: it is rewritten in place), so a load written after a store waits for it (one HBM
    round trip each, several microseconds when a full wave's state traffic fills the memory system). Returns
    values, thread t's channel t: (conv windows + the new input per stream, conv taps per stream, A_log[h], dt_bias[h]).
    projected(i): stream i's new pre-conv input (q, k, v)."""
    windows = [[conv_33K.at[i, j][...] for j in range(CONV_TAPS - 1)] + [projected(i)] for i in range(3)]
    taps = [[plgpu.load(w_ref.at[i, h, :, j]) for j in range(CONV_TAPS)] for i in range(3)]
    return windows, taps, alog_ref[h], dtb_ref.at[h][...]


def _slide_conv(windows, conv_33K, active, in_place):
    """The conv window of one (b, h) slid by one (the newest three pre-conv inputs of each stream, from
    _prologue_loads' values). An idle sequence (not active) keeps it: in place nothing is written, to a fresh
    output the window as it was."""

    def slide(by=1):
        for i, window in enumerate(windows):
            for j in range(CONV_TAPS - 1):
                conv_33K.at[i, j][...] = window[j + by]

    if active is True:  # no mask, no branch
        slide()
        return
    pl.when(active)(slide)
    if not in_place:
        pl.when(jnp.logical_not(active))(functools.partial(slide, by=0))


def _prologue(pro_in, f, beta, vec_smem, dtype, total=jnp.sum, active=True):
    """The O(K) work of one (b, h), thread t owning channel t: conv window + SiLU (docs/model.md §4.2), gate,
    beta, L2 norms (§4.3), from _prologue_loads' values and the gate input f (fp32); the caller slides the
    window (_slide_conv). Leaves the tile-side vectors in vec_smem rows 0-4, returns the gain beta (k̂ · q̂) of
    the output correction. An idle sequence's tile update gets decay 1 and rank-1 weight 0,
    S' = S * 1 + 0 * delta = S (value for value; an exact -0.0 may come back +0.0), which costs the tile loop
    nothing, where a branch in the loop would (kda_idle.json, kda_idle_branch.json@721adb5). Its y is the
    stepped one (the api leaves an idle slot's y unspecified)."""
    K = vec_smem.shape[-1]
    windows, taps, a_log, dt_bias = pro_in
    x = []
    for i, window in enumerate(windows):
        y = sum(w * u.astype(F32) for w, u in zip(taps[i], window, strict=True))
        x.append((y * sigmoid(y)).astype(dtype).astype(F32))
    q, k, v = x
    g = -5.0 * sigmoid(jnp.exp(a_log) * (f + dt_bias))
    beta = sigmoid(beta.astype(F32))
    qn = q * lax.rsqrt(total(q * q) + 1e-6) * (K**-0.5)
    kn = k * lax.rsqrt(total(k * k) + 1e-6)
    decay = jnp.exp(g)
    vec_smem.at[0][...] = decay * kn
    vec_smem.at[1][...] = decay * qn
    if active is True:
        vec_smem.at[2][...] = decay
        vec_smem.at[3][...] = beta * kn
    else:  # step 1 leaves both exact (x * 1 + 0); step 0 holds the state
        step = active.astype(F32)
        vec_smem.at[2][...] = decay * step + (1.0 - step)
        vec_smem.at[3][...] = beta * kn * step
    vec_smem.at[4][...] = v
    return beta * total(kn * qn)


def _recurrence(
    first_chunk,
    load_state,
    store_state,
    put_o,
    vec_smem,
    o_gain,
    *,
    tile_layout,
    v_chunk,
    n_chunks,
    col0,
    dtype,
    total=jnp.sum,
):
    """The state update and output (§4.4) from one read of S, v_chunk columns at a time (columns are
    independent given k̂, q̂): n_chunks chunks from state column col0. first_chunk() gives chunk 0 (waiting for
    its TMA where there is one) after the vectors are broadcast. o (rounded to dtype) goes to put_o(c, o_C).
    Chunk c + 1 is loaded into registers before chunk c is reduced and written, so an ld.global read is in
    flight meanwhile. With per-slice TMA that load first waits for slice c + 1 (waiting only when a chunk is
    due measured the same, kda_prefetch.json@721adb5, so there is one order)."""
    K = vec_smem.shape[-1]
    row_layout, col_layout = tile_layout.reduce(1), tile_layout.reduce(0)
    tile = (K, v_chunk)

    def bcast(vec, dim):  # layout_cast tells the lowering which tile layout the broadcast must produce
        return plgpu.layout_cast(lax.broadcast_in_dim(vec, tile, (dim,)), tile_layout)

    kd, qd, decay_r, bk = (bcast(plgpu.load(vec_smem.at[i], layout=row_layout), 0) for i in range(4))
    S_next = first_chunk()
    for c in range(n_chunks):
        S_KC = S_next
        if c + 1 < n_chunks:
            S_next = load_state(c + 1)
        cols = pl.ds(col0 + c * v_chunk, v_chunk)
        delta_C = plgpu.load(vec_smem.at[4, cols], layout=col_layout) - total(S_KC * kd, 0)
        o_C = total(S_KC * qd, 0) + o_gain * delta_C
        store_state(c, S_KC * decay_r + bk * bcast(delta_C, 1))
        put_o(c, o_C.astype(dtype).astype(F32))


def _recurrence_rows(tile_smem, tile_bar, new_state_KV, vec_smem, o_gain, dtype, keep=0):
    """_recurrence with thread t owning state column t (WG_STRIDED rows, K = V = 128 threads), the tile staged
    in row slices tile_smem [K / k_rows, k_rows, V] (one TMA and barrier each). Both K-reductions are then
    sums inside each thread: no shuffles, no cross-warp barriers, and the per-row vectors (e k̂, e q̂, e, beta
    k̂) are broadcast loads of one SMEM word. Pass 1 forms Sᵀ(e k̂) and Sᵀ(e q̂) slice by slice as the slices
    land; pass 2 rereads each slice and writes each new row straight from registers (st.global, 512 contiguous
    bytes per row). A slice's loads are all issued before its stores, which would otherwise order each next
    load behind them. keep: the last `keep` slices stay in registers from pass 1 (k_rows registers each), and
    pass 2 starts with them (last slice first). With keep 3 the register stores beat SMEM + TMA stores
    (kda_stg.json); splitting the key rows over 2 warpgroups was slower (kda_rows_wg2.json@721adb5)."""
    n, rows = tile_smem.shape[:2]
    held = {}

    def sliced(c, i):  # row i of vec_smem for slice c's state rows, as scalars (one broadcast load each)
        return [vec_smem[i, c * rows + j] for j in range(rows)]

    kd_sum = qd_sum = None
    for c in range(n):
        plgpu.barrier_wait(tile_bar.at[c])
        S_c = [tile_smem.at[c, j][...] for j in range(rows)]
        kd, qd = sliced(c, 0), sliced(c, 1)
        part_k, part_q = S_c[0] * kd[0], S_c[0] * qd[0]  # per slice, so the slices' chains are independent
        for j in range(1, rows):
            part_k, part_q = part_k + S_c[j] * kd[j], part_q + S_c[j] * qd[j]
        kd_sum = part_k if kd_sum is None else kd_sum + part_k
        qd_sum = part_q if qd_sum is None else qd_sum + part_q
        if c >= n - keep:
            held[c] = S_c
    delta = vec_smem.at[4][...] - kd_sum
    vec_smem.at[5][...] = (qd_sum + o_gain * delta).astype(dtype).astype(F32)
    for c in reversed(range(n)) if keep else range(n):
        S_c = held.pop(c, None) or [tile_smem.at[c, j][...] for j in range(rows)]
        decay, bk = sliced(c, 2), sliced(c, 3)
        for j in range(rows):
            new_state_KV.at[c * rows + j][...] = S_c[j] * decay[j] + bk[j] * delta


def _gated_norm(o_K, gate_K, onw_K, y_K, eps, dtype, total=jnp.sum):
    """Gated RMSNorm (§4.6): o (a ref, already rounded to the compute dtype), then fp32 to one final rounding.
    gate_K and onw_K are values, loaded at the kernel's start (a load here would wait behind the state's
    stores)."""
    K = o_K.shape[-1]
    o = o_K[...]
    n = o * lax.rsqrt(total(o * o) * (1.0 / K) + eps) * onw_K
    y_K[...] = (n * sigmoid(gate_K.astype(F32))).astype(dtype)


# f32 tile in 128-byte swizzled (8, 32) tiles: TMA writes it, WGMMA-layout loads/stores hit no bank conflicts.
SWIZZLED = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


_STATIC = (
    "eps",
    "tile_layout",
    "v_chunk",
    *ROWS_KEYS,
    "tma",
    "v_split",
    "gather",
    "warpgroups",
    "interpret",
    "profile_dir",
    "in_place",
)


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode(
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
    eps,
    tile_layout,
    v_chunk=128,
    tma=False,
    v_split=1,
    gather="gmem",
    warpgroups=1,
    interpret=None,
    profile_dir="",
    k_chunk=32,
    keep_slices=0,
    in_place=False,
):
    """One step over every (b, h) state tile. tma, the tile's staging (the body's tuning entry picks it):
    False: v_chunk column pieces straight HBM <-> registers by ld/st.global, the next piece's read in flight;
    "chunked": one TMA load and one TMA store per v_chunk column slice through swizzled SMEM (compute on slice 0
    starts when it lands, each slice's write starts as soon as it is updated); "rows": one TMA load per k_chunk
    state rows, thread t owning state column t, the new rows stored from registers (_recurrence_rows).
    v_split > 1: a cluster of v_split CTAs per (b, h), each owning V / v_split state columns, so at small B*H
    the serial chain of one CTA shrinks v_split-fold; each CTA recomputes the O(K) prologue, and CTA 0 gathers
    o for the gated norm, which needs the whole row, behind one cluster barrier: through GMEM (gather="gmem",
    which interpret mode runs) or by stores into CTA 0's SMEM (gather="dsmem", GPU only).
    warpgroups > 1: the same split inside one CTA, each warpgroup owning V / warpgroups columns: no cluster, and
    o meets in WG 0's SMEM behind one CTA barrier (it pays only at small B*H: fewer 256-thread CTAs fit per SM).
    active_B: int [B], None = all (then no mask input, no branches); a sequence whose entry is 0 (an idle slot)
    keeps its state (value for value: updated with decay 1 and no rank-1 write, _prologue) and its conv window
    (bit for bit), so no select over the state runs after the kernel; its y is computed.
    qkv_B3HK may also be the layer's whole qkvg [B, 4, H, K], passed again as gate_BHK: the kernel reads the
    gate from its fourth stream, so the caller makes no sliced copies.
    profile_dir: write Mosaic GPU's in-kernel trace of the named phases there (bench/kda_profile.py@721adb5).
    in_place: the state and conv window written into the input arrays (see _launch), not fresh outputs."""
    return _launch(
        qkv_B3HK,
        (f_BHK, beta_BH),
        gate_BHK,
        state_BHKV,
        conv_B3WHK,
        conv_w_3HKW,
        A_log_H,
        dt_bias_HK,
        o_norm_w_K,
        active_B,
        eps=eps,
        tile_layout=tile_layout,
        v_chunk=v_chunk,
        tma=tma,
        v_split=v_split,
        gather=gather,
        warpgroups=warpgroups,
        interpret=interpret,
        profile_dir=profile_dir,
        k_chunk=k_chunk,
        keep_slices=keep_slices,
        in_place=in_place,
    )


@functools.partial(jax.jit, static_argnames=_STATIC + ("from_gemv",))
def decode_gates(
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
    eps,
    tile_layout,
    v_chunk=128,
    tma=False,
    v_split=1,
    gather="gmem",
    warpgroups=1,
    interpret=None,
    profile_dir="",
    from_gemv=False,
    k_chunk=32,
    keep_slices=0,
    in_place=False,
):
    """decode with the f and beta projections in the kernel (_gates): two fewer launches per KDA layer;
    fa_BR = x @ f_a (rank R, 128 in K3), D a multiple of K.
    from_gemv ("NT" or "TN", the partials' layout: see _body): straight from the decode GEMV's fp32 partials
    (pallas_kernels.gemv.kernel.partials), so that no other kernel runs between the two: qkv_B3HK and gate_BHK
    are both its partials for the out-major qkvg [4, H, K, D] as [4 H K, D], fa_BR its partials for f_a [R, D];
    the kernel sums and rounds them itself."""
    if from_gemv not in (False, "NT", "TN"):
        raise NotImplementedError(f"from_gemv={from_gemv!r}: False, 'NT' or 'TN' (the GEMV partials' layout)")
    if x_BD.shape[1] % conv_B3WHK.shape[-1]:
        raise NotImplementedError(f"fused gates: f_b {f_b_RHK.shape}, x {x_BD.shape}")
    dtype = x_BD.dtype
    return _launch(
        qkv_B3HK,
        (fa_BR, f_b_RHK.astype(dtype), x_BD, b_HD.astype(dtype)),
        gate_BHK,
        state_BHKV,
        conv_B3WHK,
        conv_w_3HKW,
        A_log_H,
        dt_bias_HK,
        o_norm_w_K,
        active_B,
        eps=eps,
        tile_layout=tile_layout,
        v_chunk=v_chunk,
        tma=tma,
        v_split=v_split,
        gather=gather,
        warpgroups=warpgroups,
        interpret=interpret,
        profile_dir=profile_dir,
        from_gemv=from_gemv,
        k_chunk=k_chunk,
        keep_slices=keep_slices,
        in_place=in_place,
    )


def _launch(
    qkv_B3HK,
    gate_in,
    gate_BHK,
    state_BHKV,
    conv_B3WHK,
    conv_w_3HKW,
    A_log_H,
    dt_bias_HK,
    o_norm_w_K,
    active_B,
    *,
    eps,
    tile_layout,
    v_chunk,
    tma,
    v_split=1,
    gather="gmem",
    warpgroups=1,
    interpret,
    profile_dir="",
    from_gemv=False,
    k_chunk=32,
    keep_slices=0,
    in_place=False,
):
    """gate_in: (f, beta), or the four inputs of the fused gate projections (fa, f_b, x, b_w); from_gemv: qkv
    and gate are the GEMV's partials (decode_gates)."""
    B, H, K = gate_in[2].shape[0] if from_gemv else qkv_B3HK.shape[0], *conv_B3WHK.shape[-2:]
    V = state_BHKV.shape[-1]
    parts = v_split * warpgroups
    Vs = V // parts  # state columns per warpgroup
    if tma != "rows" and (V % parts or Vs % v_chunk or v_chunk % (32 if tma else 8)):
        raise NotImplementedError(
            f"v_chunk={v_chunk}, v_split={v_split}, warpgroups={warpgroups} do not tile V={V} (tma={tma})"
        )
    if warpgroups > 1 and v_split > 1:
        raise NotImplementedError(f"warpgroups > 1 takes one CTA per tile, got v_split={v_split}")
    if gather not in ("gmem", "dsmem") or (gather == "dsmem" and interpret is not None):
        raise NotImplementedError(f"gather={gather!r}: GPU interpret mode has no peer-SMEM stores, use 'gmem'")
    if tma not in TMA_STAGINGS:
        raise NotImplementedError(f"tma={tma!r}: one of {TMA_STAGINGS}")
    if tma == "rows" and (parts > 1 or K % k_chunk or V != 128):
        raise NotImplementedError(
            f"tma='rows' takes one warpgroup per tile (a thread per state column, V = 128) "
            f"and k_chunk dividing K, got v_split={v_split}, warpgroups={warpgroups}, "
            f"k_chunk={k_chunk}, K={K}, V={V}"
        )
    dtype = gate_in[2].dtype if from_gemv else qkv_B3HK.dtype
    if in_place and conv_B3WHK.dtype != dtype:  # the window is rewritten in place with the new (dtype) inputs
        raise NotImplementedError(f"conv window {conv_B3WHK.dtype} != activations {dtype}")
    fuse_gates = len(gate_in) == 4
    out_type = [jax.ShapeDtypeStruct((B, H, K), dtype)]
    if not in_place:
        out_type += [jax.ShapeDtypeStruct(state_BHKV.shape, F32), jax.ShapeDtypeStruct(conv_B3WHK.shape, dtype)]
    # vec_smem rows: 0-5 (_prologue, o), 6 f (fused gates), 7 fa broadcast (from the GEMV's partials, R = K: _fa_of)
    fa_broadcast = bool(fuse_gates and from_gemv) and gate_in[0].shape[2 if from_gemv == "TN" else 1] == K
    vec_rows = 6 + int(fuse_gates) + int(fa_broadcast)
    scratch = [plgpu.SMEM((warpgroups, vec_rows, K) if warpgroups > 1 else (vec_rows, K), F32)]
    launch_kw = {}  # the split's: warpgroups of one CTA, or a cluster
    if warpgroups > 1:  # every warpgroup's o is in WG 0's SMEM before it normalises
        scratch.append(plgpu.Barrier(num_arrivals=warpgroups))
        if interpret is None:  # each warpgroup's own reduction scratch (_sum); interpret mode needs none
            scratch.append(plgpu.SMEM((warpgroups, RED_SCRATCH), F32))
        launch_kw = dict(num_threads=warpgroups, thread_name="wg")
    if v_split > 1:  # o gathered (through GMEM: an output nobody reads) behind one all-to-all cluster barrier
        if gather == "gmem":
            out_type.append(jax.ShapeDtypeStruct((B, H, V), F32))
        scratch.append(plgpu.ClusterBarrier(collective_axes=("s",), num_arrivals=1))
        launch_kw = dict(cluster=(v_split,), cluster_names=("s",))
    body = functools.partial(
        _body,
        fuse_gates=fuse_gates,
        from_gemv=from_gemv,
        chunked=tma == "chunked",
        v_split=v_split,
        gather=gather,
        warpgroups=warpgroups,
        idle_mask=active_B is not None,
        on_gpu=interpret is None,
        k_rows=k_chunk if tma == "rows" else 0,
        keep_slices=keep_slices,
        in_place=in_place,
    )
    if tma == "rows":  # [slice, k_chunk, V]: unswizzled, a thread's column is one bank
        scratch += [plgpu.SMEM((K // k_chunk, k_chunk, V), F32), plgpu.Barrier(num_barriers=K // k_chunk)]
    elif tma == "chunked":
        # [slice, K, v_chunk]: a TMA needs each slice contiguous in SMEM, which column slices of [K, V] are not
        n_slices = V // v_split // v_chunk  # the CTA's: all of its warpgroups'
        scratch += [plgpu.SMEM((n_slices, K, v_chunk), F32, transforms=SWIZZLED), plgpu.Barrier(num_barriers=n_slices)]
    kernel = plgpu.kernel(
        functools.partial(body, tile_layout=tile_layout, v_chunk=v_chunk, eps=eps, dtype=dtype),
        out_type=tuple(out_type),
        scratch_types=scratch,
        grid=(B, H),
        grid_names=("b", "h"),
        **launch_kw,
        compiler_params=dataclasses.replace(
            LANE_PARAMS, profile_space=256 if profile_dir else 0, profile_dir=profile_dir
        ),
        interpret=interpret,
    )
    # in_place: the state and conv window go in as refs the kernel writes, so its call aliases them (XLA's
    # output_operand_aliases): a donated cache is updated in place, where fresh outputs cost a D2D copy each into
    # the cache's buffers (2 a KDA layer in the step's trace, bench/NOTES.md lever 7). Each CTA reads its own
    # tile (and window) before writing it (_recurrence_rows: all of it; the window: _body's placement).
    state_ref, conv_ref = (jax.new_ref(state_BHKV), jax.new_ref(conv_B3WHK)) if in_place else (state_BHKV, conv_B3WHK)
    outs = kernel(
        qkv_B3HK,
        *gate_in,
        gate_BHK,
        state_ref,
        conv_ref,
        conv_w_3HKW.astype(F32),
        A_log_H.astype(F32),
        dt_bias_HK.astype(F32),
        o_norm_w_K.astype(F32),
        *(() if active_B is None else (active_B.astype(jnp.int32),)),
    )
    if in_place:
        return outs[0], state_ref[...], conv_ref[...]  # with v_split the gather buffer is dropped
    return outs[:3]
