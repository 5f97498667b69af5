"""The routed experts of one MoE sublayer (pallas_kernels.moe.routed_experts) at one tensor-parallel rank's
widths on one GPU: the sm90 grouped MXFP4 kernels (policy latency_specialized) against XLA's reference
("packed": straight from the codes, the default; "gather": a bf16 copy per token), each against its floor,
the HBM time of reading every distinct selected expert's bytes once (1.10 MB per expert at TP16, 2.2 at TP8).

  PYTHONPATH=. python3 bench/moe_layer.py [OUT_DIR] [--tps 16,8] [--tokens 1,2,4,8,16,32,64,128,512]
      [--impls packed,gather] [--name moe_layer] [--routing uniform|skewed] [--cold] [--split-groups]
      [--kernel-variant NAME:field=int,... (a kernel column with those launch fields, repeatable)] [--once TP,T]
  (GPU; writes OUT_DIR/NAME.{json,md}, OUT_DIR defaults to bench/results)
  PYTHONPATH=. JAX_PLATFORMS=cuda,cpu python3 bench/moe_layer.py OUT_DIR --profile TP,T [--kernel-variant ...]
      (each kernel's in-kernel trace as tuned (and per variant), L2-warm: its CTAs' phases (mma: a step's decode
      and WGMMAs; store) and when they run -> OUT_DIR/moe_profile_tpTP_tT.json)

Inputs: E = 896 random MXFP4 experts made on the device (uniform codes, scales 2^-7..2^-4), L = 3584,
I = 3072 / tp; z random bf16 [T, L]; the routing a top-16 of random scores per token (so the distinct experts
follow the real model's count at random routing: ~16 at T = 1, ~120 at 8, ~613 at 64, ~896 at 512). CUPTI
device time (bench/device_time), median of its runs; the kernels of one call counted and timed one by one.
"""

import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.device_time import ITERS, device_us, kernel_names, per_kernel_us  # noqa: E402
from pallas_kernels import policy as policy_lib  # noqa: E402
from pallas_kernels.moe import api  # noqa: E402

E, L, K_TOP, I_TP1 = 896, 3584, 16, 3072
HBM_TB_S = 4.8  # H200 datasheet
BETA = dict(situ_beta=4.0, situ_linear_beta=25.0)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
SCALE_BYTES = range(120, 124)  # the experts' scales, 2^-7 .. 2^-4 (the policy's expert_scale_max: the last)


def experts(key, I):
    """MXFP4 experts on the device: w1 / w3 [E, I, L], w2 [E, L, I] as codes + scales."""
    ex = {}
    for i, (name, (out, inp)) in enumerate(dict(w1=(I, L), w3=(I, L), w2=(L, I)).items()):
        kc, ks = jax.random.split(jax.random.fold_in(key, i))
        ex[name + "_codes"] = jax.random.bits(kc, (E, out, inp // 2), jnp.uint8)
        lo, n = SCALE_BYTES[0], len(SCALE_BYTES)
        ex[name + "_scales"] = (lo + jax.random.bits(ks, (E, out, inp // 32), jnp.uint8) % n).astype(jnp.uint8)
    return ex


def expert_bytes(ex) -> int:
    return sum(a.nbytes for a in ex.values()) // E


ROUTINGS = ("uniform", "skewed")
SKEW_BIAS_STD = 0.1  # params.init_tensor's router_bias


def inputs(key, T, routing="uniform"):
    """z, sel, w for T tokens. uniform: top-16 of independent normal scores (every expert equally likely: the
    distinct counts of the module docstring). skewed: top-16 of sigmoid(normal logits) + a per-expert bias of
    std 0.1 that every token shares, as the rank slice's randomly initialised router picks: popular experts
    take many tokens (groups larger than a token tile)."""
    kz, ks, kw, kb = jax.random.split(key, 4)
    scores = jax.random.normal(ks, (T, E))
    if routing == "skewed":
        scores = jax.nn.sigmoid(scores) + SKEW_BIAS_STD * jax.random.normal(kb, (E,))
    _, sel = jax.lax.top_k(scores, K_TOP)
    w = jax.random.uniform(kw, (T, K_TOP), minval=0.05, maxval=1.0)
    return jax.random.normal(kz, (T, L), jnp.bfloat16), sel.astype(jnp.int32), w


L2_FLUSH_BYTES = 256 << 20  # 5x the H200's 50 MB L2


def cold(f):
    """f with a 256 MB read before it (the experts' bytes then come from HBM, not from the last run's L2; at
    T <= 8 the 16-118 experts of a run fit the L2) and the flush alone, whose time the caller subtracts."""
    junk = jnp.ones((L2_FLUSH_BYTES // 4,), jnp.float32)

    def flush(junk):
        return jnp.sum(junk)

    def flushed(ex, z, sel, w, junk):
        z = z + (0 * flush(junk)).astype(z.dtype)  # a data dependency: the flush runs first
        return f(ex, z, sel, w)

    return jax.jit(flushed), jax.jit(flush), junk


def parse_kernel_variant(text):
    """'NAME:key=value,key=value' -> (NAME, {key: int value}): launch fields set on every sm90 launch entry."""
    name, _, sets = text.partition(":")
    return name, {k: int(v) for k, v in (kv.split("=") for kv in sets.split(",") if kv)}


def kernel_policy(split_groups=False, **fields):
    """The kernel at every T (tuning.json's launches, its serving threshold set aside; split_groups forced on
    where asked; `fields` set on every sm90 launch entry)."""
    moe = json.loads(json.dumps(policy_lib.default_tuning().get("moe")))  # a copy: parsed tables are shared
    moe["sm90"]["serve_min_tokens"] = 1
    for entry in moe["sm90"]["launch"]:
        entry.update(fields)
        if split_groups:
            entry["split_groups"] = True
    tuning = policy_lib.Tuning.from_files(moe=moe)
    return policy_lib.DecodePolicy("latency_specialized", tuning=tuning, expert_scale_max=SCALE_BYTES[-1])


def variants(impls, split_groups=False, kernel_variants=()):
    """The kernel as tuning.json has it, each kernel variant (kernel_NAME) and each XLA path."""
    out = {"kernel": kernel_policy(split_groups)}
    out.update({f"kernel_{n}": kernel_policy(split_groups, **f) for n, f in kernel_variants})
    out.update({f"xla_{impl}": policy_lib.DecodePolicy(moe_impl=impl) for impl in impls if impl})
    return out


def main(out_dir, tps, tokens, impls, name, routing="uniform", l2_cold=False, split_groups=False, kernel_variants=()):
    dev = jax.devices()[0]
    results = dict(
        device=f"{dev.device_kind} (cc {getattr(dev, 'compute_capability', '?')})",
        jax=jax.__version__,
        what="pallas_kernels.moe.routed_experts: grouped MXFP4 experts, z [T, 3584] -> y [T, 3584]",
        measure=f"CUPTI device time per call (summed kernel time), median of {ITERS} runs"
        + (", L2 flushed before each call (the flush's time subtracted)" if l2_cold else ", L2 warm from the last run"),
        routing=routing,
        split_groups=split_groups,
        floor=f"distinct experts x bytes per expert / {HBM_TB_S} TB/s",
        rows=[],
    )
    for tp in tps:
        I = I_TP1 // tp
        ex = experts(jax.random.key(tp), I)
        per_expert = expert_bytes(ex)
        for T in tokens:
            z, sel, w = inputs(jax.random.key(1000 + T), T, routing)
            distinct = int(jnp.unique(sel).size)
            largest = int(jnp.max(jnp.bincount(sel.reshape(-1), length=E)))
            floor_us = distinct * per_expert / (HBM_TB_S * 1e6)
            row = dict(tp=tp, I=I, T=T, distinct=distinct, largest_group=largest, expert_mb=per_expert / 1e6)
            row["floor_us"] = floor_us
            outs = {}
            for v, pol in variants(impls, split_groups, kernel_variants).items():

                def f(ex, z, sel, w, pol=pol):
                    return api.routed_experts(ex, z, sel, w, **BETA, policy=pol)

                args = (ex, z, sel, w)
                if l2_cold:
                    f, flush, junk = cold(f)
                    args, flush_us = (*args, junk), device_us(flush, junk)
                else:
                    f, flush_us = jax.jit(f), 0.0
                try:
                    with policy_lib.recording(policy_lib.DispatchLog()) as log:
                        outs[v] = f(*args)  # traced here: the log says what ran
                    row[f"{v}_ran"] = log.ops[api.OP]
                    row[f"{v}_us"] = device_us(f, *args) - flush_us
                    row[f"{v}_kernels"] = len(kernel_names(f, *args))
                    if v.startswith("kernel"):
                        row[f"{v}_per_kernel_us"] = [(n, round(t, 2)) for n, t in per_kernel_us(f, *args)]
                    row[f"{v}_of_floor"] = floor_us / row[f"{v}_us"]
                except Exception as e:  # noqa: BLE001  (a failure is a row entry, not the end of the run)
                    row[f"{v}_us"] = f"failed: {type(e).__name__}: {e}"[:300]
            ref = outs.get("xla_packed", next((o for k, o in outs.items() if k != "kernel"), None))
            if "kernel" in outs and ref is not None:
                a, b = outs["kernel"].astype(jnp.float32), ref.astype(jnp.float32)
                row["kernel_rel_rms_vs_xla"] = float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(b**2)))
            results["rows"].append(row)
            print({k: v for k, v in row.items() if not k.endswith("per_kernel_us")}, flush=True)
            pathlib.Path(out_dir, f"{name}.json").write_text(json.dumps(results, indent=1))
            names = ["kernel", *(f"kernel_{n}" for n, _ in kernel_variants), *(f"xla_{i}" for i in impls)]
            write_table(results, pathlib.Path(out_dir, f"{name}.md"), names)
        del ex


def run_once(tp, T):
    """One kernel call at TP tp and T tokens, nothing timed: the process to put under ncu (--once)."""
    ex = experts(jax.random.key(tp), I_TP1 // tp)
    z, sel, w = inputs(jax.random.key(1000 + T), T)
    pol = kernel_policy()
    jax.block_until_ready(jax.jit(lambda *a: api.routed_experts(*a, **BETA, policy=pol))(ex, z, sel, w))


def run_profile(out_dir, tp, T, kernel_variants=()):
    """The two kernels' in-kernel traces at TP tp and T tokens (bench.kernel_trace): each phase's mean span, and
    when the phases run (a CTA's first span begins after its launch and its first loads), as tuned and per
    kernel variant -> OUT_DIR/moe_profile_tp{tp}_t{T}.json."""
    from bench.kernel_trace import phases, timeline
    from pallas_kernels.moe import sm90

    ex = experts(jax.random.key(tp), I_TP1 // tp)
    z, sel, _ = inputs(jax.random.key(1000 + T), T)
    tuning = kernel_policy().tuning.get("moe")
    rows = []
    for name, fields in (("tuned", {}), *kernel_variants):
        launch = sm90.pick_launch({"sm90": {**tuning["sm90"], "launch": [
            {**e, **fields} for e in tuning["sm90"]["launch"]]}}, T)  # fmt: skip
        tdir = os.path.join(out_dir, f"moe trace {name} TP{tp} T{T}")
        for n in ("gate_up", "down"):
            os.makedirs(os.path.join(tdir, n), exist_ok=True)
        f = jax.jit(lambda *a, launch=launch, tdir=tdir: sm90.grouped(*a, **BETA, launch=launch, profile_dir=tdir))
        jax.block_until_ready(f(ex, z, sel))
        row = dict(variant=name, tp=tp, T=T, launch=dict(vars(launch)))
        for n in ("gate_up", "down"):
            row[n] = dict(phases=phases(os.path.join(tdir, n)), timeline=timeline(os.path.join(tdir, n)))
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows)
    pathlib.Path(out_dir, f"moe_profile_tp{tp}_t{T}.json").write_text(json.dumps(out, indent=1))


def _cell(row, v):
    t = row.get(f"{v}_us")
    if not isinstance(t, float):
        return str(t or "-")[:60]
    return f"{t:.1f} ({row[f'{v}_kernels']}, {100 * row[f'{v}_of_floor']:.0f}%)"


def write_table(results, path, names):
    lines = [
        f"# Routed experts of one MoE sublayer ({results['device']}, jax {results['jax']})",
        "",
        f"{results['what']}; {results['measure']}; routing {results['routing']}"
        + (", the kernel with split_groups" if results["split_groups"] else "")
        + f"; floor = {results['floor']}. Cells: us (kernels, floor / time).",
        "",
        "| TP | T | distinct experts | largest group | floor us | " + " | ".join(f"{n} us" for n in names) + " |",
        "|---|---|---|---|---|" + "---|" * len(names),
    ]
    for r in results["rows"]:
        cells = " | ".join(_cell(r, n) for n in names)
        big = r.get("largest_group", "-")
        lines.append(f"| {r['tp']} | {r['T']} | {r['distinct']} | {big} | {r['floor_us']:.1f} | {cells} |")
    pathlib.Path(path).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    import argparse

    ints = lambda s: tuple(int(x) for x in s.split(","))
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", nargs="?", default=str(pathlib.Path(__file__).parent / "results"))
    ap.add_argument("--tps", type=ints, default=(16, 8))
    ap.add_argument("--tokens", type=ints, default=TOKENS)
    ap.add_argument("--impls", type=lambda s: tuple(i for i in s.split(",") if i), default=("packed", "gather"))
    ap.add_argument("--name", default="moe_layer")
    ap.add_argument("--routing", choices=ROUTINGS, default="uniform")
    ap.add_argument("--cold", action="store_true", help="flush the L2 before each call")
    ap.add_argument("--split-groups", action="store_true", help="the kernel with tuning's split_groups on")
    ap.add_argument(
        "--kernel-variant",
        type=parse_kernel_variant,
        action="append",
        default=[],
        help="NAME:field=int,...: a kernel column with these launch fields on every sm90 entry (repeatable)",
    )
    ap.add_argument("--once", type=ints, default=None, help="TP,T: one kernel call, nothing timed (for ncu)")
    ap.add_argument("--profile", type=ints, default=None, help="TP,T: the kernels' in-kernel traces")
    a = ap.parse_args()
    if a.once:
        run_once(*a.once)
        sys.exit(0)
    if a.profile:
        run_profile(a.out_dir, *a.profile, kernel_variants=a.kernel_variant)
        sys.exit(0)
    main(a.out_dir, a.tps, a.tokens, a.impls, a.name, a.routing, a.cold, a.split_groups, a.kernel_variant)
