"""The best public MXFP4 MoE kernel for Hopper at our MoE shapes, to learn from (never to copy): OpenAI's
triton_kernels (the triton repo's python/triton_kernels, release v3.6.0), whose matmul_ogs with routing is what
vLLM and SGLang run for MXFP4 MoE (gpt-oss) on an H100 / H200. Same table as bench/moe_layer.py, side by side.

  PYTHONPATH=.:bench/build/triton_kernels_src python3 bench/moe_triton.py [OUT_DIR] [--smoke] [--deadline-s 270]
      [--tps 16,8] [--tokens 1,2,4,8,16,32,64,128,512] [--variants triton,triton_cold,triton_routed,triton_w4]
      [--iters 30] [--name moe_triton]
  (GPU: torch + triton 3.6; writes OUT_DIR/NAME.{json,md} after every row; OUT_DIR defaults to bench/results;
  `bash bench/gpu_runs.sh moe_triton` runs it with the device tool's carry ["bench/build/triton_kernels_src"])

The carried source (bench/build/triton_kernels_src, git-ignored, 0.6 MB): triton-lang/triton at tag v3.6.0,
commit 7c56a5e40f7fd928dfd5c72902d5def0097db73a ("[release 3.6] Release Triton to pypi (#9254)"), its
python/triton_kernels directory as is (the package triton_kernels/, its tests/ and bench/), plus the repo's MIT
LICENSE; SOURCE names the commit. To make it again from any clone of triton that has the tag (it was taken from
a fork's copy of the upstream tag; github.com/yechenzhi/triton has the commit):
`git archive 7c56a5e4 python/triton_kernels LICENSE | tar -x -C /tmp`, then
copy /tmp/python/triton_kernels/. and /tmp/LICENSE into bench/build/triton_kernels_src/. v3.6.0 is the release
of the H200's installed triton 3.6.0; it has no routing() helper any more (removed after 3.5): routing is its
topk() + make_ragged_tensor_metadata() + RoutingData / GatherIndx / ScatterIndx, exactly as its
bench/distributed.py routing() does on one GPU and its tests/test_matmul.py init_routing_data() does.

What one call is (vLLM's triton_kernel_fused_experts on Hopper, biases dropped):
  h = matmul_ogs(z, w13, None, rdata, gather_indx=g, precision_config=pc13, fused_activation=swiglu)
  y = matmul_ogs(h, w2, None, rdata, scatter_indx=s, precision_config=pc2, gammas=rdata.gate_scal)
the first gathers each token's row per selected expert and applies the fused SwiGLU in its epilogue; the second
multiplies by the fp32 routing weight in its epilogue, writes the T x 16 rows to a scratch buffer, and its
reduce kernel sums each token's 16 rows (the combine) into y [T, 3584] bf16.

Variants (table columns):
  triton         the call above, its routing data (topk of the logits and the metadata) made once outside the
                 timing, as our kernel's bench starts from the selection and weights; scales swizzled for
                 num_warps = 8 (vLLM's choice for TP without EP); L2 warm from the last run (as moe_layer.md's rows)
  triton_cold    the same with a 256 MB L2 flush before each call (the flush kernel's time left out by name)
  triton_routed  the same plus its routing from random logits inside the call: topk (with its bitmatrix), the
                 bitmatrix and ragged metadata kernels, the gate_scal gather (the router GEMM itself left out)
  triton_w4      as triton with the scales swizzled for num_warps = 4 (block_n 128; its bench_mlp's choice for
                 batches <= 512)

Same as bench/moe_layer.py (our kernel's bench): E = 896 experts, top-16, L = 3584, I = 3072 / tp per rank (192 at
TP16, 384 at TP8); MXFP4 weights (E2M1 codes, one E8M0 scale per 32 along the reduction axis) with our random
distributions (uniform code bytes, scales 2^-7..2^-4), made on the device; z random bf16 [T, 3584]; uniform
routing (top-16 of independent normal scores per token); fp32 routing weights applied and summed in the combine;
device time = the kernels of one call summed (CUPTI, through torch.profiler), median of --iters runs; the floor
(distinct selected experts x OUR bytes per expert, 1.10 MB at TP16, 2.19 at TP8, / 4.8 TB/s).

What differs from our kernel (pallas_kernels.moe.routed_experts):
  - activation: triton_kernels' fused SwiGLU in gpt-oss form (gate = even, linear = odd columns of one W13,
    alpha 1.702, clamp limit 7.0) instead of our SiTU-GLU with separate w1 / w3; the same bytes and work class.
  - weights in its own Hopper layouts: W13 [E, L, 2I] and W2 [E, I, L] (K-major, "column-major" for
    matmul_ogs), values bit-twiddled by HopperMXValueLayout (both matrix dims padded to 64: W2's K = 192 at TP16
    becomes 256), scales swizzled by HopperMXScaleLayout for its num_warps (W13's N = 384 at TP16 padded to 512
    at num_warps 8). Its bytes per expert are in each row (tk_expert_mb); the floor keeps ours.
  - Hopper has no TMA for MXFP4 in it: the non-persistent kernel, block_k 128, block_n = 2 x num_warps x 16,
    block_m from its heuristic on 16T / 896 rows per expert (16 at T <= 128, 32 at T = 512), bf16 x bf16 MMA
    after an in-register MXFP4 -> bf16 upcast of the weights.
  - the combine is a separate reduce kernel over a scratch [16T, 3584] buffer, not fused into the down kernel.
  - its routing (triton_routed) is topk from logits; ours starts from the selection (the router's top-k is
    bench/moe_route.py's).
triton_rel_rms_vs_ref: the call's output against a torch reference built from the same (unswizzled) codes through
its upcast_from_mxfp_torch, at the T of --check-tokens; a wrong reading of its layouts shows up there.
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

E, L, K_TOP, I_TP1 = 896, 3584, 16, 3072
HBM_TB_S = 4.8  # H200 datasheet
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
VARIANTS = ("triton", "triton_cold", "triton_routed", "triton_w4")
ITERS = 30
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's, as vLLM passes them
L2_FLUSH_BYTES = 256 << 20  # 5x the H200's 50 MB L2, as bench/moe_layer.py --cold
MARK, FLUSH = "_k3_mark", "_k3_l2_flush"  # our separator kernels' names: left out of every sum
SMOKE_E = 64  # the smoke case's expert count (same widths as TP16, same kernels compiled)
TK_SRC = pathlib.Path(__file__).resolve().parent / "build" / "triton_kernels_src"
TK_COMMIT = "7c56a5e40f7fd928dfd5c72902d5def0097db73a"
DEVICE = "cuda"


def our_expert_bytes(I):
    """Bytes of one expert in our layout: w1, w3 [I, L] and w2 [L, I], half a byte per code plus a scale per 32."""
    return 3 * I * L // 2 + 3 * I * L // 32


def load_triton_kernels():
    """The triton_kernels modules this bench uses: installed, or the carried v3.6.0 source."""
    try:
        import triton_kernels  # noqa: F401

        source = f"importable: {os.path.dirname(triton_kernels.__file__)}"
    except ImportError:
        sys.path.insert(0, str(TK_SRC))
        source = f"carried source {TK_SRC}"
    import triton_kernels.matmul_ogs_details.opt_flags as opt_flags
    import triton_kernels.swiglu as swiglu
    from triton_kernels.matmul_ogs import (
        FlexCtx,
        FnSpecs,
        FusedActivation,
        GatherIndx,
        PrecisionConfig,
        RoutingData,
        ScatterIndx,
        matmul_ogs,
    )
    from triton_kernels.numerics import InFlexData
    from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch
    from triton_kernels.tensor import FP4, convert_layout, make_ragged_tensor_metadata, wrap_torch_tensor
    from triton_kernels.tensor_details import layout
    from triton_kernels.topk import topk

    tk = dict(
        opt_flags=opt_flags,
        swiglu=swiglu,
        FlexCtx=FlexCtx,
        FnSpecs=FnSpecs,
        FusedActivation=FusedActivation,
        GatherIndx=GatherIndx,
        PrecisionConfig=PrecisionConfig,
        RoutingData=RoutingData,
        ScatterIndx=ScatterIndx,
        matmul_ogs=matmul_ogs,
        InFlexData=InFlexData,
        upcast_from_mxfp_torch=upcast_from_mxfp_torch,
        FP4=FP4,
        convert_layout=convert_layout,
        make_ragged_tensor_metadata=make_ragged_tensor_metadata,
        wrap_torch_tensor=wrap_torch_tensor,
        layout=layout,
        topk=topk,
    )
    return type("TK", (), tk), source


# ---------------------------------------------------------------------------------------------------------------
# timing: CUPTI kernel times through torch.profiler, one call per group between our separator kernels
# ---------------------------------------------------------------------------------------------------------------


try:  # the separator kernels need triton at import (a module-level jit): without it only --help works
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

if triton is not None:

    @triton.jit
    def _k3_mark(X):
        tl.store(X, tl.load(X) + 1)

    @triton.jit
    def _k3_l2_flush(X, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(X + offs, tl.load(X + offs, mask=offs < n) + 1, mask=offs < n)


def separators(device=None):
    """Two tiny Triton kernels with names nothing else has: a marker before each timed call (L2 warm) and the
    256 MB read-modify-write that flushes the L2 (cold)."""
    import torch

    device = device or DEVICE
    mark_buf = torch.zeros(1, dtype=torch.int32, device=device)
    flush_buf = torch.zeros(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    block = 4096

    def mark():
        _k3_mark[(1,)](mark_buf)

    def flush():
        _k3_l2_flush[(triton.cdiv(flush_buf.numel(), block),)](flush_buf, flush_buf.numel(), BLOCK=block)

    return mark, flush, mark_buf, flush_buf


def _device_events(prof):
    """[(name, start_us, duration_us)] of the device's kernels (and memsets / copies), in start order."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            out.append((e.name, e.time_range.start, e.time_range.elapsed_us()))
    return sorted(out, key=lambda x: x[1])


def device_time(call, iters, before):
    """Median over iters runs of the summed device time of call() (us), its kernels [(name, median us)], and the
    number of host copies seen (0 expected). before() launches the separator (marker or flush) ahead of each run;
    a run's kernels are those between two separators."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        before()
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            before()
            call()
        torch.cuda.synchronize()
    groups, copies = split_runs(_device_events(prof))
    if not groups:  # no device events in prof.events(): the per-name totals instead (a mean, not a median)
        avgs = [a for a in prof.key_averages() if getattr(a, "device_time_total", 0) > 0]
        avgs = [a for a in avgs if not a.key.startswith((MARK, FLUSH)) and "Memcpy" not in a.key]
        avgs = [a for a in avgs if not a.key.startswith("ProfilerStep")]
        if not avgs:
            raise RuntimeError("the profiler saw no device kernels")
        kernels = [(a.key, a.device_time_total / iters) for a in avgs]
        return sum(t for _, t in kernels), kernels, copies, 0
    us, kernels = summarize_runs(groups)
    return us, kernels, copies, len(groups)


def split_runs(events):
    """The runs in [(name, start, duration)]: the kernels after each separator, up to the next; host copies
    counted apart."""
    groups, cur, copies = [], None, 0
    for name, _, dur in events:
        if name.startswith(MARK) or name.startswith(FLUSH):
            cur = []
            groups.append(cur)
        elif "Memcpy" in name:
            copies += 1
        elif cur is not None:
            cur.append((name, dur))
    return [g for g in groups if g], copies


def summarize_runs(groups):
    """The median run's summed time and each kernel's median (over the runs with the usual kernel count)."""
    per_call = [sum(d for _, d in g) for g in groups]
    n = statistics.mode(len(g) for g in groups)
    same = [g for g in groups if len(g) == n]
    kernels = [(same[0][i][0], statistics.median(g[i][1] for g in same)) for i in range(n)]
    return statistics.median(per_call), kernels


# ---------------------------------------------------------------------------------------------------------------
# weights, routing, the call, the reference
# ---------------------------------------------------------------------------------------------------------------


def raw_weights(n_experts, I, seed):
    """Our random MXFP4 experts in triton_kernels' un-swizzled form (what its downcast_to_mxfp(w, uint8, axis=1)
    returns for w [E, K, N]): codes [E, K/2, N] and scales [E, K/32, N] as transposed views of contiguous
    [E, N, K/2] / [E, N, K/32] (K-major). W13: K = L, N = 2I (gate / up interleaved); W2: K = I, N = L."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    out = {}
    for name, (K, N) in dict(w13=(L, 2 * I), w2=(I, L)).items():
        codes = torch.randint(0, 256, (n_experts, N, K // 2), dtype=torch.uint8, device=DEVICE, generator=g)
        scales = 120 + torch.randint(0, 4, (n_experts, N, K // 32), dtype=torch.uint8, device=DEVICE, generator=g)
        out[name] = (codes.transpose(1, 2), scales.transpose(1, 2))
    return out


def swizzle(tk, raw, num_warps):
    """raw's codes and scales in the layouts triton_kernels picks for sm90 (make_default_matmul_mxfp4_w_layout /
    _w_scale_layout, mx_axis = 1), as vLLM's _swizzle_mxfp4 and its tests do; with their PrecisionConfigs."""
    vl, vl_opts = tk.layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
    sl, sl_opts = tk.layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=num_warps)
    out = {"layouts": f"{vl.__name__}{vl_opts}, {sl.__name__}{sl_opts}"}
    nbytes = 0
    for name, (codes, scales) in raw.items():
        w = tk.convert_layout(tk.wrap_torch_tensor(codes, dtype=tk.FP4), vl, **vl_opts)
        s = tk.convert_layout(tk.wrap_torch_tensor(scales), sl, **sl_opts)
        nbytes += w.storage.data.nbytes + s.storage.data.nbytes
        pc = tk.PrecisionConfig(flex_ctx=tk.FlexCtx(rhs_data=tk.InFlexData()), weight_scale=s)
        out[name] = (w, pc)
    out["bytes_per_expert"] = nbytes / codes.shape[0]
    return out


def routing(tk, logits):
    """Its one-GPU routing (bench/distributed.py routing(), tests/test_matmul.py init_routing_data()): the top-16
    of fp32 logits, no softmax (the selected logits are the fp32 routing weights)."""
    sparse = tk.topk(logits, K_TOP, apply_softmax=False)
    dispatch = sparse.mask_metadata.row_sorted_indx
    combine = sparse.mask_metadata.col_sorted_indx
    ragged = tk.make_ragged_tensor_metadata(sparse.mask_metadata.col_sum, dispatch.shape[0])
    gate_scal = sparse.vals.flatten()[combine]
    rdata = tk.RoutingData(gate_scal, ragged.slice_sizes, logits.shape[-1], K_TOP, ragged)
    return sparse, rdata, tk.GatherIndx(combine, dispatch), tk.ScatterIndx(dispatch, combine)


def swiglu_act(tk):
    specs = tk.FnSpecs("swiglu", tk.swiglu.swiglu_fn, ("alpha", "limit"), reduction_n=2)
    return tk.FusedActivation(specs, (SWIGLU_ALPHA, SWIGLU_LIMIT))


def experts_call(tk, sw, act, z, rdata, gather, scatter):
    """The routed experts of one call: gate/up matmul_ogs (gather, fused SwiGLU), down matmul_ogs (scatter, the
    routing weights as gammas) and its combine."""
    (w13, pc13), (w2, pc2) = sw["w13"], sw["w2"]
    h = tk.matmul_ogs(z, w13, None, rdata, gather_indx=gather, precision_config=pc13, fused_activation=act)
    return tk.matmul_ogs(h, w2, None, rdata, scatter_indx=scatter, precision_config=pc2, gammas=rdata.gate_scal)


def reference(tk, raw, z, sel, weights):
    """y [T, L] fp32 from the un-swizzled codes: each token's 16 experts dequantized by its upcast_from_mxfp_torch, h in
    fp32, its swiglu_torch, h rounded to bf16 as its kernel stores it, the down projection, the weighted sum."""
    import torch

    (c13, s13), (c2, s2) = raw["w13"], raw["w2"]
    pc = tk.swiglu.PrecisionConfig(limit=SWIGLU_LIMIT)
    T = z.shape[0]
    y = torch.zeros((T, L), dtype=torch.float32, device=z.device)
    for t in range(T):
        for j in range(K_TOP):
            e = int(sel[t, j])
            w13 = tk.upcast_from_mxfp_torch(c13[e], s13[e], torch.bfloat16, axis=0).float()  # [L, 2I]
            h = tk.swiglu.swiglu_torch(z[t].float() @ w13, SWIGLU_ALPHA, pc).to(torch.bfloat16).float()
            w2 = tk.upcast_from_mxfp_torch(c2[e], s2[e], torch.bfloat16, axis=0).float()  # [I, L]
            y[t] += float(weights[t, j]) * (h @ w2)
    return y


def rel_rms(a, b):
    a, b = a.float(), b.float()
    return float(((a - b) ** 2).mean().sqrt() / (b**2).mean().sqrt())


# ---------------------------------------------------------------------------------------------------------------
# one (TP, T) row
# ---------------------------------------------------------------------------------------------------------------


class Deadline:
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self):
        return self.end - time.monotonic()


def case_inputs(tk, T, n_experts, I):
    """z, the logits, its routing of them and the row's header (distinct experts, largest group, the floor)."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(1000 + T)
    logits = torch.randn((T, n_experts), dtype=torch.float32, device=DEVICE, generator=g)
    z = torch.randn((T, L), dtype=torch.float32, device=DEVICE, generator=g).to(torch.bfloat16)
    sparse, rdata, gather, scatter = routing(tk, logits)
    sel = sparse.indx.long()
    counts = torch.bincount(sel.reshape(-1), minlength=n_experts)
    distinct = int((counts > 0).sum())
    per_expert = our_expert_bytes(I)
    floor_us = distinct * per_expert / (HBM_TB_S * 1e6)
    head = dict(distinct=distinct, largest_group=int(counts.max()), expert_mb=per_expert / 1e6, floor_us=floor_us)
    return dict(logits=logits, z=z, sparse=sparse, sel=sel, rdata=rdata, gather=gather, scatter=scatter), head


def run_variants(tk, row, case, raw, sws, variants, iters, seps, check, deadline):
    """Measure each variant of one (TP, T) case into row; a failure is that cell's error string."""
    import torch

    mark, flush = seps[:2]
    act = swiglu_act(tk)
    z, logits, T = case["z"], case["logits"], row["T"]
    for v in variants:
        if deadline.left() < 15:
            row[f"{v}_us"] = "skipped: deadline"
            continue
        t0 = time.monotonic()
        try:
            sw = sws[4 if v == "triton_w4" else 8]
            if v == "triton_routed":

                def call(sw=sw):
                    _, rd, ga, sc = routing(tk, logits)
                    return experts_call(tk, sw, act, z, rd, ga, sc)

            else:

                def call(sw=sw):
                    return experts_call(tk, sw, act, z, case["rdata"], case["gather"], case["scatter"])

            y = call()  # compiles here
            torch.cuda.synchronize()
            row[f"{v}_compile_s"] = round(time.monotonic() - t0, 1)
            if v == "triton" and T in check:
                ref = reference(tk, raw, z, case["sel"], case["sparse"].vals)
                row["triton_rel_rms_vs_ref"] = rel_rms(y, ref)
                row["triton_out_shape"] = list(y.shape)
            us, kernels, copies, runs = device_time(call, iters, flush if v == "triton_cold" else mark)
            row[f"{v}_us"] = us
            row[f"{v}_kernels"] = len(kernels)
            row[f"{v}_per_kernel_us"] = [(n, round(t, 2)) for n, t in kernels]
            row[f"{v}_of_floor"] = row["floor_us"] / us
            row[f"{v}_runs"] = runs
            if copies:
                row[f"{v}_host_copies"] = copies
        except Exception as e:  # noqa: BLE001  (a failure is a row entry, not the end of the run)
            row[f"{v}_us"] = f"failed: {type(e).__name__}: {e}"[:400]
            traceback.print_exc()
        torch.cuda.empty_cache()


def _short(row):
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if not k.endswith("per_kernel_us")}


def main(out_dir, tps, tokens, variants, iters, name, smoke, deadline_s, check):
    import torch

    torch.set_grad_enabled(False)  # its topk is an autograd Function: no graphs kept
    deadline = Deadline(deadline_s)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = dict(
        device=f"{torch.cuda.get_device_name()} (cc {'.'.join(map(str, torch.cuda.get_device_capability()))})",
        torch=torch.__version__,
        triton=triton.__version__,
        triton_kernels=f"triton-lang/triton v3.6.0 {TK_COMMIT} python/triton_kernels",
        what="triton_kernels matmul_ogs MoE (vLLM's Hopper MXFP4 path): z [T, 3584] -> y [T, 3584], fused SwiGLU",
        measure=f"CUPTI device time per call (its kernels summed, torch.profiler), median of {iters} runs",
        routing="uniform",
        split_groups=False,
        floor=f"distinct experts x bytes per expert (ours) / {HBM_TB_S} TB/s",
        variants=list(variants),
        rows=[],
    )
    try:
        tk, results["triton_kernels_source"] = load_triton_kernels()
        # vLLM's and SGLang's Hopper setting for these kernels (harmless: MXFP4 weights already rule split-k out)
        tk.opt_flags.update_opt_flags_constraints({"split_k": 1})
        seps = separators()
    except Exception as e:  # noqa: BLE001
        results["error"] = f"{type(e).__name__}: {e}"[:600]
        traceback.print_exc()
        write(results, out_dir, name)
        return
    print("triton_kernels:", results["triton_kernels_source"], flush=True)

    if smoke:  # one tiny case first: 64 experts at TP16's widths, T = 2 (the same kernels as the real TP16 rows)
        t0 = time.monotonic()
        smoke_row = dict(tp=16, I=I_TP1 // 16, T=2, experts=SMOKE_E)
        try:
            raw = raw_weights(SMOKE_E, smoke_row["I"], seed=7)
            sws = {8: swizzle(tk, raw, 8)}
            results["layouts"] = sws[8]["layouts"]
            case, head = case_inputs(tk, 2, SMOKE_E, smoke_row["I"])
            smoke_row.update(head)
            run_variants(tk, smoke_row, case, raw, sws, ("triton",), 5, seps, (2,), deadline)
            del raw, sws, case
        except Exception as e:  # noqa: BLE001
            smoke_row["error"] = f"{type(e).__name__}: {e}"[:600]
            traceback.print_exc()
        smoke_row["wall_s"] = round(time.monotonic() - t0, 1)
        results["smoke"] = smoke_row
        print("smoke:", _short(smoke_row), flush=True)
        write(results, out_dir, name)
        torch.cuda.empty_cache()

    # every row with the 8-warp variants first, then the 4-warp one (new compiles) where time is left
    passes = [tuple(v for v in variants if v != "triton_w4"), tuple(v for v in variants if v == "triton_w4")]
    rows = {}
    for pass_variants in (p for p in passes if p):
        for tp in tps:
            I = I_TP1 // tp
            if deadline.left() < 30:
                for T in tokens:
                    row = rows.setdefault((tp, T), dict(tp=tp, I=I, T=T))
                    row.update({f"{v}_us": "skipped: deadline" for v in pass_variants})
                continue
            t0 = time.monotonic()
            try:
                raw = raw_weights(E, I, seed=tp)
                sws = {nw: swizzle(tk, raw, nw) for nw in sorted({4 if v == "triton_w4" else 8 for v in pass_variants})}
                results.setdefault("layouts_by_tp", {}).setdefault(tp, {}).update(
                    {nw: sw["layouts"] for nw, sw in sws.items()}
                )
                torch.cuda.synchronize()
                print(f"TP{tp}: weights made and swizzled in {time.monotonic() - t0:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001
                err = f"weights failed: {type(e).__name__}: {e}"[:400]
                traceback.print_exc()
                for T in tokens:
                    rows.setdefault((tp, T), dict(tp=tp, I=I, T=T)).update({f"{v}_us": err for v in pass_variants})
                results["rows"] = list(rows.values())
                write(results, out_dir, name)
                continue
            for T in tokens:
                row = rows.setdefault((tp, T), dict(tp=tp, I=I, T=T, experts=E))
                try:
                    case, head = case_inputs(tk, T, E, I)
                    row.update(head)
                    row.setdefault("tk_expert_mb", {}).update(
                        {nw: round(sw["bytes_per_expert"] / 1e6, 4) for nw, sw in sws.items()}
                    )
                    run_variants(tk, row, case, raw, sws, pass_variants, iters, seps, check, deadline)
                    del case
                except Exception as e:  # noqa: BLE001
                    row.update({f"{v}_us": f"failed: {type(e).__name__}: {e}"[:400] for v in pass_variants})
                    traceback.print_exc()
                results["rows"] = list(rows.values())
                print(_short(row), flush=True)
                write(results, out_dir, name)
            del raw, sws
            torch.cuda.empty_cache()
    results["deadline_left_s"] = round(deadline.left(), 1)
    write(results, out_dir, name)


# ---------------------------------------------------------------------------------------------------------------
# the table: bench/moe_layer.py's columns
# ---------------------------------------------------------------------------------------------------------------


def _cell(row, v):
    t = row.get(f"{v}_us")
    if not isinstance(t, float):
        return str(t or "-")[:60].replace("|", "/")
    return f"{t:.1f} ({row[f'{v}_kernels']}, {100 * row[f'{v}_of_floor']:.0f}%)"


def write_table(results, path):
    names = results["variants"]
    lines = [
        f"# Routed experts by triton_kernels, at our MoE shapes ({results.get('device')}, torch {results.get('torch')},"
        f" triton {results.get('triton')})",
        "",
        f"{results['what']}; {results['measure']}; routing {results['routing']}; floor = {results['floor']}."
        " Cells: us (kernels, floor / time). triton: routing data made outside the call, L2 warm (as moe_layer.md);"
        " triton_cold: 256 MB L2 flush before each call; triton_routed: + its topk and routing metadata from logits;"
        " triton_w4: scales swizzled for 4 warps (block_n 128) instead of 8 (256).",
        "",
        f"Source: {results['triton_kernels']}. Layouts: {results.get('layouts', results.get('layouts_by_tp', '-'))}.",
        "",
        "| TP | T | distinct experts | largest group | floor us | " + " | ".join(f"{n} us" for n in names) + " |",
        "|---|---|---|---|---|" + "---|" * len(names),
    ]
    for r in results["rows"]:
        cells = " | ".join(_cell(r, n) for n in names)
        floor = f"{r['floor_us']:.1f}" if "floor_us" in r else "-"
        lines.append(
            f"| {r['tp']} | {r['T']} | {r.get('distinct', '-')} | {r.get('largest_group', '-')} | {floor} | {cells} |"
        )
    sizes = {r["tp"]: (r["expert_mb"], r["tk_expert_mb"]) for r in results["rows"] if "tk_expert_mb" in r}
    if sizes:
        lines += [
            "",
            "MB per expert, ours (the floor's) vs in its layouts by num_warps: "
            + "; ".join(f"TP{tp}: {ours:.3f} vs {tk}" for tp, (ours, tk) in sizes.items()),
        ]
    checks = [(r["tp"], r["T"], r["triton_rel_rms_vs_ref"]) for r in results["rows"] if "triton_rel_rms_vs_ref" in r]
    if checks:
        lines += [
            "",
            "Output vs the torch reference (rel. RMS): " + ", ".join(f"TP{a} T={b}: {c:.2e}" for a, b, c in checks),
        ]
    if "error" in results:
        lines += ["", f"Error: {results['error']}"]
    pathlib.Path(path).write_text("\n".join(lines) + "\n")


def write(results, out_dir, name):
    pathlib.Path(out_dir, f"{name}.json").write_text(json.dumps(results, indent=1, default=str))
    write_table(results, pathlib.Path(out_dir, f"{name}.md"))


if __name__ == "__main__":
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", nargs="?", default=str(pathlib.Path(__file__).parent / "results"))
    ap.add_argument("--tps", type=ints, default=(16, 8))
    ap.add_argument("--tokens", type=ints, default=TOKENS)
    ap.add_argument("--variants", type=lambda s: tuple(v for v in s.split(",") if v), default=VARIANTS)
    ap.add_argument("--iters", type=int, default=ITERS)
    ap.add_argument("--name", default="moe_triton")
    ap.add_argument("--smoke", action="store_true", help="run one tiny case (64 experts, T = 2) first")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="stop starting new measurements after this")
    ap.add_argument("--check-tokens", type=ints, default=(1, 8), help="T at which the output is checked")
    a = ap.parse_args()
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; known: {VARIANTS}")
    main(a.out_dir, a.tps, a.tokens, a.variants, a.iters, a.name, a.smoke, a.deadline_s, a.check_tokens)
