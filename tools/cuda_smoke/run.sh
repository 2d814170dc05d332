#!/usr/bin/env bash
# The CUDA smoke check, as run on a lent GPU machine through the device tool.
#
# Prepare here (wheels of our packages and of what the GPU image lacks go in .whl/,
# which .git/info/exclude must ignore):
#   python -m pip wheel --no-deps -w .whl packages/europa-spec packages/europa-core \
#       packages/europa-cli packages/europa-flexshard packages/europa-offload
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 --platform any -d .whl torchtitan==0.3.0 \
#       spmd_types==0.2.3 tomli_w==1.2.0 tyro==1.0.17 \
#       docstring_parser==0.18.0 typeguard==4.6.1 crc32c==2.9.post0
# Then run there, carrying .whl:  bash tools/cuda_smoke/run.sh
# Results land in $OUT: env.txt, flexshard_alone.json, smoke.txt, pytest_cuda.txt,
# measured_gpu.toml + measure_hardware.txt (this GPU measured) and plan_bf16_debug.json
# (the bf16 debug step predicted with it; smoke.txt's bfloat16-none run measures it),
# and the benchmarks' JSON (their CPU halves run on the machine's cores).
set -u
here=$(dirname "$0")
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
# The GPU image's older torch gets from the shim the torch 2.13 names europa and
# torchtitan use (tools/cuda_smoke/shim/sitecustomize.py).
export PYTHONPATH=/tmp/site:$PWD/$here/shim
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), torch.version.cuda)" | tee $OUT/env.txt
nproc >> $OUT/env.txt
timeout 120 python3 $here/flexshard_alone.py > $OUT/flexshard_alone.json
cat $OUT/flexshard_alone.json
for dtype in float32 bfloat16; do
  for plugin in none flexshard offload; do
    name=$dtype-$plugin
    flag=""; [ $plugin != none ] && flag="-p $plugin"
    start=$SECONDS
    timeout 150 python3 -m europa.cli train debug $flag --nproc 1 --run-dir /tmp/runs/$name \
      --set training.steps=10 --set metrics.progress=false --set "training.dtype=\"$dtype\"" \
      > /tmp/$name.log 2>&1
    echo "$name exit=$? seconds=$((SECONDS - start))" | tee -a $OUT/smoke.txt
    tail -4 /tmp/$name.log | cut -c1-400 >> $OUT/smoke.txt
    [ -f /tmp/runs/$name/metrics.jsonl ] && python3 $here/collect.py /tmp/runs/$name >> $OUT/smoke.txt
  done
done
# A background save on CUDA: pinned staging, written while training goes on, then verified.
timeout 150 python3 -m europa.cli train debug --nproc 1 --run-dir /tmp/runs/async \
  --set training.steps=6 --set checkpoint.every=2 --set 'checkpoint.mode="async"' \
  --set metrics.progress=false > /tmp/async.log 2>&1
echo "async-checkpoint exit=$?" | tee -a $OUT/smoke.txt
tail -2 /tmp/async.log | cut -c1-400 >> $OUT/smoke.txt
timeout 60 python3 -m europa.cli checkpoint verify /tmp/runs/async --no-progress >> $OUT/smoke.txt 2>&1
bf16='training.dtype="bfloat16"'
timeout 150 python3 -m europa.cli plan debug --measure-hardware --set "$bf16" \
  --set parallel.nproc=1 --out $OUT/measured_gpu.toml > $OUT/measure_hardware.txt 2>&1
echo "measure-hardware exit=$?" >> $OUT/measure_hardware.txt
timeout 60 python3 -m europa.cli plan debug --hardware $OUT/measured_gpu.toml --set "$bf16" \
  --set parallel.nproc=1 --json > $OUT/plan_bf16_debug.json 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/ > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit=$?" >> $OUT/pytest_cuda.txt
tail -5 $OUT/pytest_cuda.txt
timeout 200 python3 benchmarks/offload.py --json > $OUT/bench_offload.json
timeout 200 python3 benchmarks/flexshard.py --json > $OUT/bench_flexshard_cpu.json
timeout 200 python3 benchmarks/expert_parallel.py --json > $OUT/bench_expert_parallel_cpu.json
cat $OUT/smoke.txt
