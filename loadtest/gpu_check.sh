#!/usr/bin/env bash
# What to run first on a GPU host, as one script with a time limit per step: the Triton kernels
# compiled, the whole engine on the GPU against transformers (tests/test_cuda_engine.py), the
# engine benchmark (decode vs roofline, eager vs graphs, prefill MFU), and host CPU per token on the
# GPU (bench_host --device cuda). Each step's output goes to its own log in OUTDIR; a step that fails
# or runs past its limit is reported and the next one still runs.
#
#   bash loadtest/gpu_check.sh OUTDIR [steps]      # steps: comma list of env,kernels,engine,bench,host,mla,
#                                                  #   quantk,quant,quantsweep,int4 (weight-only int8/int4),
#                                                  #   async (async scheduling: tests + in-process on vs off),
#                                                  #   hostsync (bench_host with --async-scheduling=off),
#                                                  #   hostrelay (bench_host: the direct relays vs the streams' handlers),
#                                                  #   compressed (--compress-weights: tests + the matmul timed),
#                                                  #   compressedtests (its tests and every family's engine compressed),
#                                                  #   compressedfast (the tiles' and experts' fast decode vs select),
#                                                  #   compresseddecoder (the prefill's decoder: fast vs select),
#                                                  #   compressedmoeprefill (compressed experts at prefill: stacks decoded vs tiles),
#                                                  #   compressedrows (the row kernel at 2-4 rows per program vs the tiles),
#                                                  #   compressedengine (8B and MoE decode/prefill, plain vs compressed),
#                                                  #   compressedsweep (the one-row kernel's launch shapes by registers:
#                                                  #   loadtest/results/gpu-decode/compile-only/triton_aot.txt),
#                                                  #   fp8tests (FP8 weights and the e4m3 KV cache compiled and run),
#                                                  #   fp8engine (8B decode/prefill: bf16 vs fp8 weights), fp8kv (16k
#                                                  #   context: bf16 vs e4m3 KV), fp8moe (DeepSeek-V2-Lite: bf16 vs fp8),
#                                                  #   fp8gemm (weight-only vs w8a8 per matrix: sets W8A8_MIN_ROWS),
#                                                  #   fp8native (e4m3 widened by the GPU's cvt vs bit placement),
#                                                  #   normrope (RMSNorm and RoPE: their Triton kernels vs torch's ops)
#
# Needs the project's Python dependencies importable (pip install -e '.[test]'); on a host with no
# network, carry what its image lacks as wheels (the H200 image's grpcio 1.84 is older than the generated
# protos need, 1.85.1: `pip download grpcio==1.85.3 protobuf==7.36.2` for its Python, installed with --target
# and PYTHONPATH; its missing pytest-asyncio leaves the async tests to CI). On a host with no
# network, SPLITFIRE_HOME must already hold bench-models/host-llama (loadtest/random_models.py).
set -u
OUT=${1:?usage: gpu_check.sh OUTDIR [steps]}
STEPS=${2:-env,kernels,bench,host,engine}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
summary="$OUT/summary.txt"

step() {  # step NAME LIMIT_S CMD...
    local name=$1 limit=$2
    shift 2
    case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local verdict=ok
    [ $rc -eq 124 ] && verdict="TIMED OUT after ${limit}s"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && verdict="FAILED rc=$rc"
    echo "$name: $verdict ($((SECONDS - t0)) s)" | tee -a "$summary"
}

step env 60 bash -c "nvidia-smi; $PY -c 'import torch, triton, sys; print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())'; nproc; grep -m1 'model name' /proc/cpuinfo"
step kernels 120 $PY -m pytest -q -p no:cacheprovider --timeout 120 tests/test_triton_kernels.py tests/test_staging.py
step engine 150 $PY -m pytest -q -p no:cacheprovider --timeout 120 tests/test_cuda_engine.py
step bench 130 $PY -m loadtest.bench_gpu
step host 120 $PY -m loadtest.bench_host --device cuda --layouts colocated --rounds 2 --profile --json "$OUT/host.json"
step quantk 60 $PY -m pytest -q -p no:cacheprovider --timeout 120 tests/test_triton_kernels.py -k "weight_only or expert"
step quant 120 $PY -m loadtest.bench_quant_gemm --reps 10 --methods gemv,dot,dequant --rows 1,2,4,16,32,64,128,256,2048
step int4 60 $PY -m loadtest.bench_gpu --preset llama3-8b --quantization int4 --batches 1,32
step quantsweep 100 $PY -m loadtest.bench_quant_gemm --sweep --methods gemv,dot --rows 1,2,16,64 --shapes gate_up,down --reps 10
step async 240 bash -c "$PY -m pytest -q -p no:cacheprovider --timeout 120 tests/test_async_scheduling.py && $PY -m loadtest.bench_async_sched --tokens 128 --rounds 3 && $PY -m loadtest.bench_async_sched --tokens 128 --rounds 3 --temperature 0.8"
step hostsync 120 $PY -m loadtest.bench_host --device cuda --layouts colocated --rounds 2 --no-engine --worker-arg=--async-scheduling=off --json "$OUT/host_sync.json"
step hostrelay 200 $PY -m loadtest.bench_host --device cuda --layouts colocated,pd --rounds 2 --no-engine --stream-relays direct,queued --json "$OUT/host_relay.json"
step compressed 280 bash -c "$PY -m pytest -q -p no:cacheprovider --timeout 120 tests/test_compressed_weight.py; $PY -m loadtest.bench_compressed_gemm --reps 60 --tiles 32x256/8/3,64x64/8/3 --rows 1,16,24,32,64,512 --decodes auto,bfloat16 --json $OUT/compressed_gemm.json"
step compressedtests 240 $PY -m pytest -q -p no:cacheprovider --timeout 120 tests/test_compressed_weight.py tests/test_cuda_engine.py -k "compress"
step compressedengine 300 bash -c "$PY -m loadtest.bench_gpu --preset llama3-8b,deepseek-v2-lite --batches 1,32 --iters 10 && $PY -m loadtest.bench_gpu --preset llama3-8b,deepseek-v2-lite --batches 1,32 --iters 10 --compress-weights --gemv-launch 32x256/4/3,32x256/8/3,32x128/4/3"
# The one-row compressed kernel's launch shapes (its default: 32x256 with 8 warps; triton_aot for registers): fewer per
# thread (8 warps, narrower K) keeps more warps in flight for a memory-bound GEMV.
step compressedsweep 200 $PY -m loadtest.bench_compressed_gemm --reps 60 --rows 1 --tiles 32x256/4/3,32x256/8/3,32x128/4/3,16x256/4/3,64x64/8/3,32x64/4/3 --json $OUT/compressed_sweep.json
# The tiles' (17-32 rows) and the compressed experts' fast decode (TILES_DECODE / EXPERTS_DECODE, select until
# timed): correct compiled on the device, then per matrix and per decode step against select.
step compressedfast 400 bash -c "$PY -m pytest -q -p no:cacheprovider --timeout 120 tests/test_compressed_weight.py tests/test_cuda_engine.py -k compress; $PY -m loadtest.bench_compressed_gemm --reps 40 --rows 16,24,32 --tiles 64x64/8/3 --decodes select,fast --json $OUT/compressed_tiles_fast.json; $PY -m loadtest.bench_gpu --preset llama3-8b,deepseek-v2-lite --batches 16,32 --iters 20 --prefill-tokens 512 --compress-weights --tiles-decode select,fast,select,fast"
# The prefill's decoder (`decompress`, from 33 rows) without its escape select (DECOMPRESS_DECODE), per matrix and
# in the 8B and MoE prefill of 2048 tokens, against select and the plain bfloat16 engine.
step compresseddecoder 380 bash -c "$PY -m pytest -q -p no:cacheprovider --timeout 120 tests/test_compressed_weight.py; $PY -m loadtest.bench_compressed_gemm --reps 30 --rows 64,512,2048 --decodes select,fast --json $OUT/compressed_decoder.json; $PY -m loadtest.bench_gpu --preset llama3-8b,deepseek-v2-lite --batches 1 --iters 10 --prefill-tokens 2048 --compress-weights --tiles-decode select,fast,select,fast; $PY -m loadtest.bench_gpu --preset llama3-8b,deepseek-v2-lite --batches 1 --iters 10 --prefill-tokens 2048"
# The compressed experts at prefill: the stacks decoded for the plain grouped GEMM (DECODED_EXPERTS_MIN_BLOCKS 2) vs
# decoded in the tiles (0), DeepSeek-V2-Lite shape, 2048 and 512 tokens, alternating; then plain weights.
step compressedmoeprefill 300 bash -c "$PY -m pytest -q -p no:cacheprovider --timeout 120 tests/test_compressed_weight.py -k 'expert or prefill'; $PY -m loadtest.bench_gpu --preset deepseek-v2-lite --batches 1 --iters 30 --prefill-tokens 2048 --compress-weights --experts-min-blocks 2,0,2,0 && $PY -m loadtest.bench_gpu --preset deepseek-v2-lite --batches 1 --iters 30 --prefill-tokens 512 --compress-weights --experts-min-blocks 1,0,1,0 && $PY -m loadtest.bench_gpu --preset deepseek-v2-lite --batches 1 --iters 30 --prefill-tokens 2048"
# The row kernel with 2 and 4 rows per program (each weight decoded once for them) against the tiles at 2-4 rows, per
# matrix and in the 8B decode step at batch 2 and 4 (GEMV_MAX_ROWS 1 = tiles vs 4 = the row kernel, alternating).
step compressedrows 300 bash -c "$PY -m pytest -q -p no:cacheprovider --timeout 120 tests/test_compressed_weight.py -k 'several_rows or plain_ones'; $PY -m loadtest.bench_compressed_gemm --reps 40 --rows 1,2,3,4 --tiles 32x256/8/3,64x64/8/3 --json $OUT/compressed_rows.json; $PY -m loadtest.bench_gpu --preset llama3-8b --batches 1,2,4 --iters 20 --compress-weights --gemv-max-rows 1,4,1,4"
step mla 90 $PY -m loadtest.bench_gpu --preset deepseek-v2-lite --quantization int4 --batches 1,32
# FP8 (#57): the FP8 tests compiled on the device (the kernels against their references; block-FP8 engines by
# weight-only and w8a8 and the e4m3 KV cache against float32 on the CPU), the engine (8B: bf16 vs fp8 weights by
# both methods; 16k context: bf16 vs e4m3 KV; DeepSeek-V2-Lite: bf16 vs fp8), then the matrix methods
# (weight-only gemv/dot vs w8a8 per row count, each at several launch shapes: where w8a8 starts winning is
# fp8_triton.W8A8_MIN_ROWS). The device's python has no pytest-asyncio: the PD-pair test runs in CI only.
step fp8tests 120 $PY -m pytest -q -p no:cacheprovider --timeout 110 -n 8 -rfE tests/test_cuda_engine.py tests/test_triton_kernels.py tests/test_kv_cache_dtype.py -k "(fp8 or e4m3 or w8a8 or split_k or refused_on_cuda) and not disaggregated"
step fp8engine 200 bash -c "$PY -m loadtest.bench_gpu --preset llama3-8b --backends triton --batches 1,32 --iters 10 && $PY -m loadtest.bench_gpu --preset llama3-8b --backends triton --batches 1,32 --iters 10 --quantization fp8 --fp8-gemm auto,weight-only,w8a8"
step fp8kv 130 bash -c "$PY -m loadtest.bench_gpu --preset llama3-8b --backends triton --batches 1,8 --context 16384 --iters 10 --prefill-tokens 512 && $PY -m loadtest.bench_gpu --preset llama3-8b --backends triton --batches 1,8 --context 16384 --iters 10 --prefill-tokens 512 --kv-cache-dtype fp8"
step fp8gemm 200 bash -c "$PY -m loadtest.bench_quant_gemm --kinds fp8 --shapes qkv,o,gate_up,down --methods gemv --rows 1 --sweep --reps 10; $PY -m loadtest.bench_quant_gemm --kinds fp8 --shapes qkv,o,gate_up,down --methods dot,w8a8 --rows 4,16,64 --sweep --reps 10; $PY -m loadtest.bench_quant_gemm --kinds fp8 --shapes qkv,o,gate_up,down --methods w8a8 --rows 256,2048 --sweep --reps 10"
step fp8moe 150 bash -c "$PY -m loadtest.bench_gpu --preset deepseek-v2-lite --backends triton --batches 1,32 --iters 10 && $PY -m loadtest.bench_gpu --preset deepseek-v2-lite --backends triton --batches 1,32 --iters 10 --quantization fp8 --fp8-gemm auto,weight-only,w8a8"
# e4m3 widened by the GPU's cvt (SPLITFIRE_E4M3_NATIVE=1) against the bit placement (0): the FP8 tests compiled with it,
# then the 8B FP8 decode (weight-only, where every weight is widened) and the e4m3 KV cache at 16k, each both ways.
step fp8native 300 bash -c "SPLITFIRE_E4M3_NATIVE=1 $PY -m pytest -q -p no:cacheprovider --timeout 110 -n 8 -rfE tests/test_cuda_engine.py tests/test_triton_kernels.py -k 'fp8 or e4m3 or w8a8'; for n in 0 1; do SPLITFIRE_E4M3_NATIVE=\$n $PY -m loadtest.bench_gpu --preset llama3-8b --backends triton --batches 1,32 --iters 10 --quantization fp8 --fp8-gemm weight-only,auto; SPLITFIRE_E4M3_NATIVE=\$n $PY -m loadtest.bench_gpu --preset llama3-8b --backends triton --batches 1,8 --context 16384 --iters 10 --prefill-tokens 512 --kv-cache-dtype fp8; done"
step normrope 300 bash -c "$PY -m pytest -q -p no:cacheprovider --timeout 110 -n 8 -rfE tests/test_cuda_engine.py tests/test_triton_kernels.py -k 'norm or rope or engine'; for n in 0 1; do SPLITFIRE_NORM_ROPE_KERNELS=\$n $PY -m loadtest.bench_gpu --preset llama3-8b --backends triton --batches 1,8,32,128 --iters 10; SPLITFIRE_NORM_ROPE_KERNELS=\$n $PY -m loadtest.bench_gpu --preset smollm2-135m --backends triton --batches 1,32 --iters 10; done"
cat "$summary"
