#!/usr/bin/env bash
# Here, once: `scripts/gpu_vllm.sh prepare` builds the CUDA vLLM chunks (../shared/tools/cuda_vllm/)
# and downloads into .whl/extra what vLLM's FP8 path imports and the chunks lack (compressed-tensors,
# loguru). On the GPU machine, after the chunks were carried, it unpacks them with the wheels in
# .whl/mcore (megatron-core) and .whl/extra, then runs
#   scripts/gpu_vllm.sh tests   the `-m gpu_vllm` engine tests, the FP8 engine's and the serve ones side
#                               by side, then the CUDA FP8 quantizer's and the NCCL sender's tests
#   scripts/gpu_vllm.sh recipes the FSDP2 and Megatron recipes against a CUDA `vllm serve`
#   scripts/gpu_vllm.sh fp8     the FP8 CUDA engine test alone
#   scripts/gpu_vllm.sh bench   bench/cuda_engine_bench.py alone (its figures want the machine to itself)
#   scripts/gpu_vllm.sh profile where the sender's refits spend device and host time (no chunks):
#                               bench/refit_profile.py, graph replay at 64 MiB (a first sender, one
#                               after another closed or left open, with and without the captured
#                               broadcast) and FP8 at 256 MiB
#   scripts/gpu_vllm.sh sweep   the sender sweep, its calibration run, the FP8 bench (no vLLM: no chunks;
#                               GRAPH_SEND=off leaves out the frames sent by graph replay;
#                               SWEEP_ARGS: more sender_sweep.py arguments, e.g. "--buffers 2,3")
# Logs and results go to $OUT (default: gpu_out/), named after the GPU (h100, h200, ...).
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
      grep -oiE '[A-Z][0-9]{3}' | head -1 | tr 'A-Z' 'a-z'); gpu=${gpu:-gpu}
if [ "${1:-}" = prepare ]; then
  [ -d .whl/c00 ] || bash ../shared/tools/cuda_vllm/prepare.sh || exit 1
  exec python3 -m pip download -q --no-deps -d .whl/extra compressed-tensors==0.17.0 loguru==0.7.3
fi
if [ "${1:-}" = profile ]; then  # issues 37 and 38: one text file in $OUT
  export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=1
  for list in moe qwen3_30b_a3b; do
    python3 bench/refit_profile.py --list $list --bucket-mib 64 --graph-send
    # a sweep's later cases (the model list's 64 MiB ran ~1.5x one copy there, ~1.2x first)
    python3 bench/refit_profile.py --list $list --bucket-mib 64 --graph-send --after 1
    # the same with the earlier sender left open (its frames' graphs alive): the contrast
    python3 bench/refit_profile.py --list $list --bucket-mib 64 --graph-send --after 1 \
      --after-mode open
    # and without the captured broadcast: is it the NCCL node of the destroyed graphs?
    python3 bench/refit_profile.py --list $list --bucket-mib 64 --graph-send --eager-broadcast
    python3 bench/refit_profile.py --list $list --bucket-mib 64 --graph-send --eager-broadcast \
      --after 1
    # FP8 (issue 38): the device's timeline and the host's calls of one refit
    python3 bench/refit_profile.py --list $list --bucket-mib 256 --fp8 --graph-send \
      --timeline 80 --host-timeline
    python3 bench/refit_profile.py --list $list --bucket-mib 256 --fp8 --host 30
  done > "$out/refit_profile_${gpu}.txt" 2>&1
  rc=$?; grep -E "wall|^\{" "$out/refit_profile_${gpu}.txt" | cut -c1-400; exit $rc
fi
if [ "${1:-}" = sweep ]; then  # issue 37: bench/sender_sweep.py calibrated by the broadcast bench
  # Seven JSON files and one log in $OUT (a device call brings back 8 files at most).
  export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=1
  logs=$(mktemp -d)
  python3 bench/fp8_bench.py --profile 30 --out "$out/fp8_${gpu}.json" > "$logs/fp8.log" 2>&1; fp8=$?  # issue 38
  # the cost model's calibration: eager frames, and the default (graph replay)
  REFIT_GRAPH_SEND=0 python3 bench/broadcast_bench.py --out "$out/gpu_${gpu}x1_sweep_cal.json" \
    > "$logs/cal.log" 2>&1
  REFIT_GRAPH_SEND=1 python3 bench/broadcast_bench.py --out "$out/gpu_${gpu}x1_sweep_cal_graph.json" \
    > "$logs/cal_graph.log" 2>&1
  python3 bench/sender_sweep.py --graph-send "${GRAPH_SEND:-both}" --keep-graph-senders \
    ${SWEEP_ARGS:-} \
    --out "$out/sender_sweep_${gpu}.json" > "$logs/sweep.log" 2>&1
  rc=$?
  python3 bench/sender_host_bench.py --device cuda --profile 30 --out "$out/sender_host_${gpu}.json" \
    > "$logs/sender_host.log" 2>&1; host=$?
  if [ "${GRAPH_SEND:-both}" != off ]; then
    python3 bench/sender_host_bench.py --device cuda --graph-send --profile 30 \
      --out "$out/sender_host_graph_${gpu}.json" > "$logs/sender_host_graph.log" 2>&1
    host=$(( host || $? ))
    # the sweep's 64 MiB MoE buckets hold 169 tensors: the host's share per tensor
    python3 bench/sender_host_bench.py --device cuda --graph-send --tensors 20000 --per-bucket 169 \
      --profile 30 --out "$out/sender_host_tensors_${gpu}.json" > "$logs/sender_host_tensors.log" 2>&1
    host=$(( host || $? ))
  fi
  cat "$logs"/*.log > "$out/sweep_logs.txt"
  tail -n 2 "$logs"/*.log
  exit $(( rc || host || fp8 ))
fi
bash .whl/site.sh
for w in .whl/mcore/*.whl .whl/extra/*.whl; do [ -e "$w" ] && python3 -m zipfile -e "$w" /tmp/site/; done
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/device.txt"
run() { python3 -m pytest -q -s -p no:cacheprovider -m gpu_vllm "$@"; }
case "${1:-tests}" in
  tests)
    run tests/gpu_vllm/test_cuda_engine.py > "$out/gpu_engine.log" 2>&1 & engine=$!
    run tests/gpu_vllm/test_cuda_fp8.py > "$out/gpu_fp8_engine.log" 2>&1 & fp8=$!
    run tests/gpu_vllm/test_cuda_serve.py > "$out/gpu_serve.log" 2>&1
    serve=$?
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py tests/test_gpu.py \
      > "$out/gpu_fp8_kernel.log" 2>&1
    kernel=$?; wait $engine; engine=$?; wait $fp8; fp8=$?
    tail -n 3 "$out"/gpu_*.log
    exit $(( serve || engine || fp8 || kernel ));;
  fp8)
    run tests/gpu_vllm/test_cuda_fp8.py > "$out/gpu_fp8_engine.log" 2>&1
    rc=$?; tail -n 3 "$out/gpu_fp8_engine.log"; exit $rc;;
  recipes)
    run tests/gpu_vllm/test_cuda_recipes.py > "$out/gpu_recipes.log" 2>&1
    rc=$?; tail -n 3 "$out/gpu_recipes.log"; exit $rc;;
  bench)
    python3 bench/cuda_engine_bench.py --out "$out/cuda_engine_${gpu}.json" > "$out/bench.log" 2>&1
    rc=$?; tail -n 4 "$out/bench.log"; exit $rc;;
esac
