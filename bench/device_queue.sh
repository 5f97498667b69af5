#!/usr/bin/env bash
# Device runs, one group per device call (bench/NOTES.md says which are queued), each step under its own time
# limit so a hang cannot eat the call. On the device machine, from the repo root:
#   bash bench/device_queue.sh gpu2_tests    # nvidia-h200-x2: every 2-GPU test (collectives, fused projection,
#                                            #   TP2 model vs XLA), ~4 min
#   bash bench/device_queue.sh collectives   # nvidia-h200-x2: collectives bench (all rows), fused projection bench
#   bash bench/device_queue.sh kda_split     # nvidia-h200: the cluster split of V: GPU tests + short bench
#   bash bench/device_queue.sh kda           # nvidia-h200: KDA decode GPU tests + bench (all launch variants),
#                                            #   and the whole KDA sublayer xla vs latency_specialized
#   bash bench/device_queue.sh kda_wg        # nvidia-h200: the split over warpgroups: canary, GPU tests, bench
#   bash bench/device_queue.sh kda_gemv      # nvidia-h200: GEMV partials -> decode kernel: GPU tests + layer, ~4 min
#   bash bench/device_queue.sh kda_idle      # nvidia-h200: idle slots kept by the decode kernel (active_B): GPU
#                                            #   tests, the model on the kernel, the sublayer vs a select after it
#   bash bench/device_queue.sh kda_rows      # nvidia-h200: the row-slice staging (a thread per state column)
#   bash bench/device_queue.sh kda_keep      # nvidia-h200: rows path, slices kept in registers between passes
#   bash bench/device_queue.sh session11a    # nvidia-h200: tile copies read-all-then-write, keep 3, the sublayer
#   bash bench/device_queue.sh session11b    # nvidia-h200: rows pass 2 by st.global, the api's keep 2 tests
#   bash bench/device_queue.sh session11c    # nvidia-h200: GPU tests through the api's final tuning, the table
#   bash bench/device_queue.sh session11d    # nvidia-h200: the decode GEMV at batch 64, the B = 64 sublayer
#   bash bench/device_queue.sh session11e    # nvidia-h200: the decode GEMV waiting per x slab, B = 1 and 64
#   bash bench/device_queue.sh session14a    # nvidia-h200: the streamed GEMV with tokens on N (tests, alone at
#                                            #   12-48)
#   bash bench/device_queue.sh session14b    # nvidia-h200: the sublayer at 16-48 with the tokens-on-N GEMV
#   bash bench/device_queue.sh session14c    # nvidia-h200: kda_decode_x tests and the sublayer, tuned on N to 32
#   bash bench/device_queue.sh session14d    # nvidia-h200: batch <= 8 on N: the GEMV alone, the sublayer
#   bash bench/device_queue.sh session14e    # nvidia-h200: the final tuning: GPU tests, the sublayer table
#   bash bench/device_queue.sh session14g    # nvidia-h200: o_proj on N writing its output itself, to batch 32
#   bash bench/device_queue.sh session14h    # nvidia-h200: the final tuning's sublayer table (kda_layer.json)
#   bash bench/device_queue.sh mla           # nvidia-h200: MLA decode attention GPU tests, then the kernel against
#                                            #   XLA at TP16 / TP8, B = 1 / 8 / 64, 1K-32K (mla_layer.{json,md}), ~8 min
#   bash bench/device_queue.sh mla_variants  # nvidia-h200: the MLA kernel's launch variants at 8K, ~3 min
#   bash bench/device_queue.sh gemv_mid      # nvidia-h200: the streamed GEMV alone at batch 16, 32, 64 (x unpadded)
#   bash bench/device_queue.sh mid_batch     # nvidia-h200: the sublayer at batch 16 and 32 (the streamed GEMV, o_proj)
#   bash bench/device_queue.sh x_slabs       # nvidia-h200: the GEMV's x slabs by TMA from x itself: tests, B <= 8 layer
#   bash bench/device_queue.sh o_proj        # nvidia-h200: o_proj through the decode GEMV from batch 9: tests, sublayer
#   bash bench/device_queue.sh partials      # nvidia-h200: the decode kernel fed by GEMV partials (sums after the
#                                            #   state's TMA, fa through SMEM): GPU tests, the sublayer at B = 1-64
#   bash bench/device_queue.sh b64_stream    # nvidia-h200: the decode GEMV at batch 64 with x streamed, the sublayer
#   bash bench/device_queue.sh verify_api    # nvidia-h200: the api's verify (rows from 13 tiles): tests, pair table
#   bash bench/device_queue.sh verify_rows   # nvidia-h200: verify with the tile in registers a column per thread
#   bash bench/device_queue.sh next12b       # nvidia-h200: fused gates at B = 64 and 96 heads, the sublayer
#   bash bench/device_queue.sh next12        # nvidia-h200: 128-row GEMV blocks at B = 64; fused gates, b out-major
#   bash bench/device_queue.sh session11f    # nvidia-h200: the kernel fed the whole qkvg, TP16 B = 64 sublayer
#   bash bench/device_queue.sh next11        # nvidia-h200: kda_reference + kda_keep + sublayer_profile, ~10 min
#   bash bench/device_queue.sh kda_reference # nvidia-h200: the XLA decode's idle-mask forms alone, ~1 min
#   bash bench/device_queue.sh kda_patterns  # nvidia-h200: state copies in decode-kernel patterns, XLA idle mask
#   bash bench/device_queue.sh kda_final     # nvidia-h200: GPU tests through the api's tuning, then the table
#   bash bench/device_queue.sh kda_table     # nvidia-h200: the KDA decode table alone (fla's numbers reused), ~4 min
#   bash bench/device_queue.sh kda_verify    # nvidia-h200: KDA verify + commit at B = 64
#   bash bench/device_queue.sh profile       # nvidia-h200: in-kernel phase traces of the boundary and KDA kernels
#   bash bench/device_queue.sh sublayer_profile  # nvidia-h200: decode kernel phases fed by GEMV partials (~2 min)
#   bash bench/device_queue.sh moe           # nvidia-h200: rank slice with the packed MXFP4 experts
#   bash bench/device_queue.sh kda_cold      # nvidia-h200: KDA decode (api, XLA) with a cold L2, ~3 min
#   bash bench/device_queue.sh gemv          # nvidia-h200: decode GEMV kernel tests + bench vs XLA, ~4 min
#   bash bench/device_queue.sh layer         # nvidia-h200: the KDA sublayer's projections computed other ways
#                                            #   (bf16 result, out-major weights), ~2 min
# Everything lands in $OUT/<group>.tar.gz (one file: the device tool returns few files).
# Nothing is queued: every group has run (bench/NOTES.md has each one's prediction and result). One machine kind
# at a time: a switch restarts the machine.
set -u
export PYTHONPATH=. JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/device_out}
work=$(mktemp -d)

step() {  # step NAME SECONDS CMD...: run with a limit, keep its log, never stop the group
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$work/$name.log" 2>&1
  echo "rc=$?" >> "$work/$name.log"
  tail -15 "$work/$name.log"
}

case "${1:-}" in
  gpu2_tests)
    step pytest_collectives 200 python3 -m pytest -q -p no:cacheprovider tests/test_collectives.py \
      tests/test_fused_projection.py
    step pytest_tp2 150 python3 -m pytest -q -p no:cacheprovider tests/test_backends_gpu.py -k tp2
    ;;
  collectives)
    step bench 330 python3 bench/collectives.py --bench --out "$work" --deadline-s 320
    step bench_fused_projection 240 python3 bench/fused_projection.py --bench --out "$work" --deadline-s 230
    ;;
  kda_split)  # a one-minute canary per gather first: a hang (barrier miscount) must not eat the whole call
    gathers=""
    for g in gmem dsmem; do
      step "canary_$g" 60 python3 bench/kda_decode.py --split-canary "$g"
      grep -q "^rc=0$" "$work/canary_$g.log" && gathers="$gathers $g"
    done
    if [ -z "$gathers" ]; then
      echo "no gather passed its canary: split tests and benches skipped"
    else
      export K3JAX_SPLIT_GATHERS="$gathers"
      skip=""; case "$gathers" in *dsmem*) ;; *) skip=" and not dsmem" ;; esac
      step pytest_split 150 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py \
        tests/test_kda_verify_kernel.py -k "(stagings_on_gpu or split_verify_on_gpu)$skip"
      step bench_split 190 python3 bench/kda_decode.py --split "$work"
      step bench_verify_split 110 python3 bench/kda_verify.py --split --iters 20 --out "$work"
    fi
    ;;
  kda)
    step pytest_kda 200 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py -k on_gpu
    step bench_kda 240 python3 bench/kda_decode.py "$work" bench/results/kda_decode.json
    step bench_kda_layer 120 python3 bench/kda_layer.py "$work"
    ;;
  kda_wg)  # a one-minute canary first: a barrier miscount hangs
    step canary_wg 90 python3 bench/kda_decode.py --wg-canary
    if grep -q "^rc=0$" "$work/canary_wg.log"; then
      step pytest_wg 200 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py -k warpgroup_split_on_gpu
      step bench_wg 280 python3 bench/kda_decode.py --wg "$work"
    fi
    ;;
  kda_gemv)  # the projections as the decode GEMV, its partials read by the decode kernel (gemv_projections)
    step pytest_gemv 200 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_kda_decode.py \
      -k "on_gpu and (gemv or decode_x)"
    step bench_layer 240 python3 bench/kda_layer.py "$work"
    ;;
  kda_idle)  # idle slots' state written back by the kernel itself (active_B) instead of a select after it
    step pytest_idle 240 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py tests/test_backends_gpu.py \
      -k "(on_gpu and (idle or decode_x or kernel_on_gpu)) or kda_kernel_float32"
    step bench_layer 200 python3 bench/kda_layer.py "$work"
    ;;
  kda_rows)  # thread t owning state column t, row-slice staging: canary, GPU tests, bench with register counts
    step canary_rows 120 python3 bench/kda_decode.py --rows-canary
    if grep -q "^rc=0$" "$work/canary_rows.log"; then
      step pytest_rows 150 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py -k "rows and on_gpu"
      step bench_rows 280 env MOSAIC_GPU_DUMP_PTXAS=1 python3 bench/kda_decode.py --rows "$work"
    fi
    ;;
  kda_keep)  # the rows path with slices held in registers between its passes: GPU tests, bench with registers
    step pytest_keep 200 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py -k "rows_staging_on_gpu"
    step bench_keep 240 env MOSAIC_GPU_DUMP_PTXAS=1 python3 bench/kda_decode.py --keep "$work"
    ;;
  next11)  # the eleventh session's queue in one call (one cold start): kda_reference, kda_keep, sublayer_profile
    # step limits sum to 550 s: under the device's 600 s per call
    step bench_reference 80 python3 bench/kda_patterns.py --reference "$work"
    step pytest_keep 120 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py \
      -k "rows_staging_on_gpu and bf16"
    step bench_keep 200 env MOSAIC_GPU_DUMP_PTXAS=1 python3 bench/kda_decode.py --keep "$work"
    step kda_sublayer_profile 150 env JAX_PLATFORMS=cuda,cpu python3 bench/kda_profile.py --sublayer "$work"
    ;;
  session11a)  # the eleventh session's second call: the read-then-write dependency, keep 3, the sublayer
    step bench_dependency 90 python3 bench/kda_patterns.py --dependency "$work"
    step pytest_keep 100 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py \
      -k "rows_staging_on_gpu and bf16 and (32-2- or 32-3-)"
    step bench_keep 160 env MOSAIC_GPU_DUMP_PTXAS=1 python3 bench/kda_decode.py --keep "$work"
    step bench_layer 200 python3 bench/kda_layer.py "$work"
    ;;
  session11b)  # rows pass 2 by st.global (tests, bench), the api's keep 2 tuning at >= 133 tiles (tests)
    step pytest_stg 100 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py \
      -k "rows_staging_on_gpu and bf16 and global"
    step pytest_api 130 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py \
      -k "(kernel_on_gpu and -64-) or (idle_sequences_on_gpu and (8-96 or 64-))"
    step bench_stg 220 env MOSAIC_GPU_DUMP_PTXAS=1 python3 bench/kda_decode.py --stg "$work"
    ;;
  session11c)  # the api's rows keep 3 + st.global tuning at >= 133 tiles: GPU tests, then the table
    step pytest_api 200 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py \
      -k "(kernel_on_gpu and -64-) or (idle_sequences_on_gpu and (8-96 or 64-))"
    step bench_kda 290 python3 bench/kda_decode.py "$work" bench/results/kda_decode.json
    ;;
  session11d)  # the decode GEMV at batch 64: GPU tests, its launches vs XLA, the B = 64 sublayer
    step pytest_b64 100 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_kda_decode.py \
      -k "(api_on_gpu and -64]) or (decode_x_on_gpu and 64-)"
    step bench_gemv_b64 130 python3 bench/gemv.py --b64-stream "$work"
    step bench_layer_b64 150 python3 bench/kda_layer.py "$work" --cases 16:64,8:64 --name kda_layer_b64
    ;;
  session11e)  # the decode GEMV waiting per x slab: GPU tests, batch 64 vs XLA, the sublayer at B = 1 and 64
    step pytest_b64 100 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_kda_decode.py \
      -k "(api_on_gpu and -64]) or (decode_x_on_gpu and (64- or 1-6-))"
    step bench_gemv_b64 90 python3 bench/gemv.py --b64-stream "$work"
    step bench_layer_b64 120 python3 bench/kda_layer.py "$work" --cases 16:1,16:64,8:64 --name kda_layer_b64
    ;;
  session11f)  # the kernel fed the whole qkvg where XLA projects: GPU tests, the TP16 B = 64 sublayer
    step pytest_qkvg 90 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py \
      -k "decode_x_on_gpu and False"
    step bench_layer_qkvg 90 python3 bench/kda_layer.py "$work" --cases 16:64 --name kda_layer_qkvg
    ;;
  next12)  # the twelfth session's queue: 128-row GEMV blocks at batch 64; the fused gates with b out-major
    step pytest_next12 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_kda_decode.py \
      -k "(on_gpu and not kda_decode) or (gates and on_gpu) or decode_x_on_gpu"
    step bench_gemv_b64 120 python3 bench/gemv.py --b64-stream "$work"
    step bench_gates 150 python3 bench/kda_decode.py --gates "$work"
    step bench_layer 120 python3 bench/kda_layer.py "$work"
    ;;
  next12b)  # the fused gates at batch 64 (now tuned in) and at 96 heads; the sublayer with them
    step pytest_next12b 150 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py \
      -k "gates_on_gpu or (decode_x_on_gpu and 64-)"
    step bench_gates96 120 python3 bench/kda_decode.py --gates96 "$work"
    step bench_layer 150 python3 bench/kda_layer.py "$work"
    ;;
  session14c)  # the tuned launches (q/k/v/g + f_a on N from batch 9 to 32): GPU tests through kda_decode_x, sublayer
    step pytest_14c 120 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py \
      -k "decode_x_on_gpu and (12- or 32-)"
    step bench_layer 240 python3 bench/kda_layer.py "$work" --cases 16:12,16:16,16:24,16:32,8:16,8:32 \
      --name kda_layer_tuned_on_n
    ;;
  session14d)  # batch <= 8 with x streamed and the tokens on N (no XLA pad below 8 rows): the GEMV alone, sublayer
    step pytest_14d 60 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py -k "tokens_on_n_on_gpu and (1] or 5])"
    step bench_gemv_small 200 python3 bench/gemv.py --small-on-n "$work"
    step bench_layer 150 python3 bench/kda_layer.py "$work" --cases 16:1,16:8,8:1,8:8 --name kda_layer_small_on_n \
      --gemv-launch '{"max_batch": 8, "block_k": 128, "split_k": 2, "steps": 6, "x_stream": "N"}'
    step bench_layer_o 130 python3 bench/kda_layer.py "$work" --cases 16:1,8:1,8:8 --name kda_layer_small_on_n_o \
      --gemv-launch '[{"max_batch": 8, "block_k": 128, "split_k": 2, "steps": 6, "x_stream": "N"}, {"table":
      "o_proj_launch", "max_batch": 8, "block_k": 128, "split_k": 1, "steps": 6, "x_stream": "N"}]'
    ;;
  session14e)  # the final tuning (N at 1-32, o_proj on N at TP8 B <= 8): GPU tests through the api, the sublayer table
    step pytest_14e 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_kda_decode.py \
      -k "(decode_x_on_gpu and (1-6 or 8-12)) or (o_proj_on_gpu and 1536) or (api_on_gpu and not 24 and not 64)"
    step bench_layer 250 python3 bench/kda_layer.py "$work" --cases 16:1,16:8,16:16,16:64,8:1,8:8,8:64 \
      --name kda_layer_session14
    step bench_after_writes 110 python3 bench/gemv.py --after-writes "$work"
    ;;
  session14g)  # o_proj on N writing its output itself (no transpose kernel): GPU tests, the sublayer with it to 32
    step pytest_14g 130 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py \
      -k "o_proj_on_gpu or tokens_on_n_on_gpu"
    step bench_layer 250 python3 bench/kda_layer.py "$work" --cases 16:1,16:8,16:16,16:32,8:1,8:8 \
      --name kda_layer_o_proj_direct_n --gemv-launch '{"table": "o_proj_launch", "max_batch": 32,
      "block_k": 128, "split_k": 1, "steps": 6, "x_stream": "N"}'
    ;;
  session14h)  # the session's final tuning, the canonical sublayer table (bench/results/kda_layer.{json,md})
    step bench_layer 280 python3 bench/kda_layer.py "$work" --cases 16:1,16:8,16:16,16:32,16:64,8:1,8:8,8:64
    ;;
  session14a)  # the streamed GEMV with the tokens on N (the L2-prefetch decode it also ran is gone: 4bbf847)
    step pytest_14a 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py -k "tokens_on_n_on_gpu"
    step bench_gemv_on_n 220 python3 bench/gemv.py --tokens-on-n "$work"
    ;;
  session14b)  # the whole sublayer at batch 12-48 with q/k/v/g + f_a (then also o_proj) through the tokens-on-N GEMV
    step pytest_14b 120 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py \
      -k "tokens_on_n_on_gpu or (api_on_gpu and 12) or (o_proj_on_gpu and 37)"
    step bench_layer 200 python3 bench/kda_layer.py "$work" --cases 16:12,16:16,16:32,16:48,8:32 \
      --name kda_layer_tokens_on_n \
      --gemv-launch '{"min_batch": 9, "max_batch": 48, "block_k": 128, "split_k": 2, "steps": 6, "x_stream": "N"}'
    step bench_layer_o 170 python3 bench/kda_layer.py "$work" --cases 16:12,16:16,16:32,8:32 \
      --name kda_layer_tokens_on_n_o_proj --gemv-launch '[{"min_batch": 9, "max_batch": 48, "block_k": 128,
      "split_k": 2, "steps": 6, "x_stream": "N"}, {"table": "o_proj_launch", "min_batch": 9, "max_batch": 32,
      "block_k": 128, "split_k": 1, "steps": 6, "x_stream": "N"}]'
    ;;
  gemv_mid)  # the streamed GEMV alone at batch 16, 32 and 64, x unpadded: is the TMA box past B free?
    step bench_gemv_mid 200 python3 bench/gemv.py --mid "$work"
    ;;
  mid_batch)  # the whole KDA sublayer between batch 8 and 64 (streamed GEMV, o_proj through the GEMV)
    step pytest_mid 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py -k "api_on_gpu or o_proj_on_gpu"
    step bench_layer 200 python3 bench/kda_layer.py "$work" --cases 16:16,16:32,8:32 --name kda_layer_mid_batch
    ;;
  x_slabs)  # the resident-x GEMV with x's slabs loaded straight from x (no XLA transpose): GPU tests, B <= 8 layer
    step pytest_x_slabs 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_kda_decode.py \
      -k "api_on_gpu or (decode_x_on_gpu and (1- or 8-))"
    step bench_layer 150 python3 bench/kda_layer.py "$work" --cases 16:1,16:8,8:1,8:8 --name kda_layer_x_slabs
    ;;
  o_proj)  # o_proj through the decode GEMV (tuning o_proj_launch): GPU tests, the sublayer where it runs and at B = 8
    step pytest_o_proj 120 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py -k "o_proj_on_gpu"
    step bench_layer 200 python3 bench/kda_layer.py "$work" --cases 16:64,8:64,16:8 --name kda_layer_o_proj
    ;;
  partials)  # the decode kernel fed by the GEMV's partials: GPU tests through kda_decode_x, the whole sublayer table
    step pytest_partials 150 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py tests/test_gemv.py \
      -k "decode_x_on_gpu or (api_on_gpu and 64)"
    step bench_layer 260 python3 bench/kda_layer.py "$work" --cases 16:1,16:8,16:64,8:1,8:8,8:64
    ;;
  b64_stream)  # the decode GEMV at batch 64 with x streamed beside the weights: GPU tests, bench, the B = 64 sublayer
    step pytest_b64 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_kda_decode.py \
      -k "batch_64 or (decode_x_on_gpu and 64-)"
    step bench_gemv_b64 200 python3 bench/gemv.py --b64-stream "$work"
    step bench_layer_b64 150 python3 bench/kda_layer.py "$work" --cases 16:64,8:64 --name kda_layer_b64_stream \
      --gemv-launch '{"max_batch": 64, "block_k": 128, "split_k": 2, "steps": 6, "x_stream": "M"}'
    ;;
  verify_api)  # the api's verify with verify_rows_min_tiles: GPU tests through the api, then the pair table
    step pytest_verify_api 230 python3 -m pytest -q -p no:cacheprovider tests/test_kda_verify_kernel.py \
      -k "kernels_on_gpu"
    step bench_verify_pair 200 python3 bench/kda_verify.py --no-check --no-variants --iters 10 \
      --cases 64:12:8,64:6:4,8:12:8,8:6:4 --out "$work"
    ;;
  verify_rows)  # verify's rows path: GPU tests, then verify alone against the api and XLA (+ ptxas register counts)
    step pytest_verify_rows 200 python3 -m pytest -q -p no:cacheprovider tests/test_kda_verify_kernel.py -k rows_verify
    step bench_verify_rows 300 env MOSAIC_GPU_DUMP_PTXAS=1 python3 bench/kda_verify.py --rows --iters 20 --out "$work"
    ;;
  kda_reference)  # the XLA decode's idle-mask forms alone (~1 min)
    step bench_reference 100 python3 bench/kda_patterns.py --reference "$work"
    ;;
  kda_patterns)  # copies of the state moved the ways a decode kernel could; the XLA decode's idle mask
    step bench_patterns 400 python3 bench/kda_patterns.py "$work"
    ;;
  kda_final)  # the api's tuned launch (rows above 132 tiles): GPU tests through the api, then the table
    step pytest_api 150 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py \
      -k "kernel_on_gpu or idle_sequences_on_gpu"
    step bench_kda 280 python3 bench/kda_decode.py "$work" bench/results/kda_decode.json
    ;;
  kda_table)
    step bench_kda 280 python3 bench/kda_decode.py "$work" bench/results/kda_decode.json
    ;;
  kda_idle_cost)  # what the idle-slot mask costs the decode kernel: GPU tests, then with and without it
    step pytest_idle 150 python3 -m pytest -q -p no:cacheprovider tests/test_kda_decode.py -k "on_gpu and idle"
    step bench_idle 150 env MOSAIC_GPU_DUMP_PTXAS=1 python3 bench/kda_decode.py --idle "$work"  # + register counts
    ;;
  kda_verify)  # ran past 120 s and 150 s without a case in the fourth session: fewer compiles, more time
    step bench_verify 400 python3 bench/kda_verify.py --no-check --no-variants --cases 64:12:8,64:6:4 --iters 10 \
      --out "$work"
    ;;
  profile)
    export JAX_PLATFORMS=cuda,cpu  # in-kernel traces come back through a host callback
    step mix_norm_profile 120 python3 bench/mix_norm_profile.py "$work"
    step kda_profile 80 python3 bench/kda_profile.py "$work"
    ;;
  sublayer_profile)  # the decode kernel fed by the GEMV's partials vs finished projections, in-kernel phases
    export JAX_PLATFORMS=cuda,cpu  # in-kernel traces come back through a host callback
    step kda_sublayer_profile 200 python3 bench/kda_profile.py --sublayer "$work"
    ;;
  mla)  # MLA decode attention (pallas_kernels/mla_decode): GPU tests, then the kernel against XLA
    step pytest_mla 250 python3 -m pytest -q -p no:cacheprovider tests/test_mla_decode.py -k on_gpu
    step bench_mla 290 python3 bench/mla_layer.py "$work" --deadline-s 260
    ;;
  mla_variants)  # the MLA kernel's launch variants at 8K (bench/mla_layer.py VARIANTS), ~3 min
    step bench_mla_variants 240 python3 bench/mla_layer.py "$work" --variants --deadline-s 200
    ;;
  gemv)  # the decode GEMV kernel: GPU tests, then against XLA at one rank's KDA projection shapes
    step pytest_gemv 100 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py -k on_gpu
    step bench_gemv 200 python3 bench/gemv.py "$work"
    ;;
  kda_cold)
    step bench_cold 240 python3 bench/kda_decode.py --cold "$work"
    ;;
  layer)
    step linear_variants 200 python3 bench/kda_layer_kernels.py --linear "$work" default
    ;;
  moe)
    export XLA_PYTHON_CLIENT_MEM_FRACTION=.95  # the rank slice's weights fill most of the H200
    step rank_slice_packed 560 python3 bench/rank_slice.py --layers 24 --batches 1,64 --moe-impl packed \
      --out "$work"
    ;;
  *)
    echo "usage: bash bench/device_queue.sh gpu2_tests|collectives|kda_split|kda|kda_wg|kda_gemv|kda_idle|kda_rows|kda_final|kda_keep|kda_reference|next11|session11a|session11b|session11c|session11d|session11e|session11f|next12|kda_patterns|kda_table|kda_idle_cost|kda_verify|profile|sublayer_profile|moe|layer|kda_cold|gemv|mla|mla_variants" >&2
    exit 2
    ;;
esac
mkdir -p "$OUT"
tar -czf "$OUT/$1.tar.gz" -C "$work" .
echo "wrote $OUT/$1.tar.gz"
