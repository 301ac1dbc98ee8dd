#!/usr/bin/env bash
# One run on a lent GPU machine (docs/development.md, "The GPU check"): the engine's fidelity tests on CUDA, then
# offline throughput (continuous vs static vs transformers) on random-weight models in the default
# model's shape and in an 8B shape. The machine has torch/CUDA but no network and no model files:
# .whl carries the Python packages its image lacks or has in other versions, .gpu/smollm2-tokenizer
# the tokenizer. Results go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export CARPOOL_SMOLLM2_PATH=$PWD/.gpu/smollm2-tokenizer CARPOOL_TEST_DEVICE=cuda
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

echo "== engine tests on CUDA (the cuda and reference attention backends, each compiled and eager)"
timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" --maxfail=10 tests/engine/test_fidelity.py \
  tests/engine/test_engine_behaviour.py tests/engine/test_metrics.py 2>&1 | tee $OUT/tests.log | tail -25

echo "== throughput and step profile"
for shape in smollm2-135m llama3-8b; do
  python3 -m tests.gpu.make_random_model --tokenizer .gpu/smollm2-tokenizer --shape $shape --out /tmp/$shape --device cuda || continue
  for seats in 64; do
    echo "-- $shape, $seats seats: continuous vs static"
    timeout 150 python3 -m cluster.bench offline --model /tmp/$shape --device cuda --dtype bfloat16 \
      --workload seed-mix --num-requests 128 --seats $seats --max-num-batched-tokens 2048 \
      --kv-cache-memory 8GiB --no-progress --json $OUT/bench-$shape-$seats.json 2>&1 | grep -v Warning | tail -8
    echo "-- $shape, $seats seats: where a decode step's time goes"
    timeout 120 python3 -m cluster.bench profile --model /tmp/$shape --device cuda --dtype bfloat16 --seats $seats \
      --num-requests 128 --skip 30 --steps 10 --json $OUT/profile-$shape-$seats.json 2>&1 | grep -v Warning | tail -14
  done
  rm -rf /tmp/$shape
done
