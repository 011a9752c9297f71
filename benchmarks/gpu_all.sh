#!/usr/bin/env bash
# Everything fsdp_lab checks on a CUDA GPU, in one go, from the repository root:
#
#     bash benchmarks/gpu_all.sh [LOG_DIR]         # default LOG_DIR: /tmp/fsdp_lab_gpu
#
# 1. the GPU-marked tests (NCCL, CUDA allocator stats and snapshots, CUDA-event timelines);
# 2. the timing-sensitive benchmarks alone: the MemoryTracker's cost, NF4 against torchao;
# 3. the test suite (without the browser and notebook-kernel tests) in the background, at a
#    lower priority, beside the other benchmarks on a world of 1 (one GPU: NCCL) and the
#    QLoRA 7B peak measured on the GPU.
# Each step has its own time limit, so one that hangs or fails leaves the others their time;
# ONLY="name name ..." runs only the steps named (test_suite is a name too).
# Results land in benchmarks/results/*_<gpu>.json (run `python benchmarks/report.py` after);
# each step's output in LOG_DIR/<step>.log, and a line per step in LOG_DIR/summary.log.
set -u
cd "$(dirname "$0")/.."
LOG_DIR=${1:-/tmp/fsdp_lab_gpu}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log output and exit code
    local name=$1 limit=$2 start rc
    shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    start=$(date +%s)
    timeout -s INT -k 15 "$limit" "$@" > "$LOG_DIR/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(( $(date +%s) - start ))s" | tee -a "$LOG_DIR/summary.log"
}

step environment 60 "$PY" -c "
import torch, torch.distributed as dist
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())
print(torch.cuda.get_device_name(0), 'nccl', dist.is_nccl_available() and torch.cuda.nccl.version())
import fsdp_lab; print('fsdp_lab from', fsdp_lab.__file__)
# the host CPU: the suite's CPU ranks compute bf16 with its kernels (AMX where it has it)
info = open('/proc/cpuinfo').read() if __import__('os').path.exists('/proc/cpuinfo') else ''
model = next((l.split(':', 1)[1].strip() for l in info.splitlines() if l.startswith('model name')), 'unknown')
flags = set(next((l.split(':', 1)[1].split() for l in info.splitlines() if l.startswith('flags')), []))
print('host cpu', model, '| bf16 isa:', sorted(flags & {'amx_bf16', 'amx_tile', 'avx512_bf16'}) or 'none')"

# pyproject's addopts name nbval's options; this run collects tests only, so it drops them.
# PYTEST_EXTRA: more pytest arguments (e.g. --ignore-glob='tests/test_workshop*' where the lab
# extras, nbformat and nbclient, are not installed).
# --continue-on-collection-errors: a module that imports a missing optional package (ipywidgets,
# nbformat) must not keep the gpu tests of the others from running.
TESTS=("$PY" -m pytest -o addopts= -p no:cacheprovider --continue-on-collection-errors
       --ignore=tests/browser --ignore=tests/test_lab_kernels.py ${PYTEST_EXTRA:-})
# the GPU-marked tests, and those that skip themselves without an accelerator (pinned memory)
step gpu_tests 180 "${TESTS[@]}" tests -m gpu -rA --tb=short
step accelerator_tests 120 "${TESTS[@]}" tests/test_nf4.py -k pin_memory -rA --tb=short

# the first run builds fsdp_lab/memory/allocation_log.cpp (about a minute; needs g++ and ninja)
step memory_tracker 200 "$PY" benchmarks/memory_tracker.py
# the same step with 32x the tokens: ops as many, each bigger (the tracker's cost is per op)
step memory_tracker_large 120 "$PY" benchmarks/memory_tracker.py --batch-size 256 --seq-len 128 \
    --out benchmarks/results/memory_tracker_cuda_batch256.json
# a step where the GPU computes rather than waits for its host: four blocks of Llama 2 7B
# (1.07e9 parameters, about 25 GB with AdamW's state), 1,024 tokens; the two above are host-bound
step memory_tracker_7b_blocks 300 "$PY" benchmarks/memory_tracker.py --config llama2-7b --n-layers 4 \
    --batch-size 2 --seq-len 512 --steps 10 --out benchmarks/results/memory_tracker_cuda_llama2-7b_4_layers.json
step nf4 90 "$PY" benchmarks/nf4.py --device cuda

suite=
if [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" test_suite "* ]]; then
    workers=()  # pytest-xdist, where installed, spreads the suite over TEST_WORKERS processes
    "$PY" -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-6}")
    "${TESTS[@]}" tests -m "not gpu" -q -rfE --tb=short "${workers[@]}" \
        > "$LOG_DIR/test_suite.log" 2>&1 &
    suite=$!
fi

step qlora_7b 240 "$PY" benchmarks/qlora_7b.py --device cuda
step fsdp2_vs_torch 120 "$PY" benchmarks/fsdp2_vs_torch.py --world-size 1
step fsdp1_vs_fsdp2 120 "$PY" benchmarks/fsdp1_vs_fsdp2.py --world-size 1
step launch_and_collectives 150 "$PY" benchmarks/launch_and_collectives.py --world-size 1 --rounds 3 --pairs 60 --repeats 3
step automicrobatch 120 "$PY" benchmarks/automicrobatch.py --world-size 1
step fsdp1_flat_grad 90 "$PY" benchmarks/fsdp1_flat_grad.py --world-size 1
step estimate_vs_measured 120 "$PY" benchmarks/estimate_vs_measured.py
step nf4_compile 180 "$PY" benchmarks/nf4_compile.py --device cuda

# The suite gets what is left of SUITE_SECONDS (default 900) after the benchmarks.
if [ -n "$suite" ]; then
    deadline=${SUITE_SECONDS:-900}
    while kill -0 "$suite" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 2; done
    kill -INT "$suite" 2>/dev/null && sleep 10
    wait "$suite"
    echo "test_suite rc=$? ${SECONDS}s since start" | tee -a "$LOG_DIR/summary.log"
fi
