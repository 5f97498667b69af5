#!/usr/bin/env bash
# The maintained GPU runs, in groups of under 10 minutes (one device call), each step under its own time
# limit so a hang cannot eat the call. On the device machine, from the repo root: bash bench/gpu_runs.sh GROUP...
# Each group lands in $OUT/GROUP.tar.gz (one file: the device tool returns few files); unpack it and copy the
# result files into bench/results (bench/results/README.md says what each one is).
#
#   group        machine          what it runs -> result files
#   gpu_tests    nvidia-h200      every one-GPU test (pytest -m "gpu and not gpu2", 8 xdist workers, ~4.5-9 min), or
#                                 those of the files in TESTS (space-separated), or of PART 1 (the MoE and MLA files)
#                                 or PART 2 (the others): on an H100 the whole suite ran 96% in 560 s (two calls)
#   gpu2_tests   nvidia-h200-x2   every 2-GPU test: collectives, fused projection, the TP2 model vs XLA (~4 min)
#   collectives  nvidia-h200-x2   bench/collectives.py + bench/fused_projection.py -> collectives.*, fused_projection.*
#   rank_slice   nvidia-h200      the TP16 rank slice, 12 layers, B 1 and 64, both backends (~4 min), and its decode
#                                 report -> rank_slice_kernels.*, decode_rank_slice_kernels.*
#   rank_slice_boundary nvidia-h200  the rank slice, 12 layers, B 1 and 64, latency_specialized: the layer boundaries
#                                 as the boundary kernel without its exchange (--mix-norm-single-device: the run's
#                                 policy, tuning.json untouched), then as XLA's kernels (~3 min)
#                                 -> rank_slice_boundary.*, rank_slice_boundary_off.*
#   step_trace   nvidia-h200      the rank slice, 12 layers, B 1 and 64, latency_specialized, with --trace (the device
#                                 timeline between kernels, bench/step_trace.py) under XLA's default flags, then
#                                 without command buffers, then with every custom call in them from graphs of 1 (~6 min;
#                                 VARIANTS: some of them, e.g. "_trace:")
#                                 -> rank_slice_trace.*, rank_slice_trace_nocb.*, rank_slice_trace_cb1.*
#   rank_slice_93 nvidia-h200     the whole 93-layer TP16 rank slice (issue 28 item 1), BACKENDS (default
#                                 latency_specialized,xla) x BATCHES (default 1,64) as far as ~9 minutes go, with --trace
#                                 (RS_FLAGS: more rank_slice flags, e.g. --tuning ...)
#                                 (~97 GB of weights: an H200 only) -> rank_slice_93L.*
#   switches     nvidia-h200      the GPU tests of the two in-place writes (kda_decode state_in_place, mla_decode
#                                 write_rows: both off in tuning.json until these pass), then the 12-layer slice at
#                                 b1 / b64 with --trace, both off and both on (--tuning) -> rank_slice_switches_{off,on}.*
#   switch_tests nvidia-h200      only those GPU tests (~1-2 min)
#   rank_slice_spec nvidia-h200   the rank slice with --speculative 7, 12 layers, B 1 and 8, both backends: the decode
#                                 step and the DSpark round (verify, commit, drafter; tok/s at acceptance length 6)
#                                 -> rank_slice_spec.*
#   decode       nvidia-h200      the engine on 4 real-width layers, B 1 and 8 -> decode_k3_4layers_auto_tp1.*
#   kda_decode   nvidia-h200      the KDA decode table, fla's numbers reused from results -> kda_decode.*
#   kda_cold     nvidia-h200      the KDA decode with a cold L2 -> kda_decode_cold.json
#   kda_verify   nvidia-h200      KDA verify + commit, B 1 and 8 (+ the kernels' staging variants) -> kda_verify.*,
#                                 and B 64 through the api -> kda_verify_b64.*
#   kda_layer    nvidia-h200      the whole KDA sublayer, TP16 / TP8, B 1-64 -> kda_layer.*
#   gemv         nvidia-h200      the decode GEMV's tuned launches vs XLA, B 1-64 -> gemv.json
#   gemv_moe     nvidia-h200      the MoE in-projections (router fp32 + latent_down + shared gate/up, one launch)
#                                 at TP16 / TP8: XLA vs every candidate launch (--sweep), B 1-64 (~5 min)
#                                 -> gemv_moe.json
#   moe_out_tests nvidia-h200     the MoE finish's pairs GEMV (latent_up + shared_down, one launch) GPU tests at TP16 /
#                                 TP8 real shapes, B 1-64, the table's launch and others (~2 min)
#   gemv_moe_out nvidia-h200      the MoE finish at TP16 / TP8: XLA vs the moe_out_launch table and every candidate
#                                 kernel (--sweep), B 1, 64, 8, 32 (~3 min) -> gemv_moe_out.json
#   mla          nvidia-h200      the MLA decode attention kernel: its GPU tests, then vs XLA (bench/mla_layer.py) -> mla_layer.*
#   mla_variants nvidia-h200      the MLA GPU tests of the batch-1 launch, then the kernel's launch
#                                 variants at 8K (~4 min) -> mla_variants.json
#   mla_ncu      nvidia-h200      ncu's SMEM counters (bank conflicts of the loads and stores, wavefronts, shared
#                                 instructions) and warp states of one MLA kernel call, TP16, B 64, 8K: is the
#                                 fp8 -> f16 conversion (mla_profile's ~45% of a block) bank-conflicted (~2 min; the log)
#   mla_profile  nvidia-h200      where a 64-position block's time goes in the MLA kernel (in-kernel trace of its
#                                 phases), TP16, B 1 and 64, 8K (~1 min) -> mla_profile.json
#   mix_norm     nvidia-h200      the layer-boundary kernel alone, one GPU: its GPU test, then each AttnRes form
#                                 (two_pass, online, batched) vs XLA, B 1 / 8 / 64, 1 / 4 / 8 blocks (~3 min) -> mix_norm.*
#   moe_layer    nvidia-h200      the routed experts alone: kernel vs XLA packed, TP16 / TP8, T 1-512 -> moe_layer.*
#   moe_next     nvidia-h200      the routed experts L2-cold, under skewed routing, and with split_groups (~7 min)
#                                 -> moe_layer_cold.*, moe_layer_skewed.*, moe_layer_skewed_split.*
#   moe_variants nvidia-h200      the routed experts' GPU tests, then the kernel as tuned beside its launch variants
#                                 (mma_overlap, direct, both) and XLA packed, TP16, T 1-512 (~4 min)
#                                 -> moe_launch_variants.*
#   moe_fused_glu nvidia-h200     the routed experts' GPU tests, then the kernel as tuned (fused_glu: SiTU-GLU
#                                 in the gate/up kernel) beside it off, TP16 / TP8, T 16-512 (~6 min)
#                                 -> moe_fused_glu.*
#   moe_small    nvidia-h200      the decode's GPU tests (scale_fold's among them), then the routed experts at T = 1,
#                                 2, 8 (TP16, L2-cold) as tuned beside scale_fold off; then the same at T = 64, 512,
#                                 TP16 / TP8 (~4 min) -> moe_small.*, moe_fold.*
#   moe_profile  nvidia-h200      the routed-experts kernels' in-kernel traces (each CTA's mma / store spans and when
#                                 they run), TP16, T = 1 and 64, as tuned (~2 min)
#                                 -> moe_profile_tp16_t{1,64}.json
#   moe_ncu      nvidia-h200      ncu's launch, occupancy, scheduler and warp-state sections of the Mosaic kernels
#                                 of one routed-experts call, TP16, T = 1 (up to ~8 min; the log only)
#   moe_route    nvidia-h200      the router top-k kernel vs lax.top_k, T 1-512 -> moe_route.*
#   grid_barrier nvidia-h200      the grid-wide barrier's GPU test, then what a barrier costs in one launch (132 / 264
#                                 CTAs, 0-16 rounds; the persistent levers' premise, ~1 min) -> grid_barrier.*
#   moe_triton   nvidia-h200      the public MXFP4 MoE at our shapes: triton_kernels v3.6.0's matmul_ogs (vLLM's Hopper
#                                 path), TP16 / TP8, T 1-512, warm / cold / with its routing / 4 warps -> moe_triton.*;
#                                 torch + triton from the machine, the device tool's carry ["bench/build/triton_kernels_src"]
# One machine kind at a time: a switch restarts the machine. Several groups run in one call, in order (bash
# bench/gpu_runs.sh moe_small mla_variants rank_slice), each written to its tar as it ends: a machine idles out ~30 s
# after a call, so a second call usually pays a new start. Every step is cut to end CALL_S (default 585) seconds
# after the script starts, which is the device call's limit: what finished comes back, the rest is skipped.
set -u
export PYTHONPATH=. JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/device_out}
ends_at=$(($(date +%s) + ${CALL_S:-585}))

step() {  # step NAME SECONDS CMD...: run with a limit (cut to the call's end), keep its log, never stop the group
  local name=$1 limit=$2 left=$((ends_at - $(date +%s) - 10))
  shift 2
  if ((left < 20)); then
    echo "=== $name skipped: the call's time is spent" | tee "$work/$name.log"
    return
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$work/$name.log" 2>&1
  echo "rc=$?" >> "$work/$name.log"
  tail -15 "$work/$name.log"
}

run_group() {  # run_group GROUP: its steps, logs and result files into $work
case "$1" in
  gpu_tests)
    case "${PART:-}" in
      1) part="tests/test_moe_kernel.py tests/test_mla_decode.py tests/test_mla_write_rows.py" ;;
      2) part="tests/test_backends_gpu.py tests/test_collectives.py tests/test_fused_projection.py tests/test_gemv.py
         tests/test_kda_decode.py tests/test_kda_verify_kernel.py tests/test_moe_route.py" ;;
      *) part="" ;;
    esac
    step pytest_gpu 560 env XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
      python3 -m pytest -p no:cacheprovider \
      -m "gpu and not gpu2" -n 8 --durations=30 -rf ${TESTS:-$part}
    ;;
  gpu2_tests)
    step pytest_gpu2 350 python3 -m pytest -q -p no:cacheprovider -m gpu2 -rf
    ;;
  collectives)
    step bench 330 python3 bench/collectives.py --bench --out "$work" --deadline-s 320
    step bench_fused_projection 240 python3 bench/fused_projection.py --bench --out "$work" --deadline-s 230
    ;;
  rank_slice)
    export XLA_PYTHON_CLIENT_MEM_FRACTION=.95  # the rank slice's weights fill most of the H200
    step rank_slice 400 python3 bench/rank_slice.py --layers 12 --batches 1,64 \
      --backends xla,latency_specialized --out "$work" --tag _kernels
    step decode_report 60 env JAX_PLATFORMS=cpu python3 bench/decode.py --rank-slice "$work/rank_slice_kernels.json" --tag rank_slice_kernels \
      --out "$work"
    ;;
  rank_slice_boundary)  # the kernel first; the same run with XLA's boundaries in the same call, to compare
    export XLA_PYTHON_CLIENT_MEM_FRACTION=.95
    step rank_slice_boundary 240 python3 bench/rank_slice.py --layers 12 --batches 1,64 \
      --backends latency_specialized --mix-norm-single-device on --budget-s 180 --out "$work" --tag _boundary
    step rank_slice_boundary_off 200 python3 bench/rank_slice.py --layers 12 --batches 1,64 \
      --backends latency_specialized --mix-norm-single-device off --budget-s 150 --out "$work" --tag _boundary_off
    ;;
  step_trace)  # why the wall per step is ~40% above the kernel sum: idle time by kind, and command buffers' part
    export XLA_PYTHON_CLIENT_MEM_FRACTION=.95
    all="_trace: _trace_nocb:--xla_gpu_enable_command_buffer=
      _trace_cb1:--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN|--xla_gpu_graph_min_graph_size=1"
    for v in ${VARIANTS:-$all}; do  # a variant is tag:flags, the flags joined by |
      v=${v//|/ }
      step "rank_slice${v%%:*}" 190 env XLA_FLAGS="${v#*:}" python3 bench/rank_slice.py --layers 12 --batches 1,64 \
        --backends latency_specialized --trace --budget-s 160 --out "$work" --tag "${v%%:*}"
    done
    ;;
  rank_slice_93)  # 97 GB of weights to generate, 93 layers to compile; results written after each run
    export XLA_PYTHON_CLIENT_MEM_FRACTION=.97
    budget=${BUDGET:-530}  # seconds for measurements to start; the step gets 40 more to finish one and exit
    step rank_slice_93L $((budget + 40)) python3 bench/rank_slice.py --batches "${BATCHES:-1,64}" \
      --backends "${BACKENDS:-latency_specialized,xla}" --trace --budget-s "$budget" --out "$work" --tag _93L \
      ${RS_FLAGS:-}  # e.g. RS_FLAGS="--tuning kda_decode.sm90.state_in_place=true"
    ;;
  switches|switch_tests)  # one checkout, both sides of each switch; the kernels' own GPU tests first
    step pytest_switches 200 env XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
      python3 -m pytest -p no:cacheprovider -m "gpu and not gpu2" -n 8 -q -rf tests/test_kda_decode.py \
      tests/test_mla_write_rows.py
    [ "$1" = switch_tests ] && return
    export XLA_PYTHON_CLIENT_MEM_FRACTION=.95
    for side in off on; do
      flags=()
      [ "$side" = on ] && flags=(--tuning kda_decode.sm90.state_in_place=true --tuning mla_decode.sm90.write_rows=true)
      step "rank_slice_switches_$side" 180 python3 bench/rank_slice.py --layers 12 --batches 1,64 \
        --backends latency_specialized --trace --budget-s 150 --out "$work" --tag "_switches_$side" ${flags[@]+"${flags[@]}"}
    done
    ;;
  rank_slice_spec)  # the budget leaves the step's limit room for the last measurement and the exit
    export XLA_PYTHON_CLIENT_MEM_FRACTION=.95
    step rank_slice_spec 560 python3 bench/rank_slice.py --layers 12 --batches 1,8 --speculative 7 \
      --backends xla,latency_specialized --budget-s 420 --out "$work" --tag _spec
    ;;
  decode)
    step decode 560 python3 bench/decode.py --preset k3 --layers 4 --batches 1,8 --input-len 64 --output-len 33 \
      --tag k3_4layers_auto_tp1 --out "$work"
    ;;
  kda_decode)
    step kda_decode 450 python3 bench/kda_decode.py "$work" bench/results/kda_decode.json
    ;;
  kda_cold)
    step kda_cold 240 python3 bench/kda_decode.py --cold "$work"
    ;;
  kda_verify)  # XLA's verify at 64 x 12 x 8 takes minutes to compile: few cases, no variants at B = 64
    step kda_verify 300 python3 bench/kda_verify.py --no-check --iters 10 --cases 1:6:4,1:6:8,8:12:4 --out "$work"
    step kda_verify_b64 250 python3 bench/kda_verify.py --no-check --no-variants --iters 10 --cases 64:12:8 \
      --name kda_verify_b64 --out "$work"
    ;;
  kda_layer)
    step kda_layer 400 python3 bench/kda_layer.py "$work"
    ;;
  gemv)
    step gemv 400 python3 bench/gemv.py "$work"
    ;;
  gemv_moe)  # moe_in_launch is empty: the sweep's rows are its candidates; rows past the deadline are skipped
    step gemv_moe 330 python3 bench/gemv.py "$work" --cases moe_in --sweep --name gemv_moe --deadline-s 270
    ;;
  moe_out_tests)
    step pytest_moe_out 170 env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -p no:cacheprovider \
      tests/test_gemv.py -m gpu -k moe_out -n 4 -rf
    ;;
  gemv_moe_out)  # moe_out_launch is a prediction (o_proj's analogue): the sweep's rows measure it
    step gemv_moe_out 200 python3 bench/gemv.py "$work" --cases moe_out --sweep --batches 1,64,8,32 \
      --name gemv_moe_out --deadline-s 150
    ;;
  mla)
    step pytest_mla 250 python3 -m pytest -q -p no:cacheprovider tests/test_mla_decode.py -m gpu -rf
    step bench_mla 290 python3 bench/mla_layer.py "$work" --deadline-s 260
    ;;
  mix_norm)  # its GPU test first: a form that fails it is still timed, but its row means nothing
    step tests 120 python3 -m pytest -p no:cacheprovider -q -rf "tests/test_collectives.py::test_mix_norm_one_device_on_gpu"
    step bench_mix_norm 200 python3 bench/mix_norm.py --out "$work"
    ;;
  mla_profile)  # the in-kernel trace comes back through a host callback: a CPU device beside the GPU
    step mla_profile 150 env JAX_PLATFORMS=cuda,cpu python3 bench/mla_layer.py "$work" --profile
    ;;
  mla_ncu)  # the Mosaic kernel only (the cache's generation and the compile run unprofiled), no autotuning
    shared=l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
    shared=$shared,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum
    shared=$shared,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed.sum
    step ncu_mla 300 env XLA_FLAGS=--xla_gpu_autotune_level=0 ncu --clock-control none --target-processes all \
      --kernel-name regex:mosaic --launch-count 1 --csv --page details --metrics "$shared" \
      --section WarpStateStats python3 bench/mla_layer.py "$work" --once 64
    ;;
  mla_variants)  # the GPU tests of the batch-1 launch (a split a block) first
    step pytest_mla 150 env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -p no:cacheprovider \
      tests/test_mla_decode.py -m gpu -n 4 -k "1-1-6-8192" -rf
    step bench_mla_variants 240 python3 bench/mla_layer.py "$work" --variants --deadline-s 200
    ;;
  moe_layer)
    step moe_layer 300 python3 bench/moe_layer.py "$work" --impls packed
    ;;
  moe_next)  # a popular expert's group in several tiles: serial in one CTA, or split_groups' CTAs side by side
    step moe_cold 200 python3 bench/moe_layer.py "$work" --tps 16 --impls packed --cold --tokens 1,2,4,8,64 \
      --name moe_layer_cold
    step moe_skewed 200 python3 bench/moe_layer.py "$work" --tps 16 --impls packed --routing skewed \
      --tokens 8,16,32,64,128,512 --name moe_layer_skewed
    step moe_skewed_split 120 python3 bench/moe_layer.py "$work" --tps 16 --impls "" --routing skewed \
      --split-groups --tokens 16,32,64,128,512 --name moe_layer_skewed_split
    ;;
  moe_variants)
    step pytest_moe 200 python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernel.py -m gpu -rf
    step moe_launch_variants 330 python3 bench/moe_layer.py "$work" --tps 16 --impls packed --tokens 1,2,8,64,512 \
      --kernel-variant overlap:mma_overlap=1 --kernel-variant direct:direct=1 \
      --kernel-variant both:mma_overlap=1,direct=1 --name moe_launch_variants
    ;;
  moe_fused_glu)  # fused_glu needs up_splits 1: T >= 9 (the T <= 8 launch splits K over 7 CTAs)
    step pytest_moe 240 env XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
      python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_moe_kernel.py -m gpu -rf
    step moe_fused_glu 300 python3 bench/moe_layer.py "$work" --tps 16,8 --impls "" --tokens 16,32,64,128,512 \
      --kernel-variant noglu:fused_glu=0 --name moe_fused_glu
    ;;
  moe_small)  # scale_fold on (the W2 row blocks and stages alone: moe_wg2_h100.md; the gate/up K unsplit with the
    # GLU fused lost: moe_small_h100.md; the GLU in the down kernel lost: moe_small_fold_h100.md)
    step pytest_decode 150 python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernel.py -m gpu \
      -k "decode_on_gpu or scale_fold" -rf
    step moe_small 170 python3 bench/moe_layer.py "$work" --tps 16 --impls "" --cold --tokens 1,2,8 \
      --kernel-variant nofold:scale_fold=0 --name moe_small
    step moe_fold 120 python3 bench/moe_layer.py "$work" --tps 16,8 --impls "" --tokens 64,512 \
      --kernel-variant nofold:scale_fold=0 --name moe_fold
    ;;
  moe_profile)  # the trace comes back through a host callback: a CPU device beside the GPU
    step moe_profile_t1 100 env JAX_PLATFORMS=cuda,cpu python3 bench/moe_layer.py "$work" --profile 16,1
    step moe_profile_t64 100 env JAX_PLATFORMS=cuda,cpu python3 bench/moe_layer.py "$work" --profile 16,64
    ;;
  moe_ncu)  # what bounds the routed-experts kernels per SM (lever 1c): registers, SMEM, CTAs and warps resident,
    # issue-slot use and stall reasons, T = 1 (the direct form), TP16: the Mosaic kernels of one call only, no
    # autotuning (under ncu every XLA autotuning launch is profiled too: 230 s were not enough with it)
    step ncu_T1 500 env XLA_FLAGS=--xla_gpu_autotune_level=0 ncu --clock-control none --target-processes all \
      --kernel-name regex:mosaic --csv --page details --section LaunchStats --section Occupancy \
      --section SchedulerStats --section WarpStateStats python3 bench/moe_layer.py --once 16,1
    ;;
  moe_route)
    step moe_route 240 python3 bench/moe_route.py "$work"
    ;;
  grid_barrier)
    step pytest_grid_barrier 120 python3 -m pytest -q -p no:cacheprovider tests/test_grid_barrier.py -m gpu -rf
    step grid_barrier 150 python3 bench/grid_barrier.py "$work"
    ;;
  moe_triton)  # the carried source (bench/moe_triton.py's docstring says where it is from); --smoke: one tiny case first
    step moe_triton 300 env PYTHONPATH=.:bench/build/triton_kernels_src python3 bench/moe_triton.py "$work" --smoke \
      --deadline-s 270
    ;;
esac
}

groups=$(sed -n 's/^#   \([a-z0-9_][a-z0-9_]*\) .*/\1/p' "$0" | grep -v '^group$')
for group in "$@" ""; do  # every name checked before anything runs
  if [ -z "$group" ]; then
    [ $# -gt 0 ] && break
  elif grep -qx "$group" <<< "$groups"; then
    continue
  fi
  echo "usage: bash bench/gpu_runs.sh GROUP [GROUP ...], each one of:" $groups >&2
  exit 2
done
mkdir -p "$OUT"
for group in "$@"; do
  work=$(mktemp -d)
  (run_group "$group")  # a subshell: a group's exports stay its own
  tar -czf "$OUT/$group.tar.gz" -C "$work" .
  echo "wrote $OUT/$group.tar.gz"
done
