"""TP16 rank-slice emulation on ONE GPU: exactly one tensor-parallel rank's share of every layer at real widths.

Why: we cannot run 16 GB300s, but one rank's decode step is a fixed amount of local work (6 KDA heads, 6 MLA
heads, 1/16 of every expert's intermediate, split latent projections and router, 1/16 of lm_head, the whole
replicated MLA latent cache). Collectives are replaced by shape-preserving LOCAL no-ops (`StubComm`) and counted,
so the collective term is added separately from bench/collectives.py measurements (bench/projection.py).

- Weights: the tensor table with every tp-mapped axis divided by tp, generated on the GPU by one jitted
  `params.init_tensor` program per layer kind (~97 GB for the release at tp=16).
- Timing: CUPTI per-kernel device time of single decode steps (the cache is donated and threaded through, so
  the MLA cache write is in place as in serving); kernels are put in layers by launch order (each sublayer
  ends in an AttnRes join) and in decode ops by their fusion's op_name label in the optimised HLO.
- Wall: one step a Python call (the host's dispatch included), and --loop-steps steps as one program (a lax.scan,
  as the engine's decode loop: what serving sees); --trace: the loop's device timeline (bench/step_trace.py),
  taken after every CUPTI measurement.
- Floor: bytes one rank must move per step (weights read at this batch, KDA state read+write, MLA latent read,
  the AttnRes blocks each boundary mixes) / 4.8 TB/s, and / the copy bandwidth measured here.
- --speculative K: also the DSpark speculative round at each (layers, backend, batch), as speculative._step
  runs it but in three programs timed apart: verify over [anchor + K drafts] with synthetic acceptance, the
  commit, the drafter (observe + propose; one rank's share: its layers split as the target's, the rest whole,
  its all-reduces stubbed and counted); tokens/s at a synthetic
  acceptance length (--acceptance-length, default 6) -> the outputs' "speculative" section.
- --mix-norm-single-device [on|off]: the layer boundaries under latency_specialized as the boundary kernel minus
  its exchange (the launch a TP16 rank runs) or as XLA's kernels, overriding the collectives tuning's
  mix_norm_single_device for this run only (decode_policy); the segmenting knows the kernel by its name.
- --tuning OP.SECTION.KEY=JSON (repeatable): any tuning.json entry set for this run only, e.g.
  `--tuning kda_decode.sm90.state_in_place=true`: a switch measured both ways from one checkout.

Device: PYTHONPATH=. python3 bench/rank_slice.py --out $OUT [--layers 24] [--backends xla,latency_specialized]
  [--speculative 7] [--mix-norm-single-device [on|off]]
CPU check: python bench/rank_slice.py --preset demo --layers 4 --batches 1,2 --out /tmp/rs [--speculative 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import cache as cache_lib
from k3jax import model
from k3jax import params as params_lib
from k3jax import sharding as sh
from k3jax import speculative as spec_lib
from k3jax.comm import Comm
from k3jax.config import K3Config, preset
from k3jax.layers import moe
from pallas_kernels.collectives.mix_norm import BOUNDARY_KERNEL, NORM_KERNEL
from pallas_kernels.policy import MOE_IMPLS, DecodePolicy

HBM_BW = 4.8e12  # H200 datasheet, bytes/s
INIT_SCALE_MAX = 127  # the generated experts' largest scale byte may not exceed this (decode_policy)
BATCHES = (1, 2, 4, 8, 16, 32, 64)


# ---- the stub communicator --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StubComm(Comm):
    """Acts as one rank of a `tp`-way group, but every collective is a local op with the real output shape.
    all_reduce -> identity; all_gather -> the local block tiled tp times (a local write of the gathered size),
    the MoE's routing block as a balanced router's (balanced_routing_piece) where experts_local is set;
    local_start -> the first block; embed -> local lookup of clipped ids. `log` records (op, what, shape,
    dtype) of every collective traced, for the projection's collective term."""

    tp: int = 16
    experts_local: int = 0  # the routed experts a rank scores: > 0 makes the routing gather balanced
    log: list = field(default_factory=list, compare=False, hash=False)

    @property
    def exchange_axis(self) -> str | None:
        # no real axis: a layer boundary is the launch a TP16 rank runs minus the exchange (the boundary kernel at
        # n == 1 where the collectives tuning allows it, else the XLA ops); the exchange's cost is the
        # projection's collective term, from the log
        return None

    def _note(self, op, what, x):
        self.counts[what] += 1
        self.log.append((op, what, tuple(x.shape), str(x.dtype)))

    def note_fused(self, what: str, x) -> None:  # logged as the all-reduce it stands for, as all_reduce is
        self._note("all_reduce", what, x)

    def all_reduce(self, x, what: str = "all_reduce"):
        self._note("all_reduce", what, x)
        return x

    def all_gather(self, x, axis: int, what: str = "all_gather"):
        self._note("all_gather", what, x)
        pieces = [x] * self.tp
        if what == "routing" and self.experts_local:
            pieces = [balanced_routing_piece(x, self.experts_local, r) for r in range(self.tp)]
        return jnp.concatenate(pieces, axis=axis % x.ndim)

    def local_start(self, size: int):
        return jnp.int32(0)  # the first block (traced, as a real rank's)

    def embed(self, table_VD, tokens):
        rows = table_VD[jnp.clip(tokens, 0, table_VD.shape[0] - 1)]
        self._note("all_reduce", "embed", rows)
        return rows


def balanced_routing_piece(piece_TX, e_local: int, rank: int):
    """Rank `rank`'s piece of the MoE's routing block [T, E_l scores | E_l biased scores | L_l of z]
    (layers/moe.gather_routing), as a trained, balanced router's would look: the local piece with a fixed
    N(0, 1) offset per (token, expert) added to the biased scores, which pick the experts (the weights come from
    the unbiased ones). Tiled as it is, every token's k choices were one local expert's copies, and the random
    weights' hidden states left few local winners: at batch 64 the step read 96-128 distinct experts of the ~613
    that uniform routing (the floor's) reads (bench/NOTES.md, twenty-ninth session). With the offsets the
    choices are ~uniform, a different set per token; the offsets are constants of the step (the same every
    step, no kernel of their own: XLA adds them inside the stub's concatenate)."""
    noise = np.random.default_rng(rank).standard_normal((piece_TX.shape[0], e_local))
    return piece_TX.at[:, e_local : 2 * e_local].add(jnp.asarray(noise, piece_TX.dtype))


# ---- one rank's parameters and decode state ------------------------------------------------------------------


def truncate(cfg: K3Config, layers: int | None) -> K3Config:
    """The first `layers` layers (the release's MLA-every-4th pattern keeps the kinds in proportion)."""
    if not layers or layers >= cfg.num_hidden_layers:
        return cfg
    return cfg.replace(num_hidden_layers=layers, full_attn_layers=tuple(x for x in cfg.full_attn_layers if x <= layers))


def local_shape(spec: params_lib.TensorSpec, tp: int) -> tuple[int, ...]:
    out = []
    for n, axis in zip(spec.shape, spec.axes, strict=True):
        if axis and sh.RULES.get(axis):
            if n % tp:
                raise ValueError(f"{spec.key}: axis {axis}={n} does not divide by tp={tp}")
            n //= tp
        out.append(n)
    return tuple(out)


def local_table(cfg: K3Config, tp: int) -> list[params_lib.TensorSpec]:
    return [dataclasses.replace(s, shape=local_shape(s, tp)) for s in params_lib.tensor_table(cfg)]


def local_drafter_table(dc, tp: int) -> list[params_lib.TensorSpec]:
    """One rank's share of the DSpark drafter's tensors (drafter_params.param_specs: the same rules)."""
    from k3jax import drafter_params as DP

    DP.check_tp(dc, tp)
    return [dataclasses.replace(s, shape=local_shape(s, tp)) for s in DP.tensor_table(dc)]


def local_cfg(cfg: K3Config, tp: int) -> K3Config:
    """For the decode state only: KDA heads are split; the MLA latent cache is replicated (full width)."""
    return cfg.replace(kda_num_heads=cfg.kda_num_heads // tp)


def _init(spec, key):
    """params.init_tensor, except the packed MXFP4 codes/scales (~90% of the bytes): randint draws two 32-bit
    words per byte, which made generating 98 GB take minutes; random bytes give the same distribution for codes
    (uniform 0..255) and a 3-value spread around the same centre for scales."""
    if spec.init not in ("codes", "scales"):
        return params_lib.init_tensor(spec, key)
    bits = jax.random.bits(jax.random.fold_in(key, params_lib.seed_for(spec.path)), spec.shape, jnp.uint8)
    if spec.init == "codes":
        return bits
    centre = 127 - round(math.log2(2.3 * math.sqrt(spec.fan_in)))
    return (bits % 3 + (centre - 1)).astype(jnp.uint8)


def _gen(specs, key):
    return params_lib.unflatten({s.path: _init(s, key) for s in specs})


def init_local_params(cfg: K3Config, tp: int, seed: int = 0, progress=None, pool=None) -> dict:
    """Random local parameters, generated on the device: one jitted program per layer kind (the layer index
    enters through the key), one for the embedding/head tensors. The programs compile in `pool` if given."""
    per_layer, top = defaultdict(list), []
    for s in local_table(cfg, tp):
        if s.path[0] == "layers":
            per_layer[s.path[1]].append(dataclasses.replace(s, path=s.path[2:]))
        else:
            top.append(s)
    base = jax.random.key(seed)
    kinds = {tuple(v) for v in per_layer.values()} | {tuple(top)}
    submit = pool.submit if pool else (lambda f, *a: _Done(f(*a)))
    futures = {specs: submit(lambda sp: jax.jit(partial(_gen, sp)).lower(base).compile(), specs) for specs in kinds}
    programs = {specs: f.result() for specs, f in futures.items()}
    layers = []
    for L in range(cfg.num_hidden_layers):
        layers.append(programs[tuple(per_layer[L])](jax.random.fold_in(base, L)))
        if progress:
            progress(L)
    out = programs[tuple(top)](jax.random.fold_in(base, 1 << 20))
    out["layers"] = layers
    return out


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def abstract_local_params(cfg: K3Config, tp: int) -> dict:
    return params_lib.unflatten(
        {s.path: jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)) for s in local_table(cfg, tp)}
    )


def new_cache(cfg: K3Config, tp: int, batch: int, context: int, dtype=jnp.bfloat16):
    """A rank's decode state, `context` positions, with lengths near the end (the whole latent is read every
    step whatever the length; the writes stay in range)."""

    def make():
        c = cache_lib.init_cache(local_cfg(cfg, tp), batch, context, dtype, "fp8")
        c["lengths"] = jnp.full((batch,), max(context - 64, 0), jnp.int32)
        return c

    return jax.jit(make)()


def tuning_override(text: str) -> tuple[list[str], object]:
    """ "OP.SECTION.KEY=JSON" (or "OP.KEY=JSON") -> (path, value); a clear error for anything else."""
    path, sep, value = text.partition("=")
    keys = path.split(".")
    if not sep or len(keys) not in (2, 3) or not all(keys):
        raise SystemExit(f"--tuning {text!r}: write OP.SECTION.KEY=VALUE or OP.KEY=VALUE (VALUE as JSON, e.g. true)")
    try:
        return keys, json.loads(value)
    except json.JSONDecodeError:
        raise SystemExit(f'--tuning {text!r}: the value must be JSON (true, 3, "rows", ...)') from None


def decode_policy(args, backend: str) -> DecodePolicy:
    """The run's decode policy for `backend`: --moe-impl, --mix-norm-single-device (on / off) set in the
    collectives table and each --tuning entry, for this run only (tuning.json keeps its defaults), so one checkout
    measures both sides of a switch."""
    # init_params draws expert scale bytes around 127 - log2(2.3 sqrt(fan_in)), below 127 at K3's widths (checked
    # on the generated weights): the bound the experts' kernels read, as the engine's policy reads the loaded one
    policy = DecodePolicy(backend, args.moe_impl, expert_scale_max=INIT_SCALE_MAX)
    tuning = policy.tuning
    if args.mix_norm_single_device is not None:
        tuning = tuning.with_entries("collectives", mix_norm_single_device=args.mix_norm_single_device == "on")
    for text in args.tuning:
        (op, *section, key), value = tuning_override(text)
        table = tuning.get(op)
        if section:
            tuning = tuning.with_entries(op, **{section[0]: dict(table[section[0]], **{key: value})})
        else:
            tuning = tuning.with_entries(op, **{key: value})
    return policy.replace(tuning=tuning)


def make_step(cfg: K3Config, comm: Comm, dtype=jnp.bfloat16):
    """One greedy decode step for the whole batch: (params, tokens [B], cache) -> (next tokens, cache). Every
    sequence is active, but as the engine's step sees it: n_new is data (here from the tokens), not a constant
    XLA could fold away with the idle-slot handling it costs."""

    return jax.jit(_greedy_step(cfg, comm, dtype), donate_argnums=(2,))


def _greedy_step(cfg: K3Config, comm: Comm, dtype=jnp.bfloat16):
    def step(params, tokens_B, cache):
        n_new_B = (tokens_B >= 0).astype(jnp.int32)
        logits, cache, _ = model.extend(params, tokens_B[:, None], n_new_B, cache, cfg, dtype, comm=comm)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    return step


def make_loop(cfg: K3Config, comm: Comm, steps: int, dtype=jnp.bfloat16):
    """`steps` greedy decode steps in ONE program, a lax.scan over make_step's step as the engine's decode loop
    runs them (k3jax/engine.py _decode_steps): its wall time per step is what serving sees, without the host's
    per-call dispatch between steps."""
    step = _greedy_step(cfg, comm, dtype)

    def loop(params, tokens_B, cache):
        (tokens_B, cache), _ = jax.lax.scan(lambda c, _: (step(params, *c), None), (tokens_B, cache), None, steps)
        return tokens_B, cache

    return jax.jit(loop, donate_argnums=(2,))


# ---- the speculative round (--speculative K) ---------------------------------------------------------------
# speculative._step is one program: propose, verify, accept, commit, observe. Here it is three, each timed on
# its own: verify + accept (the target's forward over the block), commit (KDA state advance: per KDA layer,
# outside the trunk, so launch order would put it in embed/head), and the drafter (observe + propose: one rank's
# share, DSparkDrafter.param_specs: its layers split by heads and FFN intermediate, the Markov head whole).


def make_verify(cfg: K3Config, comm: Comm, acceptance_length: float, dtype=jnp.bfloat16):
    """(params, anchor [B], drafts [B,K], cache, key) -> (n_commit [B], next anchor [B], pending, key):
    speculative.verify over [anchor + K drafts], then synthetic acceptance (greedy next token)."""

    def step(params, anchor_B, drafts_BK, cache, key):
        block = jnp.concatenate([anchor_B[:, None], drafts_BK], axis=1)
        logits, pending, _ = spec_lib.verify(params, block, cache, cfg, dtype, comm=comm)
        key, k_acc = jax.random.split(key)
        n_acc, nxt = spec_lib.accept_synthetic(k_acc, logits, drafts_BK, acceptance_length, 0.0)
        return n_acc + 1, nxt, pending, key

    return jax.jit(step, donate_argnums=(3,))


def make_commit(comm: Comm):
    """(pending without its commit data, the commit data, n_commit [B]) -> cache: speculative.commit of the
    anchor + accepted drafts. Only the cache is donated: the commit data have no output to alias."""

    def step(cache, kda_commit, n_commit_B):
        return spec_lib.commit(dict(cache, kda_commit=kda_commit), n_commit_B, comm.policy)

    return jax.jit(step, donate_argnums=(0,))


def _split_pending(pending: dict) -> tuple[dict, dict]:
    return {k: v for k, v in pending.items() if k != "kda_commit"}, pending["kda_commit"]


def drafter_config(cfg: K3Config, tp: int):
    """The released DSpark drafter where it fits the target (k3), else a tiny one made for it, with a head a
    rank (its layers split over tp as the release's are: DSparkDrafter.param_specs)."""
    from k3jax import drafter_params as DP

    try:
        DP.check_target(DP.DSparkConfig(), cfg)
        return DP.DSparkConfig()
    except ValueError:
        from convert.fake_dspark import tiny_dspark_config

        return tiny_dspark_config(cfg, heads=tp)


def make_drafter_round(drafter, num_draft: int, comm: Comm, dtype=jnp.bfloat16):
    """(draft params, target embed/head, state, anchor, drafts, n_commit, lengths, taps) -> (next drafts, state):
    observe the committed block, then propose K drafts after the new anchor (the step proposes first and
    observes last; per round the work is the same). Greedy drafting: synthetic acceptance ignores the drafts."""

    def step(dp, head, state, anchor_B, drafts_BK, n_commit_B, lengths_B, taps, next_B):
        block = jnp.concatenate([anchor_B[:, None], drafts_BK], axis=1)
        state = drafter.observe(dp, head, state, block, n_commit_B, lengths_B - n_commit_B, taps, comm=comm)
        key = jax.random.key(0)  # unused at temperature 0
        prop = drafter.propose(dp, head, state, next_B, lengths_B, num_draft, key, 0.0, comm=comm)
        return prop.drafts_BK, state

    return jax.jit(step, donate_argnums=(2,))


# ---- bytes and the floor ----------------------------------------------------------------------------------


def distinct_experts(cfg: K3Config, batch: int) -> float:
    E, k = cfg.num_experts, cfg.num_experts_per_token
    return E * (1 - (1 - k / E) ** batch)


def attnres_block_reads(cfg: K3Config) -> int:
    """Stored AttnRes blocks one token's decode step reads: at every mix site its sources but the live prefix
    (docs/model.md §2.4; layer 0's attention has none). Each boundary reads them whatever else it fuses."""
    sites = sum(cfg.attn_res_sources(L, s) - 1 for L in range(cfg.num_hidden_layers) for s in ("attn", "mlp"))
    return sites + cfg.attn_res_sources(cfg.num_hidden_layers - 1, "output") - 1


def floor_bytes(cfg: K3Config, tp: int, batch: int, context: int) -> dict:
    """Bytes one rank must move for one decode step of `batch` sequences (each weight read once; the residual
    stream and its stored blocks are replicated: every rank reads them whole, in bf16 as run() measures)."""
    weights = 0.0
    for s in local_table(cfg, tp):
        if s.init == "embed":
            continue  # B rows of the embedding: negligible
        frac = distinct_experts(cfg, batch) / cfg.num_experts if s.active < 1 else 1.0
        weights += s.nbytes * frac
    lc = local_cfg(cfg, tp)
    H, K = lc.kda_num_heads, lc.kda_head_dim
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    kda_state = 2 * n_kda * batch * (H * K * K * 4 + 3 * (cfg.kda_conv_size - 1) * H * K * 2)
    mla_cache = n_mla * batch * context * (cfg.mla_cache_width + 8)  # fp8 row + two fp32 scales
    attnres = attnres_block_reads(cfg) * batch * cfg.hidden_size * 2
    total = weights + kda_state + mla_cache + attnres
    return {
        "weights": int(weights),
        "kda_state_rw": kda_state,
        "mla_latent_read": mla_cache,
        "attnres_blocks_read": attnres,
        "total": int(total),
    }


OPS = ("KDA", "MLA", "routed experts", "router", "latent", "FFN", "boundary", "embed/head")


def op_of_tensor(path: tuple, cfg: K3Config) -> str:
    """The decode op (OPS) that reads a weight: attention tensors by the layer's kind, the MoE's by role."""
    if path[0] != "layers":
        return "embed/head"
    part, name = path[2], path[3] if len(path) > 3 else ""
    if part == "attn":
        return cfg.layer_kind(path[1]).split("_")[0].upper()  # KDA / MLA
    if part == "ffn":
        if name == "experts":
            return "routed experts"
        if name.startswith("router"):
            return "router"
        return "latent" if name.startswith("latent") else "FFN"  # FFN: shared experts, layer 0's dense MLP
    return "boundary"  # the norms and AttnRes weights around each sublayer


def op_floor_bytes(cfg: K3Config, tp: int, batch: int, context: int) -> dict:
    """floor_bytes split by decode op: {op: bytes one rank must move for it per step}."""
    out = dict.fromkeys(OPS, 0.0)
    for s in local_table(cfg, tp):
        if s.init == "embed":
            continue
        frac = distinct_experts(cfg, batch) / cfg.num_experts if s.active < 1 else 1.0
        out[op_of_tensor(s.path, cfg)] += s.nbytes * frac
    fb = floor_bytes(cfg, tp, batch, context)
    out["KDA"] += fb["kda_state_rw"]
    out["MLA"] += fb["mla_latent_read"]
    out["boundary"] += fb["attnres_blocks_read"]
    return out


# ---- CUPTI timing ------------------------------------------------------------------------------------------


def _cupti():
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    return mosaic_gpu_lib._mosaic_gpu_ext


def time_steps(step, params, tokens, cache, iters: int):
    """CUPTI kernels of `iters` consecutive decode steps (cache threaded, as in serving) ->
    (per-step kernel lists [(name, us)], tokens, cache). profiler.measure re-feeds the same arguments, which a
    donated cache forbids, so this is its loop with the state threaded through."""
    ext = _cupti()
    ext._cupti_init()
    try:
        for _ in range(iters):
            tokens, cache = step(params, tokens, cache)
        jax.block_until_ready((tokens, cache))
    finally:
        timings = ext._cupti_get_timings(True)
    n = len(timings) // iters
    if n * iters != len(timings):
        raise RuntimeError(f"{len(timings)} kernels over {iters} steps")
    per_step = [[(name, 1e3 * ms) for name, ms in timings[i * n : (i + 1) * n]] for i in range(iters)]
    return per_step, tokens, cache


def cupti_call(f, *args):
    """(f(*args), its kernels [(name, us)]): CUPTI over one call, the inputs ready first so that no earlier
    work lands in it."""
    jax.block_until_ready(args)
    ext = _cupti()
    ext._cupti_init()
    try:
        out = jax.block_until_ready(f(*args))
    finally:
        timings = ext._cupti_get_timings(True)
    return out, [(name, 1e3 * ms) for name, ms in timings]


SPEC_PROGRAMS = ("verify", "commit", "drafter")


def spec_rounds(exes, p, dp, head, taps, st, rounds: int, timed: bool):
    """`rounds` speculative rounds, state (anchor, drafts, cache, drafter state) threaded as in serving ->
    ({program: per-round kernel lists} if timed, st)."""
    verify, commit, drafter = exes
    call = cupti_call if timed else (lambda f, *a: (f(*a), []))
    anchor, drafts, cache, dstate, key = st
    kernels = {k: [] for k in SPEC_PROGRAMS}
    for _ in range(rounds):
        (n_commit, nxt, pending, key), kv = call(verify, p, anchor, drafts, cache, key)
        cache, kc = call(commit, *_split_pending(pending), n_commit)
        (drafts, dstate), kd = call(drafter, dp, head, dstate, anchor, drafts, n_commit, cache["lengths"], taps, nxt)
        anchor = nxt
        for k, ks in zip(SPEC_PROGRAMS, (kv, kc, kd), strict=True):
            kernels[k].append(ks)
    return (kernels if timed else None), (anchor, drafts, cache, dstate, key)


def wall_per_step_us(step, params, tokens, cache, iters: int):
    """Wall time per step of `iters` steps dispatched back to back (steps are ms long, dispatch ~150 us, so
    the queue stays full: this includes the gaps between kernels that CUPTI's kernel sum does not)."""
    jax.block_until_ready((tokens, cache))
    t0 = time.perf_counter()
    for _ in range(iters):
        tokens, cache = step(params, tokens, cache)
    jax.block_until_ready((tokens, cache))
    return 1e6 * (time.perf_counter() - t0) / iters, tokens, cache


def traced(program, params, cache, batch: int, steps_per_call: int, args, log):
    """bench/step_trace.py's timeline summary of --iters back-to-back calls of `program` (a step, or the
    engine-style loop of steps_per_call steps), the state threaded through from a fresh cache."""
    from bench import step_trace

    state = [jnp.zeros((batch,), jnp.int32), cache]

    def run():
        t, c = state
        for _ in range(args.iters):
            t, c = program(params, t, c)
        jax.block_until_ready((t, c))
        state[:] = [t, c]

    run()  # warm
    try:
        summary = step_trace.trace_steps(run, args.iters * steps_per_call)
    except Exception as e:  # a trace is extra: never lose the run for it
        log(f"trace failed: {e!r}")
        summary = {"error": repr(e)[:1000]}
    if summary and "span_us_per_step" in summary:
        log(
            f"trace: span {summary['span_us_per_step']:.0f} us/step, busy {summary['busy_us_per_step']:.0f}, idle "
            f"before { ({k: round(v) for k, v in summary['idle_us_per_step_before_kind'].items()}) }, by kind "
            f"{ ({k: round(v) for k, v in summary['us_per_step_by_kind'].items()}) }"
        )
    return summary


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Achievable HBM bandwidth here: CUPTI time of x + 1 over `nbytes` of bf16 (read + write)."""
    from jax.experimental.mosaic.gpu import profiler

    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: x + 1)
    _, ms = profiler.measure(f, iterations=5)(x)
    return 2 * nbytes / (1e-3 * statistics.median(ms))


# ---- attributing kernels to layers ----------------------------------------------------------------------------

_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name="([^"]*)"')
_SCOPE = re.compile(r"layer(\d+)_((?:kda|mla)_(?:moe|dense))")


def _norm(name: str) -> str:
    return re.sub(r"[.\-]", "_", name)


def hlo_scopes(hlo_text: str) -> dict[str, tuple[int | None, str]]:
    """Instruction name (as kernels are named) -> (layer or None, op label without the layer scope)."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, op = m.groups()
        s = _SCOPE.search(op)
        label = op[s.end() + 1 :] if s else op.split("/", 1)[-1]
        label = re.sub(r"\[.*?\]|\d+", "", label.replace("jit(step)/", "")) or op
        out[_norm(name)] = (int(s.group(1)) if s else None, label)
    return out


def attribute(kernels, scopes, cfg: K3Config):
    """-> one dict per kernel: name, us, layer (None: embed/head), kind, op, named, sublayer.

    The op label comes from the HLO (the fusion's op_name); the layer from the kernel ORDER (`segment`): a
    kernel name does not say its layer. XLA reuses one compiled kernel for identical fusions under one fusion's
    name, and that fusion need not be the earliest (under latency_specialized the step's first kernels carry
    names of layer 3's fusions, so a running maximum of the mapped layers put every kernel in layer >= 3), and
    Mosaic and library kernels have no HLO name at all."""
    rows = []
    for name, us in kernels:
        hit = scopes.get(_norm(name))
        rows.append(
            {
                "name": name,
                "us": us,
                "layer": hit[0] if hit else None,
                "op": hit[1] if hit else name,
                "named": hit is not None,
            }
        )
    return assign_layers(rows, cfg)


_BOUNDARY_LABELS = frozenset(("n...d,d->n...", "n...,n...d->...d", "reduce_precision"))
_LIBRARY_NAMES = ("gemm", "nvjet", "cutlass", "cublas", "xmma")


def _is_boundary_kernel(r) -> bool:
    """The layer-boundary kernel (mix_norm.py with AttnRes): the whole join in one launch. Its trace name, as
    every Mosaic kernel's, maps to no HLO instruction, so it is known by the kernel name mix_norm gives it."""
    return r["name"].startswith(BOUNDARY_KERNEL)


def _starts_join(r) -> bool:
    """A join's first kernel: XLA's boundary (a kernel labelled with the AttnRes einsums or reduce_precision) or
    the boundary kernel."""
    return _label(r["op"]) in _BOUNDARY_LABELS or _is_boundary_kernel(r)


def _opens_sublayer(r) -> bool:
    """A kernel that only a sublayer's own work launches (never a join): a projection or primitive labelled
    with a non-boundary op, a library GEMM, a Mosaic kernel other than the boundary kernel (the MoE's latent
    norm, the same kernel without AttnRes, is one), or a kernel traced inside a kernel wrapper. The boundary
    kernel's XLA preparation (labelled _BOUNDARY_SCOPE) is neither: XLA may schedule it anywhere before."""
    lab, n = _label(r["op"]), r["name"].lower()
    if lab in _OP_OF_LABEL:
        return _OP_OF_LABEL[lab] != "boundary"
    if _is_boundary_kernel(r) or lab.startswith(_BOUNDARY_SCOPE):
        return False
    return "mosaic" in n or any(k in n for k in _LIBRARY_NAMES) or lab.startswith(_WRAPPERS)


def segment(rows, n_layers: int) -> list[tuple[int, int] | None] | None:
    """(layer, sublayer: 0 attention, 1 FFN) of each kernel from the launch order alone, or None when the
    sequence does not split into n_layers layers.

    Every sublayer ends in a join (the AttnRes mix and norm: XLA's kernels labelled with the boundary einsums or
    reduce_precision, or the one boundary kernel), so a step is: embed, then per layer [attention, join, FFN,
    join], then the head. A join runs from its first kernel (_starts_join) to the next kernel that opens a
    sublayer (the generic norm kernels between are the join's); the kernels before the first sublayer-opening
    kernel are the embedding, those after the 2 x n_layers-th join the head."""
    joins, open_join, started = 0, False, False
    out = []
    for r in rows:
        if _starts_join(r):
            open_join = started  # a boundary label before any sublayer is the embedding's norm
        elif _opens_sublayer(r):
            joins += open_join
            open_join, started = False, True
        inside = started and joins < 2 * n_layers
        out.append((joins // 2, joins % 2) if inside else None)
    joins += open_join
    return out if joins == 2 * n_layers else None


def assign_layers(rows, cfg: K3Config):
    """Each row's layer, sublayer and kind: from `segment`; where the order does not split into the config's
    layers (never seen so far), from the HLO scopes' running maximum (`relayer`), marked segmented=False."""
    seg = segment(rows, cfg.num_hidden_layers)
    if seg is None:
        rows = relayer(rows, cfg)
        for r in rows:
            r["sublayer"], r["segmented"] = None, False
        return rows
    for r, s in zip(rows, seg, strict=True):
        r["layer"], r["sublayer"] = s if s else (None, None)
        r["segmented"] = True
        r["kind"] = cfg.layer_kind(r["layer"]) if r["layer"] is not None else "embed/head"
    return rows


def relayer(rows, cfg: K3Config):
    """The layer as the running maximum of the HLO-mapped layers (right only where each reused kernel is named
    after its earliest fusion, as under XLA; the fallback of `assign_layers`)."""
    mapped = [i for i, r in enumerate(rows) if r["named"] and r["layer"] is not None]
    first, last = (mapped[0], mapped[-1]) if mapped else (len(rows), -1)
    running = None
    for i, r in enumerate(rows):
        if r["named"] and r["layer"] is not None:
            running = r["layer"] if running is None else max(running, r["layer"])
            r["layer"] = running
        elif r["named"]:
            r["layer"] = None if (i < first or i > last) else running
        else:
            r["layer"] = running if i > first else None
        r["kind"] = cfg.layer_kind(r["layer"]) if r["layer"] is not None else "embed/head"
    return rows


def kernel_class(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "xmma", "nvjet", "cutlass", "cublas", "dot")):
        return "gemm"
    if "mosaic" in n:
        return "pallas"
    if "reduce" in n:
        return "reduce fusion"
    if "fusion" in n:
        return "loop fusion"
    return "other"


def summarize(rows, cfg: K3Config) -> dict:
    total = sum(r["us"] for r in rows)
    layers_of = Counter(cfg.layer_kinds)
    by_kind = defaultdict(lambda: [0.0, 0])
    for r in rows:
        by_kind[r["kind"]][0] += r["us"]
        by_kind[r["kind"]][1] += 1
    kinds = {}
    for k, (us, n) in by_kind.items():
        nl = layers_of.get(k, 1)
        kinds[k] = {
            "layers": nl if k in layers_of else 0,
            "us_total": us,
            "us_per_layer": us / nl,
            "kernels_per_layer": n / nl,
        }
    ops = defaultdict(lambda: [0.0, 0, ""])
    for r in rows:
        key = (r["kind"], r["op"])
        ops[key][0] += r["us"]
        ops[key][1] += 1
        ops[key][2] = ops[key][2] or r["name"]
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:15]
    classes = defaultdict(lambda: [0.0, 0])
    for r in rows:
        c = classes[kernel_class(r["name"])]
        c[0] += r["us"]
        c[1] += 1
    return {
        "us": total,
        "kernels": len(rows),
        "named_fraction": sum(r["named"] for r in rows) / max(len(rows), 1),
        "layers_from": "launch order" if rows and rows[0].get("segmented") else "HLO scopes",
        "boundary_kernels": sum(_is_boundary_kernel(r) for r in rows),  # the joins that ran as one launch
        "by_kind": kinds,
        "top_ops": [
            {
                "kind": k,
                "op": op,
                "us": v[0],
                "kernels": v[1],
                "example_kernel": v[2],
                "share": v[0] / total if total else 0.0,
            }
            for (k, op), v in top
        ],
        "by_class": {c: {"us": v[0], "kernels": v[1]} for c, v in classes.items()},
        "by_op": by_op(rows),
    }


# ---- attributing kernels to decode ops ---------------------------------------------------------------------
# A kernel's label is the primitive at its fusion's root: a projection's einsum spec, or a primitive name. Where
# only one decode op has the label, the kernel is that op's; otherwise it belongs to the op before it, and a
# few labels hand over to the op that follows them in a layer (a sublayer's last projection to the boundary
# after it, MoE's latent_down to the routed experts, their combine back to the latent path). Approximate by a
# few us per layer where XLA fuses across two ops (a boundary's first reduction, the shared-expert GEMVs that
# run between the routed ones).
_OP_LABELS = {
    "KDA": ("...d,shkd->...shk", "...d,rd->...r", "...r,rhk->...hk", "...d,dh->...h", "...c,dc->...d"),
    "MLA": (
        "q_a/bd,nd->bn",  # mla_in_projections: each output's named scope
        "kv_a/bd,nd->bn",
        "g/bd,nd->bn",
        "btq,qhe->bthe",
        "bthe,bse->bhts",
        "bthr,bsr->bhts",
        "bhts,bsr->bthr",
        "bthr,hvr->bthv",
        "bthn,hnr->bthr",
        "bsr,hnr->bshn",
        "bsr,hvr->bshv",
        "...k,kd->...d",
        "scatter",
    ),
    "boundary": ("n...d,d->n...", "n...,n...d->...d", "reduce_precision"),
    "router": ("router/bd,nd->bn", "top_k", "neg", "jit(take_along_axis)/select_n"),
    "latent": ("latent_down/bd,nd->bn", "latent_up/bk,nk->bn", "tl,dl->td"),  # (tl,dl->td: before moe.finish)
    "routed experts": ("tkl,tk->tl",),
    "FFN": (
        "...d,df->...f",
        "...f,fd->...d",
        "shared_gate/bd,nd->bn",
        "shared_up/bd,nd->bn",
        "shared_down/bk,nk->bn",  # moe.finish's reference (its kernel: a Mosaic kernel after the latent path)
        "ts,ds->td",
    ),
}
_OP_OF_LABEL = {lab: op for op, labs in _OP_LABELS.items() for lab in labs}
_HANDS_OVER = {
    "...c,dc->...d": "boundary",
    "...k,kd->...d": "boundary",
    "tl,dl->td": "boundary",
    "ts,ds->td": "boundary",
    "latent_up/bk,nk->bn": "boundary",
    "shared_down/bk,nk->bn": "boundary",
    "latent_down/bd,nd->bn": "routed experts",
    "jit(take_along_axis)/select_n": "routed experts",
    "tkl,tk->tl": "latent",
}
_LIBRARY = ("gemm", "nvjet", "cutlass", "cublas")
# labels of the ops traced inside a Pallas kernel's jitted wrapper (its function name): the routed-experts
# kernel's grouping, the MLA decode kernel's split partials and combine
_WRAPPERS = ("jit(grouped)", "jit(attention)")
_OP_OF_WRAPPER = {"jit(grouped)": "routed experts", "jit(attention)": "MLA"}
# the named scope of the boundary kernel's XLA preparation (the api's AttnRes query, res_norm x res_proj in fp32)
_BOUNDARY_SCOPE = "mix_norm/"
_ROUTING = ("top_k", "moe_route")  # the top-k selection: the router's, also amid the routed experts' kernels


def _label(op: str) -> str:
    return op.split("/dot_general")[0]


def _attention_op(r) -> str:
    return "MLA" if r.get("kind", "").startswith("mla") else "KDA"


def _labelled_op(r) -> str | None:
    """The op a kernel's label or name alone says (the boundary kernel: the boundary), else None."""
    return "boundary" if _is_boundary_kernel(r) else _OP_OF_LABEL.get(_label(r["op"]))


def decode_ops(rows) -> list[str]:
    """The decode op (OPS) of each kernel of one step, in launch order (rows: attribute()'s dicts).

    Mosaic kernels carry no label (anonymous_mosaic_gpu_kernel): in an attention sublayer they are its layer
    kind's attention (KDA: the projections, the recurrence, o_proj; MLA: the decode kernel), in an FFN sublayer
    the routed experts' gate/up and down after the router, else the FFN's; moe_route_topk is the router's, the
    boundary kernel (mix_norm with AttnRes) the boundary's, the same kernel without AttnRes the latent norm's, and
    the MoE's finish after it (latent_up + shared_down in one GEMV launch, moe.finish) the FFN's (its larger
    weight). The boundary kernel's XLA preparation is the boundary's wherever XLA put it."""
    if not rows or rows[0].get("segmented"):
        inside = [r["layer"] is not None for r in rows]
        first, last = (inside.index(True), len(rows) - 1 - inside[::-1].index(True)) if any(inside) else (0, -1)
    else:  # HLO running maximum: the head starts after the last kernel a layer's scope names
        inside = [r["layer"] is not None for r in rows]
        if not any(inside):
            return ["embed/head"] * len(rows)
        first = inside.index(True)
        last = max(i for i, r in enumerate(rows) if r["layer"] is not None and r["op"] != r["name"])
    out, current = [], "boundary"
    for i, r in enumerate(rows):
        lab, name, sub = _label(r["op"]), r["name"].lower(), r.get("sublayer")
        wrapper = next((w for w in _WRAPPERS if lab.startswith(w)), None)
        if i < first or i > last or not inside[i]:
            op = "embed/head"
        elif _is_boundary_kernel(r):
            op = current = "boundary"
        elif r["name"].startswith(NORM_KERNEL):
            op = current = "latent"  # the latent MoE's routed_expert_norm, after the combine (as XLA's)
        elif lab.startswith(_BOUNDARY_SCOPE):
            op = "boundary"  # params only: XLA may run it amid another op, which goes on after it
        elif any(k in name or k == lab for k in _ROUTING):
            op = "router"
            if current != "routed experts":
                current = "routed experts" if "mosaic" in name else op  # the kernel's outputs feed the grouping
        elif wrapper:
            op = current = _OP_OF_WRAPPER[wrapper]
        elif "mosaic" in name:
            if sub == 0 or (sub is None and current in ("boundary", "KDA", "MLA")):
                op = current = _attention_op(r)
            else:
                op = current = "routed experts" if current in ("router", "routed experts") else "FFN"
        elif lab in _OP_OF_LABEL and not (sub == 1 and _OP_OF_LABEL[lab] in ("KDA", "MLA")):
            # (an attention label in an FFN sublayer is a generic one, e.g. the grouping's scatter)
            op = _OP_OF_LABEL[lab]
            if not (op == "FFN" and current == "routed experts"):  # shared-expert GEMVs amid the routed ones
                current = _HANDS_OVER.get(lab, op)
        elif current == "boundary" and any(k in name for k in _LIBRARY):
            # a library GEMM after a boundary opens the next sublayer: the attention in an attention sublayer,
            # else the op of the next labelled kernel, or (no projection before the next boundary) layer 0's FFN
            nxt = next((_labelled_op(x) for x in rows[i + 1 :] if _labelled_op(x)), "")
            op = current = _attention_op(r) if sub == 0 else "FFN" if nxt in ("", "boundary") else nxt
        else:
            op = current
        out.append(op)
    return out


def by_op(rows) -> dict:
    """{decode op: {"us", "kernels", "us_by_kind"}} of one step's attributed kernels."""
    out = {}
    for r, op in zip(rows, decode_ops(rows), strict=True):
        e = out.setdefault(op, {"us": 0.0, "kernels": 0, "us_by_kind": {}})
        e["us"] += r["us"]
        e["kernels"] += 1
        e["us_by_kind"][r["kind"]] = e["us_by_kind"].get(r["kind"], 0.0) + r["us"]
    return out


# ---- the run ------------------------------------------------------------------------------------------------


def collective_calls(cfg: K3Config, tp: int, backend: str, batch: int, context: int) -> list:
    """The collectives one decode step issues (traced abstractly, nothing runs)."""
    comm = StubComm("tp", DecodePolicy(backend), tp=tp, experts_local=cfg.num_experts // tp)
    step = make_step(cfg, comm)
    cache = jax.eval_shape(lambda: new_cache(cfg, tp, batch, context))
    jax.eval_shape(step, abstract_local_params(cfg, tp), jax.ShapeDtypeStruct((batch,), jnp.int32), cache)
    return comm.log


def machine() -> dict:
    d = jax.devices()[0]
    return {
        "device": d.device_kind,
        "platform": d.platform,
        "devices": jax.device_count(),
        "host": platform.node(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _plan(args) -> list[tuple[int, str, int]]:
    """(layers, backend, batch) to measure, in priority order: the sweep at --layers, then --full-batches at
    the full depth (one weight set serves both: a truncated model uses the first layers)."""
    full = preset(args.preset).num_hidden_layers
    layers = args.layers or full
    batches = [int(b) for b in str(args.batches).split(",")]
    order = sorted(batches, key=lambda B: (B not in (1, 64), B))
    keys = [(layers, be, B) for B in order for be in args.backends.split(",")]
    if layers != full and args.full_batches:
        keys += [(full, be, int(B)) for B in str(args.full_batches).split(",") for be in args.backends.split(",")]
    return keys


def run(args, log=print) -> dict:
    t_start = time.perf_counter()
    base_cfg = preset(args.preset)
    tp, ctx = args.tp, args.context
    keys = _plan(args)
    cfg = truncate(base_cfg, max(k[0] for k in keys))  # the weights cover the deepest program
    on_gpu = jax.default_backend() == "gpu"
    result = {
        "machine": machine(),
        "config": base_cfg.name,
        "preset": args.preset,
        "tp": tp,
        "full_layers": base_cfg.num_hidden_layers,
        "context": ctx,
        "cache_dtype": "fp8",
        "dtype": "bfloat16",
        "moe_impl": args.moe_impl,
        # the layer boundaries under latency_specialized: the boundary kernel minus its exchange, or XLA's
        "mix_norm_single_device": decode_policy(args, "latency_specialized").table("collectives")[
            "mix_norm_single_device"
        ],
        "mix_norm_single_device_from": "tuning.json" if args.mix_norm_single_device is None else "the command line",
        "tuning_overrides": list(args.tuning),
        "local_weight_bytes": sum(s.nbytes for s in local_table(cfg, tp)),
        "active_bytes_per_device_b1": sh.active_bytes_per_device(base_cfg, tp),
        "runs": [],
    }
    log(
        f"rank slice: {args.preset} x {cfg.num_hidden_layers} layers, tp={tp}, context {ctx}, "
        f"{result['local_weight_bytes'] / 1e9:.1f} GB local weights; plan {keys}"
    )
    result["copy_bw"] = copy_bandwidth() if on_gpu else None

    # compile every program in threads (XLA compiles outside the GIL) while the weights are generated on the
    # device; batch 1 and 64 first, so a budget cut loses the middle of the sweep
    def compile_one(n, backend, B):
        c = truncate(base_cfg, n)
        comm = StubComm("tp", decode_policy(args, backend), tp=tp, experts_local=c.num_experts // tp)
        cache = jax.eval_shape(lambda: new_cache(c, tp, B, ctx))
        t = time.perf_counter()
        shapes = (abstract_local_params(c, tp), jax.ShapeDtypeStruct((B,), jnp.int32), cache)
        exe = make_step(c, comm).lower(*shapes).compile()
        loop = make_loop(c, comm, args.loop_steps).lower(*shapes).compile() if args.loop_steps and on_gpu else None
        return comm, (exe, loop), time.perf_counter() - t

    pool = cf.ThreadPoolExecutor(max_workers=args.compile_threads)
    jobs = {k: pool.submit(compile_one, *k) for k in keys}
    spec_jobs = submit_spec(args, base_cfg, keys, pool) if args.speculative else None
    t = time.perf_counter()
    bar = _bar(cfg.num_hidden_layers, "weights")
    gen_pool = cf.ThreadPoolExecutor(max_workers=4)
    params = init_local_params(cfg, tp, args.seed, progress=lambda L: bar.update(1), pool=gen_pool)
    jax.block_until_ready(params)
    bar.close()
    gen_pool.shutdown()
    assert moe.expert_scale_max(params) <= INIT_SCALE_MAX, "the weights' scales exceed the policy's bound"
    result["weights_gen_s"] = time.perf_counter() - t
    log(f"weights generated in {result['weights_gen_s']:.1f} s (t={time.perf_counter() - t_start:.0f} s)")

    rng = np.random.default_rng(args.seed)
    to_trace = []  # (entry, key, program): traced after every CUPTI measurement (a trace breaks later CUPTI use)
    for key in keys:
        n, backend, B = key
        c = truncate(base_cfg, n)
        p = dict(params, layers=params["layers"][:n])
        left = args.budget_s - (time.perf_counter() - t_start)
        try:
            comm, programs, secs = jobs[key].result(timeout=max(left, 0.01))
        except cf.TimeoutError:
            log(f"budget reached waiting for {n} layers {backend} b{B}: skipped")
            continue
        except Exception as e:  # one program failing must not lose the others
            log(f"compile failed for {n} layers {backend} b{B}: {e!r}")
            result.setdefault("errors", []).append(f"L{n}/{backend}/b{B} compile: {e!r}"[:2000])
            continue
        result.setdefault("compile_s", {})[f"L{n}/{backend}/b{B}"] = secs
        if time.perf_counter() - t_start > args.budget_s:
            log(f"budget reached: skipping {n} layers {backend} b{B}")
            continue
        try:
            entry = _measure(args, result, c, p, comm, programs, key, rng, on_gpu, log, t_start)
        except Exception as e:
            log(f"run failed for {n} layers {backend} b{B}: {e!r}")
            result.setdefault("errors", []).append(f"L{n}/{backend}/b{B} run: {e!r}"[:2000])
            continue
        result["runs"].append(entry)
        if args.trace and on_gpu:
            step_exe, loop_exe = programs
            to_trace.append((entry, key, loop_exe or step_exe, args.loop_steps if loop_exe else 1))
        del programs
        jobs[key] = None
        if args.out:
            write(result, args.out, args.tag)
    for entry, (n, _, B), program, per_call in to_trace:
        p = dict(params, layers=params["layers"][:n])
        entry["trace"] = traced(program, p, new_cache(truncate(base_cfg, n), tp, B, ctx), B, per_call, args, log)
        if args.out:
            write(result, args.out, args.tag)
    if spec_jobs:
        run_spec(args, result, base_cfg, keys, spec_jobs, params, rng, on_gpu, log, t_start)
    pool.shutdown(wait=False, cancel_futures=True)
    result["total_s"] = time.perf_counter() - t_start
    return result


def _measure(args, result, c, p, comm, programs, key, rng, on_gpu, log, t_start) -> dict:
    n, backend, B = key
    exe, loop = programs  # the step, and the engine-style loop of --loop-steps steps (or None)
    tp, ctx = args.tp, args.context
    cache = new_cache(c, tp, B, ctx)
    tokens = jnp.asarray(rng.integers(0, c.vocab_size, B), jnp.int32)
    for _ in range(2):  # warm-up
        tokens, cache = exe(p, tokens, cache)
    jax.block_until_ready(cache)
    entry = {
        "layers": n,
        "layer_kinds": dict(Counter(c.layer_kinds)),
        "backend": backend,
        "batch": B,
        "collectives": dict(comm.counts),
        "collective_calls": [list(x) for x in comm.log],
    }
    fb = floor_bytes(c, tp, B, ctx)
    entry["floor_bytes"] = fb
    entry["floor_us"] = 1e6 * fb["total"] / HBM_BW
    if on_gpu:
        try:
            per_step, tokens, cache = time_steps(exe, p, tokens, cache, args.iters)
        except Exception as e:  # keep a wall-time result if CUPTI is unavailable
            log(f"CUPTI failed: {e!r}")
            entry["error"] = repr(e)[:1000]
            entry["wall_us_per_step"], tokens, cache = wall_per_step_us(exe, p, tokens, cache, args.iters)
            entry["step_us"] = None
            return entry
        sums = [sum(us for _, us in k) for k in per_step]
        rows = attribute(per_step[0], hlo_scopes(exe.as_text()), c)
        entry["step_us"] = statistics.median(sums)
        entry["step_us_all"] = sums
        entry["summary"] = summarize(rows, c)
        entry["kernels"] = [[r["name"], round(r["us"], 3), r["layer"], r["op"]] for r in rows]
        entry["wall_us_per_step"], tokens, cache = wall_per_step_us(exe, p, tokens, cache, args.iters)
        if loop is not None:
            tokens, cache = loop(p, tokens, cache)  # its first call
            wall, tokens, cache = wall_per_step_us(loop, p, tokens, cache, args.iters)
            entry["wall_us_per_step_loop"] = wall / args.loop_steps
            entry["loop_steps"] = args.loop_steps
        entry["frac_floor"] = entry["floor_us"] / entry["step_us"]
        if result["copy_bw"]:
            entry["frac_copy_bw_floor"] = 1e6 * fb["total"] / result["copy_bw"] / entry["step_us"]
        log(
            f"L{n} {backend:>20} b{B:<3} step {entry['step_us']:9.1f} us  wall {entry['wall_us_per_step']:9.1f}"
            f" us (loop {entry.get('wall_us_per_step_loop', float('nan')):.1f})"
            f"  {entry['summary']['kernels']} kernels  floor {entry['floor_us']:.0f} us "
            f"({100 * entry['frac_floor']:.1f}%)  named {entry['summary']['named_fraction']:.2f}"
            f"  (t={time.perf_counter() - t_start:.0f} s)"
        )
    else:  # CPU: structure only (no CUPTI); wall time of one step for orientation
        entry["wall_us_per_step"], tokens, cache = wall_per_step_us(exe, p, tokens, cache, 1)
        entry["step_us"] = None
    entry["full_estimate_us"] = full_model_estimate(result, entry)["step_us"] if on_gpu else None
    del cache
    return entry


def submit_spec(args, base_cfg: K3Config, keys, pool) -> dict:
    """Compile the speculative programs in `pool`: verify + commit per key, the drafter per batch."""
    from k3jax.drafter import DSparkDrafter

    K, tp, ctx = args.speculative, args.tp, args.context
    al = float(min(args.acceptance_length, K + 1))
    dc = drafter_config(base_cfg, tp)
    drafter = DSparkDrafter(dc)

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    def compile_spec(n, backend, B):
        c = truncate(base_cfg, n)
        comm = StubComm("tp", decode_policy(args, backend), tp=tp, experts_local=c.num_experts // tp)
        cache = jax.eval_shape(lambda: new_cache(c, tp, B, ctx))
        key = jax.eval_shape(lambda: jax.random.key(0))
        t = time.perf_counter()
        lowered = make_verify(c, comm, al).lower(abstract_local_params(c, tp), i32(B), i32(B, K), cache, key)
        verify = lowered.compile()
        commit = make_commit(comm).lower(*_split_pending(lowered.out_info[2]), i32(B)).compile()
        return comm, (verify, commit), time.perf_counter() - t

    def compile_drafter(B):
        comm = StubComm("tp", DecodePolicy("xla"), tp=tp)  # the drafter's ops take no decode policy
        top = abstract_local_params(truncate(base_cfg, 1), tp)
        dp = params_lib.unflatten(
            {s.path: jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)) for s in local_drafter_table(dc, tp)}
        )
        state = jax.eval_shape(lambda: drafter.init_state(B, ctx, jnp.bfloat16))
        taps = {L: jax.ShapeDtypeStruct((B, K + 1, base_cfg.hidden_size), jnp.bfloat16) for L in dc.target_layer_ids}
        t = time.perf_counter()
        exe = make_drafter_round(drafter, K, comm).lower(
            dp, {k: top[k] for k in ("embed", "lm_head")}, state, i32(B), i32(B, K), i32(B), i32(B), taps, i32(B)
        )
        return comm, exe.compile(), time.perf_counter() - t

    return {
        "acceptance_length": al,
        "drafter": drafter,
        "progs": {k: pool.submit(compile_spec, *k) for k in keys},
        "drafter_progs": {B: pool.submit(compile_drafter, B) for B in sorted({k[2] for k in keys})},
    }


def run_spec(args, result, base_cfg: K3Config, keys, jobs, params, rng, on_gpu, log, t_start):
    """The "speculative" section: one entry per key, after the plain ones (their programs compile meanwhile)."""
    from k3jax.drafter_params import DSparkConfig

    K, dc = args.speculative, jobs["drafter"].config
    dspecs = local_drafter_table(dc, args.tp)
    spec = result["speculative"] = {
        "num_draft": K,
        "tokens_per_verify": K + 1,
        "acceptance_length": jobs["acceptance_length"],
        "acceptance_length_requested": args.acceptance_length,
        "definition": SPEC_DEFINITION,
        "drafter": {
            "kind": "dspark",
            "config": "release" if dc == DSparkConfig() else "tiny (convert.fake_dspark)",
            "layers": dc.num_hidden_layers,
            "weight_bytes": sum(s.nbytes for s in dspecs),
        },
        "compile_s": {},
        "runs": [],
    }
    dp = jax.jit(partial(_gen, dspecs))(jax.random.key(args.seed + 1))  # one rank's share of the drafter
    head = {k: params[k] for k in ("embed", "lm_head")}
    for key in keys:
        n, backend, B = key
        name = f"L{n}/{backend}/b{B}"
        left = args.budget_s - (time.perf_counter() - t_start)
        try:
            comm, (verify, commit), secs = jobs["progs"][key].result(timeout=max(left, 0.01))
            dcomm, draft_exe, dsecs = jobs["drafter_progs"][B].result(timeout=max(left, 0.01))
        except cf.TimeoutError:
            log(f"budget reached waiting for speculative {name}: skipped")
            continue
        except Exception as e:
            log(f"speculative compile failed for {name}: {e!r}")
            result.setdefault("errors", []).append(f"{name} speculative compile: {e!r}"[:2000])
            continue
        spec["compile_s"][name] = secs
        spec["compile_s"][f"drafter/b{B}"] = dsecs
        if time.perf_counter() - t_start > args.budget_s:
            log(f"budget reached: skipping speculative {name}")
            continue
        c = truncate(base_cfg, n)
        p = dict(params, layers=params["layers"][:n])
        try:
            entry = _measure_spec(
                args, result, c, p, dp, head, (verify, commit, draft_exe), jobs["drafter"], key, rng, on_gpu
            )
        except Exception as e:
            log(f"speculative run failed for {name}: {e!r}")
            result.setdefault("errors", []).append(f"{name} speculative run: {e!r}"[:2000])
            continue
        entry["collectives"] = dict(comm.counts)
        entry["drafter_collectives"] = dict(dcomm.counts)
        spec["runs"].append(entry)
        if entry["verify_us"] is not None:
            est = entry["full_estimate"]
            log(
                f"L{n} {backend:>20} b{B:<3} verify {entry['verify_us']:9.1f} us ({entry['verify_kernels']} kernels)"
                f"  commit {entry['commit_us']:.1f}  drafter {entry['drafter_us']:.1f}  est. round "
                f"{est['round_us']:.0f} us  {entry['tokens_per_s']:.0f} tok/s at AL {spec['acceptance_length']}"
                f"  (t={time.perf_counter() - t_start:.0f} s)"
            )
        if args.out:
            write(result, args.out, args.tag)


def _measure_spec(args, result, c, p, dp, head, exes, drafter, key, rng, on_gpu) -> dict:
    n, backend, B = key
    K, tp, ctx = args.speculative, args.tp, args.context
    rounds = 2 + 2 * args.iters
    cache = new_cache(c, tp, B, ctx)
    cache["lengths"] = jnp.full((B,), max(ctx - 64 - (K + 1) * rounds, 0), jnp.int32)  # every round's rows fit
    dstate = jax.jit(lambda: drafter.init_state(B, ctx, jnp.bfloat16))()
    taps = {  # what verify would tap at the drafter's layers: random, a truncated target may not have them
        L: jax.random.normal(jax.random.key(L), (B, K + 1, c.hidden_size), jnp.bfloat16)
        for L in drafter.config.target_layer_ids
    }
    st = (
        jnp.asarray(rng.integers(0, c.vocab_size, B), jnp.int32),
        jnp.asarray(rng.integers(0, c.vocab_size, (B, K)), jnp.int32),
        cache,
        dstate,
        jax.random.key(args.seed),
    )
    _, st = spec_rounds(exes, p, dp, head, taps, st, 2, False)  # warm-up
    entry = {"layers": n, "layer_kinds": dict(Counter(c.layer_kinds)), "backend": backend, "batch": B}
    for prog in SPEC_PROGRAMS:
        entry[f"{prog}_us"] = None
    if on_gpu:
        kernels, st = spec_rounds(exes, p, dp, head, taps, st, args.iters, True)
        for prog in SPEC_PROGRAMS:
            sums = [sum(us for _, us in k) for k in kernels[prog]]
            entry[f"{prog}_us"] = statistics.median(sums)
            entry[f"{prog}_us_all"] = sums
            entry[f"{prog}_kernels"] = len(kernels[prog][0])
        rows = attribute(kernels["verify"][0], hlo_scopes(exes[0].as_text()), c)
        entry["summary"] = summarize(rows, c)
        entry["kernels"] = [[r["name"], round(r["us"], 3), r["layer"], r["op"]] for r in rows]
        for prog in ("commit", "drafter"):
            entry[f"{prog}_kernel_list"] = [[name, round(us, 3)] for name, us in kernels[prog][0]]
    iters = args.iters if on_gpu else 1
    jax.block_until_ready(st)
    t = time.perf_counter()
    _, st = spec_rounds(exes, p, dp, head, taps, st, iters, False)
    jax.block_until_ready(st)
    entry["wall_us_per_round"] = 1e6 * (time.perf_counter() - t) / iters
    entry.update(spec_estimate(result, entry, result["speculative"]["acceptance_length"]))
    return entry


SPEC_DEFINITION = (
    "acceptance_length: tokens a sequence emits per verify round (accepted drafts + the correction or bonus "
    "token), fixed by speculative.synthetic_rates; tokens/s = batch x acceptance_length / (verify + commit + "
    "drafter) device time per round, verify and commit scaled to the full model, no collectives"
)


def spec_estimate(result: dict, entry: dict, acceptance_length: float) -> dict:
    """A speculative entry at the full depth: verify by layer kind (full_model_estimate), commit by the count of
    KDA layers (its lengths update is one tiny kernel), the drafter as measured (it has no target layers)."""
    if entry.get("verify_us") is None:
        return {"full_estimate": None, "tokens_per_s": None}
    full = preset(result["preset"])
    run_like = {"layers": entry["layers"], "step_us": entry["verify_us"], "summary": entry["summary"]}
    verify = full_model_estimate(result, run_like)["step_us"]
    commit = entry["commit_us"] * len(full.kda_layers) / max(len(truncate(full, entry["layers"]).kda_layers), 1)
    round_us = verify + commit + entry["drafter_us"]
    return {
        "full_estimate": {
            "verify_us": verify,
            "commit_us": commit,
            "drafter_us": entry["drafter_us"],
            "round_us": round_us,
        },
        "tokens_per_s": entry["batch"] * acceptance_length / round_us * 1e6,
    }


def _bar(total, desc):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, mininterval=2)
    except ImportError:  # pragma: no cover

        class _B:
            def update(self, n):
                pass

            def close(self):
                pass

        return _B()


def markdown(result: dict) -> str:
    m, F = result["machine"], result["full_layers"]
    runs = [r for r in result["runs"] if r.get("step_us") is not None]
    lines = [
        f"# TP{result['tp']} rank slice on one {m['device']}: decode step device time (CUPTI)",
        "",
        f"{result['preset']} config, one rank's share at tp={result['tp']}, MLA latent cache "
        f"{result['context']} positions fp8 (read whole every step), bf16 activations, random weights generated "
        f"on the device ({result['local_weight_bytes'] / 1e9:.1f} GB local). Collectives are local no-ops "
        f"here (counted; their cost is in the projection). jax {m['jax']}, {m['date']}.",
        "",
    ]
    if "mix_norm_single_device" in result and any(r["backend"] == "latency_specialized" for r in result["runs"]):
        on, src = result["mix_norm_single_device"], result["mix_norm_single_device_from"]
        ran = [
            f"{r['layers']} layers b{r['batch']}: {r['summary']['boundary_kernels']}"
            for r in runs
            if r["backend"] == "latency_specialized" and "boundary_kernels" in r["summary"]
        ]
        how = "the boundary kernel (mix_norm.py) minus its exchange, where it takes the call" if on else "XLA's kernels"
        lines += [
            f"Layer boundaries under latency_specialized: {how} (mix_norm_single_device {str(on).lower()}, from {src})"
            + (f"; boundary kernels per step: {', '.join(ran)}." if ran else "."),
            "",
        ]
    if result.get("tuning_overrides"):
        lines += [f"Tuning set for this run (--tuning): {', '.join(result['tuning_overrides'])}.", ""]
    if result.get("copy_bw"):
        lines += [
            f"Measured copy bandwidth (x+1 over 2 GiB): {result['copy_bw'] / 1e12:.2f} TB/s; the floor uses "
            f"{HBM_BW / 1e12:.1f} TB/s.",
            "",
        ]
    if any(r["layers"] != F for r in runs):
        lines += [
            f"Rows with fewer than {F} layers are truncated models (the first N layers: the kinds in "
            f"proportion); 'est. {F}-layer' scales each kind's measured time per layer by its count in the "
            f"full model (embed/head once).",
            "",
        ]
    lines += [
        "'wall us/step' dispatches one step a call from Python; 'loop wall' runs the engine's way, "
        "--loop-steps steps in one program (a lax.scan: no host dispatch between steps).",
        "",
        f"| layers | backend | batch | step us | wall us/step | loop wall us/step | kernels | floor us | % of floor | "
        f"% of copy-bw floor | est. {F}-layer us | tok/s, no collectives |",
        "|---|" * 12 + "",
    ]
    lines[-1] = "|" + "---|" * 12
    for r in runs:
        est = r.get("full_estimate_us") or r["step_us"]
        lines.append(
            f"| {r['layers']} | {r['backend']} | {r['batch']} | {r['step_us']:.0f} | "
            f"{r['wall_us_per_step']:.0f} | {r.get('wall_us_per_step_loop', float('nan')):.0f} | "
            f"{r['summary']['kernels']} | {r['floor_us']:.0f} | "
            f"{100 * r['frac_floor']:.1f} | {100 * r.get('frac_copy_bw_floor', float('nan')):.1f} | "
            f"{est:.0f} | {r['batch'] / est * 1e6:.0f} |"
        )
    lines += [
        "",
        "Per layer kind: device time per layer / kernels per layer (kernels put in layers by launch order: "
        "every sublayer ends in an AttnRes join; 'named' = share of kernels with an HLO fusion name, whose "
        "op_name labels the op):",
        "",
        "| layers | backend | batch | " + " | ".join(_KINDS) + " | named |",
        "|" + "---|" * (len(_KINDS) + 4),
    ]
    for r in runs:
        bk = r["summary"]["by_kind"]
        cells = [
            f"{bk[k]['us_per_layer']:.1f} us / {bk[k]['kernels_per_layer']:.1f}" if k in bk else "-" for k in _KINDS
        ]
        lines.append(
            f"| {r['layers']} | {r['backend']} | {r['batch']} | "
            + " | ".join(cells)
            + f" | {r['summary']['named_fraction']:.2f} |"
        )
    traced = [r for r in runs if (r.get("trace") or {}).get("span_us_per_step")]
    if traced:
        lines += [
            "",
            "The device timeline of back-to-back steps (--trace, bench/step_trace.py): per step, the span from the "
            "first event's start to the last one's end, the time some event runs, the idle time between events "
            "(by the kind of the event that waits), and the events a step by kind:",
            "",
            "| layers | backend | batch | span us | busy us | idle us | idle before (us) | events |",
            "|" + "---|" * 8,
        ]
        for r in traced:
            t = r["trace"]

            def cells(d, fmt="{:.0f}"):
                return ", ".join(f"{k} {fmt.format(v)}" for k, v in sorted(d.items()))

            lines.append(
                f"| {r['layers']} | {r['backend']} | {r['batch']} | {t['span_us_per_step']:.0f} | "
                f"{t['busy_us_per_step']:.0f} | {t['idle_us_per_step']:.0f} | "
                f"{cells(t['idle_us_per_step_before_kind'])} | {cells(t['events_per_step_by_kind'], '{:.1f}')} |"
            )
    for r in runs:
        if r["batch"] not in (1, 64) or r["layers"] != max(x["layers"] for x in runs):
            continue
        lines += [
            "",
            f"Top ops, {r['layers']} layers, {r['backend']}, batch {r['batch']}:",
            "",
            "| layer kind | op | us | kernels | share | e.g. kernel |",
            "|---|---|---|---|---|---|",
        ]
        for o in r["summary"]["top_ops"][:10]:
            lines.append(
                f"| {o['kind']} | {o['op'][:60]} | {o['us']:.0f} | {o['kernels']} | "
                f"{100 * o['share']:.1f}% | {o['example_kernel'][:50]} |"
            )
        lines += [
            "",
            "By kernel class: "
            + ", ".join(f"{c} {v['us']:.0f} us in {v['kernels']}" for c, v in r["summary"]["by_class"].items()),
        ]
    for r in runs:
        if r["batch"] not in (1, 64) or "by_op" not in r["summary"]:
            continue
        ops = op_table(result, r)
        total = sum(o["full_estimate_us"] for o in ops)
        lines += [
            "",
            f"By decode op, {r['layers']} layers, {r['backend']}, batch {r['batch']} (kernels attributed by their "
            f"fusion's label: approximate; floor = the op's bytes / {HBM_BW / 1e12:.1f} TB/s):",
            "",
            f"| op | us ({r['layers']} L) | kernels | floor us | x floor | est. {F}-layer us | share | "
            f"{F}-layer floor us |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for o in ops:
            x = f"{o['us'] / o['floor_us']:.1f}" if o["floor_us"] >= 1 else "-"  # no weights to speak of
            lines.append(
                f"| {o['op']} | {o['us']:.0f} | {o['kernels']} | {o['floor_us']:.1f} | {x} | "
                f"{o['full_estimate_us']:.0f} | {100 * o['full_estimate_us'] / total:.1f}% | {o['full_floor_us']:.1f} |"
            )
    if result["runs"]:
        r0 = result["runs"][0]
        lines += ["", f"Collectives per step at {r0['layers']} layers (stubbed, counted): {r0['collectives']}"]
    if result.get("speculative"):
        lines += spec_markdown(result)
    return "\n".join(lines) + "\n"


def spec_markdown(result: dict) -> list[str]:
    sp, F = result["speculative"], result["full_layers"]
    K, al = sp["num_draft"], sp["acceptance_length"]
    dr = sp["drafter"]
    lines = [
        "",
        f"## Speculative round: DSpark, K = {K} drafts, synthetic acceptance length {al:g}",
        "",
        f"speculative._step's round as three programs: verify (the target over [anchor + {K} drafts] per sequence:"
        f" MLA rows written for the block, KDA verify without state writes, the MoE over batch x {K + 1} tokens,"
        " logits at every row, synthetic acceptance), commit (KDA state and conv advanced by the accepted tokens),"
        f" drafter (DSpark observe of the committed block + propose of the next {K}; {dr['layers']} layers,"
        f" {dr['weight_bytes'] / 1e9:.2f} GB a rank: its layers split as the target's; its taps of the target are"
        f" random inputs here). {sp['definition']}. 'est. {F}-layer': verify scaled per layer kind as the decode"
        " step, commit by the count of KDA layers.",
        "",
    ]
    if al != sp["acceptance_length_requested"]:
        lines += [f"(acceptance length {sp['acceptance_length_requested']:g} asked; at most K + 1 = {K + 1}.)", ""]
    lines += [
        f"| layers | backend | batch | verify us | kernels | commit us | drafter us | est. {F}-layer verify us | "
        f"est. {F}-layer commit us | est. round us | tok/s, no collectives | x plain decode |",
        "|" + "---|" * 12,
    ]
    plain = {  # the decode step's tok/s (as in the first table) at the same layers, backend and batch
        (x["layers"], x["backend"], x["batch"]): x["batch"] / (x.get("full_estimate_us") or x["step_us"]) * 1e6
        for x in result["runs"]
        if x.get("step_us")
    }
    for r in sp["runs"]:
        if r.get("verify_us") is None:
            continue
        est = r["full_estimate"]
        base = plain.get((r["layers"], r["backend"], r["batch"]))
        gain = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        lines.append(
            f"| {r['layers']} | {r['backend']} | {r['batch']} | {r['verify_us']:.0f} | {r['verify_kernels']} | "
            f"{r['commit_us']:.0f} | {r['drafter_us']:.0f} | {est['verify_us']:.0f} | {est['commit_us']:.0f} | "
            f"{est['round_us']:.0f} | {r['tokens_per_s']:.0f} | {gain} |"
        )
    if sp["runs"]:
        r0 = sp["runs"][0]
        lines += ["", f"Collectives per verify at {r0['layers']} layers (stubbed, counted): {r0['collectives']}"]
    return lines


_KINDS = ("kda_dense", "kda_moe", "mla_moe", "mla_dense", "embed/head")


def full_model_estimate(result: dict, run_entry: dict) -> dict:
    """Scale a truncated run to the full model: per-kind time per layer x the kind's count in the full model."""
    full = preset(result["preset"])
    if run_entry["layers"] == full.num_hidden_layers:
        return {"step_us": run_entry["step_us"], "scaled": False}
    bk = run_entry["summary"]["by_kind"]
    us = bk.get("embed/head", {}).get("us_total", 0.0)
    measured = [k for k in bk if k != "embed/head"]
    for k, n in Counter(full.layer_kinds).items():
        if k not in bk:  # a kind missing from the truncation: the same attention type, else any measured kind
            k = next((x for x in measured if x.split("_")[0] == k.split("_")[0]), measured[0])
        us += n * bk[k]["us_per_layer"]
    return {"step_us": us, "scaled": True}


def op_table(result: dict, run_entry: dict) -> list[dict]:
    """Per decode op of one run: measured us and floor us at the run's depth, and both scaled to the full model
    (each layer kind's time by its count in the full model, as full_model_estimate; the floor recomputed)."""
    full = preset(result["preset"])
    cfg = truncate(full, run_entry["layers"])
    B, tp, ctx = run_entry["batch"], result["tp"], result["context"]
    floor = op_floor_bytes(cfg, tp, B, ctx)
    floor_full = op_floor_bytes(full, tp, B, ctx)
    measured = Counter(cfg.layer_kinds)
    counts = Counter(full.layer_kinds)
    rows = []
    for op in OPS:
        e = run_entry["summary"]["by_op"].get(op, {"us": 0.0, "kernels": 0, "us_by_kind": {}})
        est = sum(us * (counts[k] / measured[k] if k in measured else 1.0) for k, us in e["us_by_kind"].items())
        rows.append(
            {
                "op": op,
                "us": e["us"],
                "kernels": e["kernels"],
                "floor_us": 1e6 * floor[op] / HBM_BW,
                "full_estimate_us": est,
                "full_floor_us": 1e6 * floor_full[op] / HBM_BW,
            }
        )
    return rows


def write(result: dict, out: str, tag: str = ""):
    os.makedirs(out, exist_ok=True)
    name = f"rank_slice{tag}"
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(markdown(result))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="k3")
    p.add_argument("--layers", type=int, default=None, help="truncate to the first N layers")
    p.add_argument("--tp", type=int, default=16)
    p.add_argument("--backends", "--backend", default="xla", help="comma list of xla,latency_specialized")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--full-batches", default="", help="also run these batches at the full depth (with --layers)")
    p.add_argument("--context", type=int, default=8192, help="MLA latent cache positions per sequence")
    p.add_argument(
        "--moe-impl",
        default=MOE_IMPLS[0],
        choices=MOE_IMPLS,
        help="how the XLA routed experts read MXFP4 (the decode policy's moe_impl)",
    )
    p.add_argument(
        "--mix-norm-single-device",
        nargs="?",
        const="on",
        choices=("on", "off"),
        default=None,
        help="the layer-boundary kernel without its exchange under latency_specialized (on without a value), "
        "overriding the collectives tuning's mix_norm_single_device for this run (default: the tuning's)",
    )
    p.add_argument(
        "--tuning",
        action="append",
        default=[],
        metavar="OP.SECTION.KEY=JSON",
        help="set one tuning.json entry for this run only, e.g. kda_decode.sm90.state_in_place=true (repeatable; "
        "OP.KEY=JSON for a top-level key)",
    )
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--loop-steps",
        type=int,
        default=16,
        help="also time this many steps as ONE program (a lax.scan, as the engine's decode loop): the wall per "
        "step serving sees (0: off; doubles the compiles)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="also trace --iters calls of the loop (or the step) with the profiler, after every CUPTI measurement: "
        "the device timeline's idle time between kernels by kind, memcpy / memset (bench/step_trace.py) -> each "
        "run's 'trace'",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-threads", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=1e9, help="skip remaining measurements after this")
    p.add_argument(
        "--speculative",
        type=int,
        default=0,
        metavar="K",
        help="also time the DSpark verify round over anchor + K drafts (0: off)",
    )
    p.add_argument("--acceptance-length", type=float, default=6.0, help="synthetic, for --speculative's tokens/s")
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="")
    p.add_argument("--resummarize", default=None, help="recompute summaries of a saved rank_slice JSON")
    return p.parse_args(argv)


def resummarize(path: str) -> dict:
    """Recompute attribution and summaries of a saved result (kernel lists are kept in the JSON)."""
    with open(path) as f:
        result = json.load(f)
    for r in result["runs"]:
        if _reattribute(result, r):
            r["full_estimate_us"] = full_model_estimate(result, r)["step_us"]
    for r in (result.get("speculative") or {}).get("runs", []):
        if _reattribute(result, r):
            r.update(spec_estimate(result, r, result["speculative"]["acceptance_length"]))
    return result


def _reattribute(result: dict, r: dict) -> bool:
    if not r.get("kernels"):
        return False
    c = truncate(preset(result["preset"]), r["layers"])
    rows = assign_layers(
        [{"name": n, "us": us, "layer": L, "op": op, "named": op != n} for n, us, L, op in r["kernels"]], c
    )
    r["summary"] = summarize(rows, c)
    r["kernels"] = [[x["name"], x["us"], x["layer"], x["op"]] for x in rows]
    return True


def main(argv=None):
    args = parse_args(argv)
    result = resummarize(args.resummarize) if args.resummarize else run(args)
    if args.out:
        write(result, args.out, args.tag)
    print(markdown(result))


if __name__ == "__main__":
    main()
