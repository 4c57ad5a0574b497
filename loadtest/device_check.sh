#!/usr/bin/env bash
# The GPU checks as one run on a lent H200 (the device tool gives a session about 15 minutes of
# device time, a few of them to start the machine): the kernels, CUDA graphs and overlapped steps
# against their references, then the engine benchmark for the llama-1b and llama-8b shapes with
# random bf16 weights. Its image has torch, triton and transformers; what it lacks travels as
# wheels. Here, once: `make device-wheels`. Then the device tool's run, carrying .whl:
#     bash loadtest/device_check.sh
# Results land in $OUT (the tool brings them back). Each part has its own time limit, so one that
# runs long leaves the rest their turn.
set -uo pipefail
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

timeout 180 python3 -m pytest -q -p no:cacheprovider tests/unit/test_kernels.py tests/unit/test_engine_overlap.py \
    tests/unit/test_engine.py::test_cuda_graph_replay_equals_eager_and_dense 2>&1 | tee "$OUT/gpu_tests.log" | tail -15

cd loadtest
timeout 150 python3 bench_engine.py --model llama-1b --device cuda --quick --scenarios decode,overhead \
    --json "$OUT/engine_gpu_llama-1b.json" 2>&1 | tail -25
timeout 330 python3 bench_engine.py --model llama-8b --device cuda --quick --baseline hf --scenarios skewed,decode \
    --json "$OUT/engine_gpu_llama-8b.json" 2>&1 | tail -25
