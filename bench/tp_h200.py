"""Truncated K3 at real widths on 2 H200s: TP2 vs TP1 numerics and per-step decode device time.

  python bench/tp_h200.py --out DIR      # writes DIR/tp2_h200.json and DIR/tp2_h200.md

Model: preset('k3') cut to 4 layers (layer 0 dense KDA, 1-2 MoE KDA, 3 MoE MLA; ~52 GB with MXFP4 experts),
random weights drawn on GPU 0 (rbg PRNG: one cheap HLO per tensor instead of threefry's slow compiles), then
copied into the TP2 layout, so both runs see the same weights. Decode runs through Engine.step_fn (the
shard_map'd model.extend with k3jax.comm's explicit collectives, XLA backend), not donated, so the same
arguments can be replayed under CUPTI.

Numerics: batch 8, 6 decode steps fed the same random tokens, logits of TP2 vs TP1 in bf16 and in float32.
Timing: CUPTI kernel times of one decode step (context 1024 in the FP8 latent cache, batch 1 and 8), all
kernels of both GPUs summed then divided by tp (SPMD: both ranks run the same program), collectives
(NCCL / all-reduce / all-gather kernels) summed separately. Collective kernel time includes waiting for the
other rank (launch skew), so it is an upper bound on wire time.
"""

import argparse
import json
import os
import re
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from k3jax import params as params_lib  # noqa: E402
from k3jax import sharding as sh  # noqa: E402
from k3jax.config import preset  # noqa: E402
from k3jax.engine import Engine  # noqa: E402

# XLA names its own one-shot all-reduce kernels after the op ("psum_84_0_fusion_1"); all-gathers go to NCCL
COLLECTIVE = re.compile(r"psum|nccl|all_?reduce|all_?gather|allreduce|allgather|reduce_scatter|collective", re.I)
CONTEXT, MAX_LEN, FEED_STEPS, ITERS = 1024, 2048, 6, 5
T0 = time.time()


def config():
    return preset("k3").replace(num_hidden_layers=4, full_attn_layers=(4,))


def init_on(cfg, device, seed=0):
    """Random weights on one GPU, one jit per layer (bounds the transient memory of the expert draws)."""
    key = jax.random.key(seed)
    table = params_lib.tensor_table(cfg)
    groups = {}
    for s in table:
        groups.setdefault(s.path[1] if s.path[0] == "layers" else -1, []).append(s)
    flat = {}
    out = jax.sharding.SingleDeviceSharding(device)
    for specs in groups.values():
        draw = jax.jit(lambda k, specs=specs: {s.path: params_lib.init_tensor(s, k) for s in specs}, out_shardings=out)
        flat.update(draw(key))
    return params_lib.unflatten(flat)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return dict(
        max_abs_rel=float(np.max(np.abs(a - b)) / np.max(np.abs(b))),
        rms_rel=float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2))),
        argmax_agree=float(np.mean(a.argmax(-1) == b.argmax(-1))),
        rms_rel_per_step=[float(np.sqrt(np.mean((x - y) ** 2) / np.mean(y**2))) for x, y in zip(a, b, strict=True)],
    )


def engine(cfg, params, tp, dtype, backend="auto"):
    mesh = sh.make_mesh(tp) if tp > 1 else None
    return Engine(cfg, params, max_len=MAX_LEN, max_batch=8, dtype=dtype, mesh=mesh, backend=backend)


def feed_logits(eng, step, batch, rng_seed):
    """Logits of FEED_STEPS single-token extends from an empty cache, fed identical random tokens."""
    toks = np.random.default_rng(rng_seed).integers(0, eng.cfg.vocab_size, (FEED_STEPS, batch))
    return forced_logits(eng, toks, step)


def time_step(eng, step, batch, tp):
    from jax.experimental.mosaic.gpu import profiler

    cache = eng.new_cache(batch)
    cache = {**cache, "lengths": jnp.full((batch,), CONTEXT, jnp.int32)}
    tok = jnp.asarray(np.arange(batch)[:, None] + 11, jnp.int32)
    _, runs = profiler.measure(step, aggregate=False, iterations=ITERS)(
        eng.params, tok, jnp.ones(batch, jnp.int32), cache
    )
    totals, colls, kernels = [], [], {}
    for run in runs:
        totals.append(sum(t for _, t in run) * 1e3 / tp)
        colls.append(sum(t for n, t in run if COLLECTIVE.search(n)) * 1e3 / tp)
        for n, t in run:
            kernels.setdefault(n[:80], []).append(t * 1e3)
    top = sorted(
        ((float(np.sum(v)) / (ITERS * tp), k, len(v) / (ITERS * tp)) for k, v in kernels.items()), reverse=True
    )[:12]
    return dict(
        batch=batch,
        tp=tp,
        context=CONTEXT,
        step_us=float(np.median(totals)),
        collective_us=float(np.median(colls)),
        kernels_per_step=len(runs[0]) / tp,
        collective_kernels_per_step=sum(bool(COLLECTIVE.search(n)) for n, _ in runs[0]) / tp,
        top_kernels=[dict(name=k, us_per_step=u, count=c) for u, k, c in top],
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=300, help="skip the float32 check past this wall time")
    ap.add_argument("--extra", action="store_true", help="only: every kernel name of a TP2 step, float32 at B=2")
    ap.add_argument(
        "--check",
        action="store_true",
        help="only: float32 TP2 == TP1 and latency_specialized == XLA (logits and greedy tokens)",
    )
    args = ap.parse_args()
    jax.config.update("jax_default_prng_impl", "rbg")
    if args.extra:
        return extra(args.out)
    if args.check:
        return check(args.out)
    cfg = config()
    res = dict(
        machine=str(jax.devices()),
        config=dict(
            layers=cfg.layer_kinds, hidden=cfg.hidden_size, experts=cfg.num_experts, expert_quant=cfg.expert_quant
        ),
        bytes_tp1=sh.bytes_per_device(cfg, 1),
        bytes_tp2=sh.bytes_per_device(cfg, 2),
        timing=[],
        numerics={},
    )

    def save():
        res["wall_s"] = time.time() - T0
        with open(os.path.join(args.out, "tp2_h200.json"), "w") as f:
            json.dump(res, f, indent=1)

    p1 = init_on(cfg, jax.devices()[0])
    p2 = jax.device_put(p1, sh.param_shardings(cfg, sh.make_mesh(2)))
    jax.block_until_ready((p1, p2))
    res["init_s"] = time.time() - T0
    print(f"weights ready {res['init_s']:.0f}s", flush=True)
    engines = {tp: engine(cfg, p, tp, jnp.bfloat16) for tp, p in ((1, p1), (2, p2))}
    steps = {tp: jax.jit(e.step_fn) for tp, e in engines.items()}
    out = {tp: feed_logits(engines[tp], steps[tp], 8, 1) for tp in (1, 2)}
    res["numerics"]["bf16"] = rel(out[2], out[1])
    print("bf16", res["numerics"]["bf16"], flush=True)
    save()
    for batch in (1, 8):
        for tp in (1, 2):
            r = time_step(engines[tp], steps[tp], batch, tp)
            res["timing"].append(r)
            print({k: v for k, v in r.items() if k != "top_kernels"}, flush=True)
            save()
    if time.time() - T0 < args.budget_s:
        cast = jax.jit(partial(params_lib.cast_params, dtype=jnp.float32))
        del engines, steps
        e32 = {tp: engine(cfg, cast(p), tp, jnp.float32) for tp, p in ((1, p1), (2, p2))}
        out = {tp: feed_logits(e, jax.jit(e.step_fn), 8, 2) for tp, e in e32.items()}
        res["numerics"]["float32"] = rel(out[2], out[1])
        print("float32", res["numerics"]["float32"], flush=True)
    else:
        res["numerics"]["float32"] = "skipped: wall-time budget"
    save()
    write_md(res, os.path.join(args.out, "tp2_h200.md"))


def extra(out_dir):
    """Second pass: the full kernel list of one TP2 batch-1 step (to attribute collectives by name) and the
    float32 TP2-vs-TP1 check at batch 2 (batch 8 in fp32 ran GPU 0 out of memory next to both weight copies)."""
    from jax.experimental.mosaic.gpu import profiler

    cfg = config()
    p1 = init_on(cfg, jax.devices()[0])
    p2 = jax.device_put(p1, sh.param_shardings(cfg, sh.make_mesh(2)))
    res = {}
    e2 = engine(cfg, p2, 2, jnp.bfloat16)
    cache = {**e2.new_cache(1), "lengths": jnp.full((1,), CONTEXT, jnp.int32)}
    _, run = profiler.measure(jax.jit(e2.step_fn), aggregate=False)(
        p2, jnp.ones((1, 1), jnp.int32), jnp.ones(1, jnp.int32), cache
    )
    res["tp2_b1_kernels"] = [(n[:100], t * 1e3) for n, t in run]
    with open(os.path.join(out_dir, "tp2_h200_extra.json"), "w") as f:
        json.dump(res, f, indent=0)
    del e2, cache
    cast = jax.jit(partial(params_lib.cast_params, dtype=jnp.float32))
    e32 = {tp: engine(cfg, cast(p), tp, jnp.float32) for tp, p in ((1, p1), (2, p2))}
    out = {tp: feed_logits(e, jax.jit(e.step_fn), 2, 2) for tp, e in e32.items()}
    res["float32_b2"] = rel(out[2], out[1])
    print("float32", res["float32_b2"], flush=True)
    with open(os.path.join(out_dir, "tp2_h200_extra.json"), "w") as f:
        json.dump(res, f, indent=0)


def forced_logits(eng, tokens_SB, step=None):
    """Logits [S, B, V] of single-token extends fed tokens_SB (teacher forcing), from an empty cache."""
    step = step or jax.jit(eng.step_fn)
    cache = eng.new_cache(tokens_SB.shape[1])
    out = []
    for t in tokens_SB:
        logits, cache = step(eng.params, jnp.asarray(t[:, None], jnp.int32), jnp.ones(len(t), jnp.int32), cache)
        out.append(np.asarray(logits.astype(jnp.float32)).reshape(len(t), -1))
    return np.stack(out)


def greedy_logits(eng, first_B, steps):
    """Greedy single-token extends from an empty cache -> (tokens [steps + 1, B], logits [steps, B, V])."""
    step, cache, toks, out = jax.jit(eng.step_fn), eng.new_cache(len(first_B)), [first_B], []
    for _ in range(steps):
        lg, cache = step(
            eng.params, jnp.asarray(toks[-1][:, None], jnp.int32), jnp.ones(len(first_B), jnp.int32), cache
        )
        out.append(np.asarray(lg.astype(jnp.float32)).reshape(len(first_B), -1))
        toks.append(out[-1].argmax(-1))
    return np.stack(toks), np.stack(out)


def check(out_dir, batch=8, steps=8, prompt_len=12, new_tokens=16):
    """Float32 at real width, one weight draw: TP2 vs TP1 and the latency_specialized backend (Pallas KDA
    decode kernel; at TP2 also the Pallas all-reduces) vs XLA.

    Two views per pair: (a) teacher-forced logits: every run is fed the greedy tokens of the TP1 XLA run, so
    a near-tie flip in one step cannot change later inputs; we report the relative error and whether each
    step's argmax equals the reference token; (b) the product path, Engine.generate (chunked prefill + the
    on-device decode loop), greedy tokens compared position by position.
    Memory: only the fp32 copy is kept (experts stay packed and shared), TP1 runs first, then the weights move
    to the TP2 layout and the TP1 copy is dropped, so GPU 0 never holds both.
    """
    jax.config.update("jax_default_matmul_precision", "highest")  # no TF32: this is the float32 check
    cfg = config()
    p32 = params_lib.cast_params(init_on(cfg, jax.devices()[0]), jnp.float32)
    r = np.random.default_rng(3)
    prompts = [list(r.integers(0, cfg.vocab_size, prompt_len)) for _ in range(batch)]
    first = r.integers(0, cfg.vocab_size, batch)
    res = dict(machine=str(jax.devices()), batch=batch, steps=steps, dtype="float32", runs={}, compare={})

    def save():
        res["wall_s"] = time.time() - T0
        with open(os.path.join(out_dir, "tp2_h200_check.json"), "w") as f:
            json.dump(res, f, indent=1)

    ref_tokens = None
    logits, gens = {}, {}
    for tp in (1, 2):
        if tp == 2:
            p32 = jax.device_put(p32, sh.param_shardings(cfg, sh.make_mesh(2)))
        for backend in ("xla", "latency_specialized"):
            eng = engine(cfg, p32, tp, jnp.float32, backend)
            if ref_tokens is None:  # TP1 XLA: greedy from a random first token defines the fed sequence
                ref_tokens, logits[(tp, backend)] = greedy_logits(eng, first, steps)
            else:
                logits[(tp, backend)] = forced_logits(eng, ref_tokens[:-1])
            gens[(tp, backend)] = eng.generate(prompts, max_new_tokens=new_tokens).tokens
            res["runs"][f"tp{tp}_{backend}"] = dict(generated=[list(map(int, g)) for g in gens[(tp, backend)]])
            print(f"tp{tp} {backend} done {time.time() - T0:.0f}s", flush=True)
            del eng
            save()
    ref = logits[(1, "xla")]
    ref_argmax = ref.argmax(-1)
    for key in [(2, "xla"), (1, "latency_specialized"), (2, "latency_specialized")]:
        c = rel(logits[key], ref)
        c["forced_argmax_equal"] = float(np.mean(logits[key].argmax(-1) == ref_argmax))
        same = [a == b for a, b in zip(gens[key], gens[(1, "xla")], strict=True)]
        c["generate_sequences_identical"] = f"{sum(same)}/{len(same)}"
        res["compare"][f"tp{key[0]}_{key[1]} vs tp1_xla"] = c
        print(key, {k: v for k, v in c.items() if k != "rms_rel_per_step"}, flush=True)
    save()


def write_md(res, path):
    lines = [
        "# Truncated K3 (real widths, 4 layers) on 2 H200: TP2 vs TP1",
        "",
        f"Layers: {', '.join(res['config']['layers'])}; hidden {res['config']['hidden']}, "
        f"{res['config']['experts']} experts ({res['config']['expert_quant']}). Weight bytes per GPU: "
        f"TP1 {res['bytes_tp1'] / 1e9:.1f} GB, TP2 {res['bytes_tp2'] / 1e9:.1f} GB. Random weights.",
        "",
        "## Numerics (TP2 logits vs TP1, batch 8, 6 decode steps)",
        "",
        "| dtype | max-abs rel | rms rel | argmax agreement |",
        "|---|---|---|---|",
    ]
    for dt, r in res["numerics"].items():
        if isinstance(r, dict):
            lines.append(f"| {dt} | {r['max_abs_rel']:.2e} | {r['rms_rel']:.2e} | {r['argmax_agree']:.3f} |")
        else:
            lines.append(f"| {dt} | {r} | | |")
    lines += [
        "",
        f"## Decode step device time (CUPTI, per GPU, context {CONTEXT}, XLA backend)",
        "",
        "| batch | tp | step us | collectives us | kernels/step | collective kernels/step |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["timing"]:
        lines.append(
            f"| {r['batch']} | {r['tp']} | {r['step_us']:.0f} | {r['collective_us']:.0f} | "
            f"{r['kernels_per_step']:.0f} | {r['collective_kernels_per_step']:.0f} |"
        )
    for r in res["timing"]:
        lines += ["", f"Top kernels, batch {r['batch']} tp {r['tp']} (us per step per GPU):", ""]
        lines += [f"- {k['us_per_step']:.1f} x{k['count']:.0f} `{k['name']}`" for k in r["top_kernels"][:8]]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
