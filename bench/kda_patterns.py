"""Which memory pattern moves a wave of KDA state tiles at the copy's speed? (H200, CUPTI device time.)

At 384-768 tiles three decode kernels with very different maths (column slices with cross-warp reductions,
row slices with a thread per column, fla's Triton) all take ~16 us per 384 tiles, against 13.1 us for XLA's
`s + 1` over the same state (bench/results/kda_rows.json, kda_decode.md). So the bound is in how the bytes
move, not in the maths. This times copies of the state (+1, fp32, K = V = 128) that move the bytes the way a
decode kernel could, with no other work:
- `tile`: one CTA per (b, h) tile, its 4 row slices TMA-loaded at the start and each TMA-stored after it lands
  (the decode kernel's pattern; a plain copy, so its max_err against s + 1 is 1); `tile regs` adds the
  SMEM -> registers -> SMEM round trip of the update;
- `tile/P`: P CTAs per tile, each one row slice (more, smaller CTAs per SM: 16-32 KiB of SMEM each);
- `stream GxS`: G CTAs, each walking its share of row slices through a pipeline of S SMEM slots
  (plgpu.emit_pipeline: loads run S - 1 slices ahead of the stores).
And the XLA decode's idle mask at B = 64 (the sublayer's xla column: 83.4 us with the mask inside the update
against ~72 without; kda_layer.json): the reference without a mask, with it (on decay before both of its
uses, since the eleventh session), with the masked decay and weight materialised before the state loop (an
optimization barrier), and with the earlier form (the mask on the update's decay only, "mask last").

Run on the device machine from the repo root: PYTHONPATH=. python3 bench/kda_patterns.py $OUT
-> OUT/kda_patterns.json; `--reference OUT`: the XLA mask forms alone -> OUT/kda_reference_mask.json;
`--dependency OUT`: the tile copies with the decode kernel's read-all-then-write order -> OUT/kda_dependency.json.
"""

import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from bench.device_time import ITERS, time_variants
from pallas_kernels.kda_decode import reference

F32 = jnp.float32
HBM_PEAK = 4.8e12
_LANE = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def tile_copy(state_BHKV, *, parts=1, rows=32, regs=False, wait_all=False, interpret=None):
    """state + 1: grid (B, H, parts), CTA p owning rows [p K / parts, (p + 1) K / parts) of its tile, in
    slices of `rows` rows, all TMA-loaded at the start, each stored as it lands (after a register round trip
    with regs). wait_all: no store before every slice has landed, the decode kernel's dependency (its update
    needs Sᵀ k̂ over the whole tile), so a CTA reads, then writes."""
    B, H, K, V = state_BHKV.shape
    mine = K // parts
    n = mine // rows

    def body(s_ref, o_ref, smem, bar):
        b, h, p = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("p")

        def at(ref, c):
            return ref.at[b, h, pl.ds(p * mine + c * rows, rows)]

        for c in range(n):
            plgpu.copy_gmem_to_smem(at(s_ref, c), smem.at[c], bar.at[c])
        if wait_all:
            for c in range(n):
                plgpu.barrier_wait(bar.at[c])
        for c in range(n):
            if not wait_all:
                plgpu.barrier_wait(bar.at[c])
            if regs:
                vals = [smem.at[c, j][...] for j in range(rows)]
                for j in range(rows):
                    smem.at[c, j][...] = vals[j] + 1.0
                plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(smem.at[c], at(o_ref, c))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(state_BHKV.shape, F32),
        scratch_types=[plgpu.SMEM((n, rows, V), F32), plgpu.Barrier(num_barriers=n)],
        grid=(B, H, parts),
        grid_names=("b", "h", "p"),
        compiler_params=_LANE,
        interpret=interpret,
    )(state_BHKV)


def stream_copy(state_BHKV, *, ctas, slots, rows=32, interpret=None):
    """state + 1: `ctas` CTAs, CTA c walking rows [c R, (c + 1) R) of the flattened state in slices of `rows`
    through an emit_pipeline of `slots` SMEM slots (register round trip per slice)."""
    B, H, K, V = state_BHKV.shape
    total = B * H * K
    if total % (ctas * rows):
        raise ValueError(f"{total} rows do not split over {ctas} CTAs x {rows}")
    per = total // ctas
    flat = state_BHKV.reshape(total, V)

    def body(s_ref, o_ref):
        c = lax.axis_index("c")

        def step(_, in_smem, out_smem):
            for j in range(rows):
                out_smem.at[j][...] = in_smem.at[j][...] + 1.0

        spec = plgpu.BlockSpec((rows, V), lambda i: (i, 0))
        plgpu.emit_pipeline(step, grid=(per // rows,), in_specs=[spec], out_specs=[spec], max_concurrent_steps=slots)(
            s_ref.at[pl.ds(c * per, per)], o_ref.at[pl.ds(c * per, per)]
        )

    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(flat.shape, F32),
        grid=(ctas,),
        grid_names=("c",),
        compiler_params=_LANE,
        interpret=interpret,
    )(flat)
    return out.reshape(state_BHKV.shape)


def reference_barrier(qkv, f, beta, gate, state, conv, conv_w, A_log, dt_bias, o_norm_w, active_B):
    """reference.kda_decode with the idle mask applied to the small vectors, which an optimization barrier
    materialises before the state loop (the experiment; same maths as the reference's masked update)."""
    qn, kn, v, decay, beta_, new_conv = reference.prepare(qkv, f, beta, conv, conv_w, A_log, dt_bias)
    step = (active_B != 0).astype(F32)
    decay = decay * step[:, None, None] + (1.0 - step[:, None, None])
    weight = beta_ * step[:, None]
    qn, kn, v, decay, weight = lax.optimization_barrier((qn, kn, v, decay, weight))
    delta = v - jnp.sum(decay[..., None] * state * kn[..., None], axis=-2)
    new_state = reference.advance(state, kn, decay, weight, delta)
    new_conv = jnp.where((active_B != 0)[:, None, None, None, None], new_conv, conv)
    o = jnp.sum(new_state * qn[..., None], axis=-2)
    return reference.gated_norm(o, gate, o_norm_w, 1e-5, qkv.dtype), new_state, new_conv


def reference_mask_last(qkv, f, beta, gate, state, conv, conv_w, A_log, dt_bias, o_norm_w, active_B):
    """The reference's idle mask as it was until the eleventh session: on the update's decay only, delta taking
    the unmasked one (47.0 vs 36.9 us at 64 x 6, kda_reference_mask.json, where this form was "mask" and the
    reference's present one "mask first"): the masked decay's one consumer let XLA recompute the gate maths per
    state element in a second loop fusion."""
    qn, kn, v, decay, beta_, new_conv = reference.prepare(qkv, f, beta, conv, conv_w, A_log, dt_bias)
    step = (active_B != 0).astype(F32)
    delta = v - jnp.sum(decay[..., None] * state * kn[..., None], axis=-2)
    new_state = reference.advance(
        state, kn, decay * step[:, None, None] + (1.0 - step[:, None, None]), beta_ * step[:, None], delta
    )
    new_conv = jnp.where((active_B != 0)[:, None, None, None, None], new_conv, conv)
    o = jnp.sum(new_state * qn[..., None], axis=-2)
    return reference.gated_norm(o, gate, o_norm_w, 1e-5, qkv.dtype), new_state, new_conv


def max_err(got, want):
    got, want = (got,) if not isinstance(got, tuple) else got, (want,) if not isinstance(want, tuple) else want
    return {
        f"out{i}": float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
        for i, (a, b) in enumerate(zip(got, want, strict=True))
    }


def main_reference(out_dir, results=None):
    """The XLA decode step without a mask, with the reference's mask, and the two experimental forms."""
    sys.path.insert(0, "bench")
    from kda_decode import make_inputs

    if results is None:
        dev = jax.devices()[0]
        results = dict(
            device=f"{dev.device_kind} (cc {dev.compute_capability})",
            jax=jax.__version__,
            measure=f"CUPTI device time per call (summed kernel time), median of {ITERS} runs",
            reference=[],
        )
    out = pathlib.Path(out_dir, "kda_patterns.json" if "copies" in results else "kda_reference_mask.json")
    for B, H in [(64, 6), (8, 6)]:
        args = make_inputs(7, B, H)
        active = jnp.ones((B,), jnp.int32).at[B - 1].set(0)
        want = jax.jit(reference.kda_decode)(*args, active)
        fns = {
            "mask": jax.jit(reference.kda_decode),
            "barrier": jax.jit(reference_barrier),
            "mask last": jax.jit(reference_mask_last),
        }
        row = dict(
            B=B,
            H=H,
            **time_variants(
                {"no mask": jax.jit(reference.kda_decode)}, args, jax.jit(reference.kda_decode)(*args), max_err
            ),
            **time_variants(fns, (*args, active), want, max_err),
        )
        results["reference"].append(row)
        print({k: v for k, v in row.items() if "err" not in k}, flush=True)
        out.write_text(json.dumps(results, indent=1))


def main_dependency(out_dir):
    """The tile copies with and without the decode kernel's read-all-then-write dependency (wait_all), at the
    sizes where the kernel is 2-3 us over the copy -> OUT/kda_dependency.json."""
    dev = jax.devices()[0]
    results = dict(
        device=f"{dev.device_kind} (cc {dev.compute_capability})",
        jax=jax.__version__,
        measure=f"CUPTI device time per call (summed kernel time), median of {ITERS} runs",
        copies=[],
    )
    out = pathlib.Path(out_dir, "kda_dependency.json")
    copies = {
        "xla s+1": lambda s: s + 1.0,
        "tile": tile_copy,
        "tile wait-all": functools.partial(tile_copy, wait_all=True),
        "tile regs": functools.partial(tile_copy, regs=True),
        "tile regs wait-all": functools.partial(tile_copy, regs=True, wait_all=True),
    }
    for B, H in [(64, 6), (64, 12), (8, 96)]:
        state = jnp.asarray(np.random.default_rng(B * H).standard_normal((B, H, 128, 128)), F32)
        fns = {name: jax.jit(f) for name, f in copies.items()}
        row = dict(
            B=B,
            H=H,
            tiles=B * H,
            floor_us=2 * state.nbytes / HBM_PEAK * 1e6,
            **time_variants(fns, (state,), state + 1.0, max_err),
        )
        results["copies"].append(row)
        print({k: v for k, v in row.items() if "err" not in k}, flush=True)
        out.write_text(json.dumps(results, indent=1))


def main(out_dir):
    dev = jax.devices()[0]
    results = dict(
        device=f"{dev.device_kind} (cc {dev.compute_capability})",
        jax=jax.__version__,
        measure=f"CUPTI device time per call (summed kernel time), median of {ITERS} runs",
        copies=[],
        reference=[],
    )
    out = pathlib.Path(out_dir, "kda_patterns.json")
    copies = {
        "xla s+1": lambda s: s + 1.0,
        "tile": tile_copy,
        "tile regs": functools.partial(tile_copy, regs=True),
        "tile rows16": functools.partial(tile_copy, rows=16),
        "tile/2": functools.partial(tile_copy, parts=2),
        "tile/4": functools.partial(tile_copy, parts=4),
        **{f"stream {g}x{s}": functools.partial(stream_copy, ctas=g, slots=s) for g in (128, 256) for s in (2, 4)},
    }
    for B, H in [(64, 6), (64, 12), (8, 12)]:
        state = jnp.asarray(np.random.default_rng(B * H).standard_normal((B, H, 128, 128)), F32)
        fns = {name: jax.jit(f) for name, f in copies.items()}  # one that fails is recorded as failed
        row = dict(
            B=B,
            H=H,
            tiles=B * H,
            floor_us=2 * state.nbytes / HBM_PEAK * 1e6,
            **time_variants(fns, (state,), state + 1.0, max_err),
        )
        results["copies"].append(row)
        print({k: v for k, v in row.items() if "err" not in k}, flush=True)
        out.write_text(json.dumps(results, indent=1))
    main_reference(out_dir, results)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reference"]:
        main_reference(sys.argv[2] if len(sys.argv) > 2 else ".")
    elif sys.argv[1:2] == ["--dependency"]:
        main_dependency(sys.argv[2] if len(sys.argv) > 2 else ".")
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else ".")
