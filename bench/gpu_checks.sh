#!/usr/bin/env bash
# The GPU checks that only a GPU host can run (the GPU issue), in order of value, each a short section
# that writes its table under $OUT (default ./gpu-results). Run from the repository root on a CUDA host
# with the project installed (README) or with torch, transformers and the project on PYTHONPATH:
#
#   bench/gpu_checks.sh [real|peers|exactness|stages|all]     (default: all; about 22 minutes on an H100)
#
# real       GPT-2 124M and a Llama-style 1B decoder (bf16 autocast, sequence 1024) at the largest batch eager
#            fits and at twice it: eager, per-block and torchtitan-style checkpointing, inductor with
#            activation_memory_budget 0.5, dtr and hierarchical plans (bench/real_size.py; all of it takes about
#            25 minutes, so it stops at 9 and lists what it left out; $REAL_ARGS adds options: the next run
#            should take REAL_ARGS="--batch 56 --batches twice --models gpt2-124m", then the Llama, as
#            docs/measurements/peers-gpu.md says)
# peers      the Llama decoder, ResNet-50 and MobileNet-V2 of bench/peers.py against inductor and
#            inductor+cudagraphs (torch.compile's reduce-overhead mode), plans replayed as CUDA graphs
# exactness  the CUDA tests of tests/runtime (conftest's CUDA list): capture's rewrites checked on the device,
#            dropout, CUDA graphs, variants
# stages     the default pipeline.toml's stages on the GPU without Prefect (trace, profile, solve, validate)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
what=${1:-all}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
python=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
"$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device.txt"

if [ "$what" = real ] || [ "$what" = all ]; then
    timeout 600 "$python" -m bench.real_size --device cuda --fractions 0.95 0.5 --deadline 540 --reserve-s 45 ${REAL_ARGS:-} \
        --json "$out/real_size.json" 2>&1 | tee "$out/real_size.txt"
fi
if [ "$what" = peers ] || [ "$what" = all ]; then
    timeout 420 "$python" bench/peers.py --device cuda --compile-backend inductor inductor-cudagraphs --cuda-graph \
        --solvers dtr --rounds 10 --workloads llama resnet50 mobilenet_v2 2>&1 | tee "$out/peers.txt"
fi
if [ "$what" = exactness ] || [ "$what" = all ]; then
    MEMPLAN_TEST_DEVICE=cuda timeout 300 "$python" -m pytest -q -p no:xdist -p no:cacheprovider \
        tests/runtime/test_rewrite_check.py tests/runtime/test_cuda_graph.py tests/runtime/test_capture.py \
        2>&1 | tee "$out/exactness.txt"
fi
if [ "$what" = stages ] || [ "$what" = all ]; then
    timeout 300 "$python" bench/stages_on_device.py pipeline.toml --json "$out/stages.json" 2>&1 | tee "$out/stages.txt"
fi
