#!/usr/bin/env bash
# One run on a lent GPU machine (docs/development.md, "The GPU check"): the engine's tests on CUDA
# (fidelity on every backend, compiled and eager, with and without CUDA graphs; the fast backend
# against the reference one), then offline throughput (continuous vs static, CUDA graphs on, async
# scheduling as the engine's CUDA default; optionally a step profile, and in the SmolLM2 shape runs
# without graphs and without async scheduling) on random-weight models in the default model's
# shape and in an 8B shape. The machine has torch/CUDA but no network and no model files:
# .whl carries the Python packages its image lacks or has in other versions, .gpu/smollm2-tokenizer
# the tokenizer (tests/gpu/fetch_wheels.sh fills both). Results go to $OUT. Stages (default: tests
# quant small large; in a 15-minute lease, two calls: "tests quant small" (about 8 minutes at most), then
# "large" (about 5)): tests, quant (compressed-tensors W4A16 layers on tinygemm), small (SmolLM2 shape), large (8B), sync (with small: the SmolLM2 shape
# again with --no-async-scheduling), spec (speculative decoding's side-by-side bench; random weights
# draft little, so it shows the step cost by rows and the planner backing off), lora (4 random rank-16
# adapters mixed with base requests against the base model alone, 32 and 64 seats). A profile, no-graphs or sync limit of 0 skips that run.
# On 2026-12-04 the first compile made the SmolLM2-shape bench take 129 s, the 8B one 165 s.
set -uo pipefail
STAGES=${1:-"tests quant small large"}
stage() { [[ " $STAGES " == *" $1 "* ]]; }  # a whole word of STAGES ("async" is not "sync")
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export CARPOOL_SMOLLM2_PATH=$PWD/.gpu/smollm2-tokenizer CARPOOL_TEST_DEVICE=cuda
stamp() { echo "[$(date +%T)] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
python3 -c "import replica.attention.cuda as a; print('flashinfer', a.flashinfer_available(), 'varlen_attn parameters', sorted(a.varlen_parameters() or []))"

if stage tests; then
  stamp "engine tests on CUDA"
  # SIGINT at the limit: pytest then still prints the failures so far. Test files run in
  # parallel (one process per file at a time) on the machine's cores, sharing the GPU.
  timeout -s INT -k 20 ${TESTS_TIMEOUT:-200} python3 -m pytest -q -rfE -p no:cacheprovider -o addopts="" --maxfail=10 \
    -n ${TEST_WORKERS:-6} --dist loadfile \
    tests/engine/test_attention_backends.py tests/engine/test_fidelity.py tests/engine/test_model_support.py \
    tests/engine/test_engine_behaviour.py tests/engine/test_sampling_options.py tests/engine/test_async_engine.py \
    tests/engine/test_step_shapes.py tests/engine/test_cuda_graphs.py tests/engine/test_async_scheduling.py \
    tests/engine/test_spec_decode.py tests/engine/test_lora.py -k "not real_model and not smollm2" 2>&1 | tee $OUT/tests.log | tail -30
fi

if stage quant; then  # compressed-tensors W4A16 on torch's int4 kernel (tinygemm): each layer against the package's weights
  stamp "W4A16 layers on tinygemm (CUDA)"
  timeout ${QUANT_TIMEOUT:-120} python3 -m pytest -q -rfE -p no:cacheprovider -o addopts="" \
    tests/engine/test_quantized_compressed.py -k cuda_int4 2>&1 | tee $OUT/quant.log | tail -8
fi

bench() {  # shape bench_timeout profile_timeout [no_graphs_timeout] [sync_timeout]
  local shape=$1
  stamp "random weights in the $shape shape"
  python3 -m tests.gpu.make_random_model --tokenizer .gpu/smollm2-tokenizer --shape $shape --out /tmp/$shape --device cuda || return
  stamp "$shape, 64 seats: continuous vs static (compiled)"
  timeout $2 python3 -m cluster.bench offline --model /tmp/$shape --device cuda --dtype bfloat16 \
    --workload seed-mix --num-requests 128 --seats 64 --max-num-batched-tokens 2048 \
    --kv-cache-memory 8GiB --no-progress --json $OUT/bench-$shape-64.json 2>&1 | grep -v Warning | tail -8
  if [ "${4:-0}" != 0 ]; then
    stamp "$shape, 64 seats: continuous vs static without CUDA graphs"
    timeout $4 python3 -m cluster.bench offline --model /tmp/$shape --device cuda --dtype bfloat16 \
      --workload seed-mix --num-requests 128 --seats 64 --max-num-batched-tokens 2048 --no-cuda-graphs \
      --kv-cache-memory 8GiB --no-progress --json $OUT/bench-$shape-64-no-graphs.json 2>&1 | grep -v Warning | tail -8
  fi
  if [ "${5:-0}" != 0 ]; then
    stamp "$shape, 64 seats: continuous (synchronous, no async scheduling) vs static"
    timeout $5 python3 -m cluster.bench offline --model /tmp/$shape --device cuda --dtype bfloat16 \
      --workload seed-mix --num-requests 128 --seats 64 --max-num-batched-tokens 2048 --no-async-scheduling \
      --kv-cache-memory 8GiB --no-progress --json $OUT/bench-$shape-64-sync.json 2>&1 | grep -v Warning | tail -8
  fi
  if [ "$3" != 0 ]; then
    stamp "$shape, 64 seats: where a step's time goes"
    timeout $3 python3 -m cluster.bench profile --model /tmp/$shape --device cuda --dtype bfloat16 --seats 64 \
      --num-requests 128 --skip 30 --steps 10 --top 10 --json $OUT/profile-$shape-64.json 2>&1 | grep -v Warning | tail -26
  fi
  rm -rf /tmp/$shape
}
stage small && bench smollm2-135m ${SMALL_TIMEOUT:-200} ${PROFILE_TIMEOUT:-0} ${NO_GRAPHS_TIMEOUT:-0} \
  $(stage sync && echo ${SYNC_TIMEOUT:-130} || echo 0)
stage large && bench llama3-8b ${LARGE_TIMEOUT:-240} ${LARGE_PROFILE_TIMEOUT:-0}

if stage spec; then  # speculative decoding on CUDA: the step cost by rows (where drafting stops paying) and the planner
  python3 -m tests.gpu.make_random_model --tokenizer .gpu/smollm2-tokenizer --shape smollm2-135m --out /tmp/smollm2-135m --device cuda
  stamp "SmolLM2 shape (random weights): prompt lookup vs none, 1, 4 and 64 seats"
  timeout ${SPEC_TIMEOUT:-200} python3 -m cluster.bench spec --model /tmp/smollm2-135m --device cuda --dtype bfloat16 \
    --seats 1,4,64 --num-requests 8 --json $OUT/spec-smollm2-135m.json 2>&1 | grep -E "seats|step cost" | tail -12
fi

if stage lora; then  # multi-LoRA on CUDA: the dense slot matmuls in the compiled decoder and CUDA graphs
  [[ -d /tmp/smollm2-135m ]] || python3 -m tests.gpu.make_random_model --tokenizer .gpu/smollm2-tokenizer --shape smollm2-135m --out /tmp/smollm2-135m --device cuda
  stamp "SmolLM2 shape (random weights): 4 adapters of rank 16 + base mixed vs base only, 32 and 64 seats"
  timeout ${LORA_TIMEOUT:-200} python3 -m cluster.bench lora --model /tmp/smollm2-135m --device cuda --dtype bfloat16 \
    --seats 32,64 --num-requests 128 --json $OUT/lora-smollm2-135m.json 2>&1 | grep -E "seats|load" | tail -6
fi
stamp done
