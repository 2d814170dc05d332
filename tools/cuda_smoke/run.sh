#!/usr/bin/env bash
# The prepared GPU check, run in one call of the device tool (at most 8 minutes).
#
# Prepare here (wheels of our packages and of what the GPU image lacks go in .whl/,
# which .git/info/exclude must ignore):
#   python -m pip wheel --no-deps -w .whl packages/europa-spec packages/europa-core \
#       packages/europa-cli packages/europa-flexshard packages/europa-offload
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 --platform any -d .whl torchtitan==0.3.0 \
#       spmd_types==0.2.3 tomli_w==1.2.0 tyro==1.0.17 \
#       docstring_parser==0.18.0 typeguard==4.6.1 crc32c==2.9.post0 \
#       datasets==4.7.0 torchdata==0.11.0 dill==0.4.0 multiprocess==0.70.18
# (the last four: torchtitan's Trainer, which e2e_gpu runs, imports them; the image lacks
# them)
# Then run there, carrying .whl:  bash tools/cuda_smoke/run.sh   (device tool timeout 540)
#
# Parts run in order of what matters most, each within its own budget and what is left of
# the whole check's (SMOKE_BUDGET_S, 450 s after the install); a part that no longer fits
# is skipped, saying so. $OUT/parts.jsonl has a line per part: its status (ok, exit N,
# timeout, skipped) and seconds. Results land in $OUT:
#   env.txt                     Python, torch, the GPU, CUDA, cores
#   bench_offload.json          europa-offload's CUDA path: peak memory with and without
#                               offload, step time, and the copies' overlap with kernels
#                               from a profiler trace (trace/offload_step_trace.json)
#   e2e_gpu/e2e.json            benchmarks/e2e.py on this GPU in bf16, the `small` preset
#                               (406 M parameters): core and FlexShard against torchtitan's
#                               Trainer, tokens/s, MFU against bf16 torch.mm, peak memory,
#                               and the GPU targets (e2e_gpu/e2e_table.md, the operators
#                               by GPU time in e2e_gpu/e2e_profile_europa.txt)
#   pytest_cuda.txt             the cuda-marked tests
#   smoke.txt                   fp32 and bf16 training with each plugin that runs on one
#                               GPU, then a background checkpoint save, verified
#   measured_gpu.toml, measure_hardware.txt, plan_bf16_debug.json
#                               this GPU measured, and the bf16 debug step predicted with it
#   flexshard_alone.json        europa-flexshard without europa-core
#   bench_flexshard_cpu.json, bench_expert_parallel_cpu.json   (their CPU halves)
set -u
here=$(dirname "$0")
export PYTHONUNBUFFERED=1
deadline=$((SECONDS + ${SMOKE_BUDGET_S:-450}))

record() {  # record NAME STATUS SECONDS [REASON]
  printf '{"part": "%s", "status": "%s", "seconds": %s%s}\n' "$1" "$2" "$3" \
    "${4:+, \"reason\": \"$4\"}" >> $OUT/parts.jsonl
}

part() {  # part NAME BUDGET_S OUTPUT COMMAND...: COMMAND's stdout and stderr to OUTPUT
  local name=$1 budget=$2 output=$3 left=$((deadline - SECONDS)) start=$SECONDS code
  shift 3
  if [ $left -lt 15 ]; then
    record "$name" skipped 0 "the check's budget is spent"
    return
  fi
  [ $budget -gt $left ] && budget=$left
  timeout $budget "$@" > "$output" 2>&1
  code=$?
  case $code in
    0) record "$name" ok $((SECONDS - start)) ;;
    124) record "$name" timeout $((SECONDS - start)) "past its ${budget} s" ;;
    *) record "$name" "exit $code" $((SECONDS - start)) ;;
  esac
}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
# The GPU image's older torch gets from the shim the torch 2.13 names europa and
# torchtitan use (tools/cuda_smoke/shim/sitecustomize.py).
export PYTHONPATH=/tmp/site:$PWD/$here/shim
: > $OUT/parts.jsonl
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), torch.version.cuda)" > $OUT/env.txt 2>&1
nproc >> $OUT/env.txt
cat $OUT/env.txt

part offload 90 $OUT/bench_offload.json \
  python3 benchmarks/offload.py --json --trace $OUT/trace
part e2e_gpu 180 $OUT/e2e_gpu.log \
  python3 benchmarks/e2e.py --device cuda --dtype bfloat16 --preset small --worlds 1 \
  --global-batch 8 --seq-len 2048 --warmup 3 --steps 6 --profile-steps 1 --out $OUT/e2e_gpu
part pytest_cuda 120 $OUT/pytest_cuda.txt \
  python3 -m pytest -q -p no:cacheprovider -m cuda tests/

smoke() {  # smoke NAME ARGS...: 10 steps of the debug preset on one GPU, then a summary
  local name=$1
  shift
  part "smoke-$name" 45 /tmp/$name.log python3 -m europa.cli train debug --nproc 1 \
    --run-dir /tmp/runs/$name --set training.steps=10 --set metrics.progress=false "$@"
  echo "$name: $(tail -1 $OUT/parts.jsonl)" >> $OUT/smoke.txt
  tail -3 /tmp/$name.log | cut -c1-400 >> $OUT/smoke.txt
  [ -f /tmp/runs/$name/metrics.jsonl ] && python3 $here/collect.py /tmp/runs/$name >> $OUT/smoke.txt
}
for dtype in float32 bfloat16; do
  for plugin in none flexshard offload; do
    flag=(); [ $plugin != none ] && flag=(-p $plugin)
    smoke $dtype-$plugin "${flag[@]}" --set "training.dtype=\"$dtype\""
  done
done
smoke async-checkpoint --set training.steps=6 --set checkpoint.every=2 \
  --set 'checkpoint.mode="async"'
part verify-checkpoint 30 /tmp/verify.log \
  python3 -m europa.cli checkpoint verify /tmp/runs/async-checkpoint --no-progress
cat /tmp/verify.log >> $OUT/smoke.txt

bf16='training.dtype="bfloat16"'
part measure_hardware 90 $OUT/measure_hardware.txt \
  python3 -m europa.cli plan debug --measure-hardware --set "$bf16" \
  --set parallel.nproc=1 --out $OUT/measured_gpu.toml
part plan_bf16_debug 30 $OUT/plan_bf16_debug.json \
  python3 -m europa.cli plan debug --hardware $OUT/measured_gpu.toml --set "$bf16" \
  --set parallel.nproc=1 --json
part flexshard_alone 60 $OUT/flexshard_alone.json python3 $here/flexshard_alone.py
part bench_flexshard_cpu 60 $OUT/bench_flexshard_cpu.json python3 benchmarks/flexshard.py --json
part bench_expert_parallel_cpu 60 $OUT/bench_expert_parallel_cpu.json \
  python3 benchmarks/expert_parallel.py --json
cat $OUT/smoke.txt $OUT/parts.jsonl
