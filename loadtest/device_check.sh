#!/usr/bin/env bash
# The GPU checks as one run on a lent H200 (the device tool gives a session about 15 minutes of
# device time, a few of them to start the machine): the kernels, CUDA graphs and overlapped steps
# against their references, then the engine benchmark for the llama-8b and llama-1b shapes with
# random bf16 weights (each Triton kernel against its reference at the model's shapes, decode
# against the bandwidth bound with graphs on and off, skewed lengths). Its image has torch, triton
# and transformers; what it lacks travels as wheels. Here, once: `make device-wheels`. Then the
# device tool's run, carrying .whl:
#     bash loadtest/device_check.sh
# Results land in $OUT (the tool brings them back). Each part has its own time limit, so one that
# runs long leaves the rest their turn; the benchmark saves its JSON after every scenario.
set -uo pipefail
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# The project's conftest at tests/ needs the services' network clients, which the image lacks:
# the kernel and engine tests need only tests/unit's.
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
export DRIVETRAIN_CACHE="$PWD/.whl"  # SmolLM2's tokenizer, which `make device-wheels` put there
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

timeout "${TESTS_S:-100}" python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/unit -k "not rejects" \
    tests/unit/test_kernels.py tests/unit/test_fused_kernels.py tests/unit/test_engine_overlap.py \
    tests/unit/test_engine.py::test_cuda_graph_replay_equals_eager_and_dense 2>&1 | tee "$OUT/gpu_tests.log" | tail -25

cd loadtest
timeout "${LLAMA_8B_S:-240}" python3 bench_engine.py --model llama-8b --device cuda --quick \
    --scenarios "${LLAMA_8B_SCENARIOS:-decode,kernels,skewed}" --json "$OUT/engine_gpu_llama-8b.json" 2>&1 \
    | tee "$OUT/bench_8b.log" | grep -v "^  {" | tail -40
timeout "${LLAMA_1B_S:-110}" python3 bench_engine.py --model llama-1b --device cuda --quick \
    --scenarios "${LLAMA_1B_SCENARIOS:-decode,kernels}" --json "$OUT/engine_gpu_llama-1b.json" 2>&1 \
    | tee "$OUT/bench_1b.log" | grep -v "^  {" | tail -30
