#!/usr/bin/env bash
# The one-command GPU suite. Run it as is wherever a CUDA GPU appears (CI has none):
#
#   bash benchmarks/gpu_suite.sh
#
# 1. every `gpu`-marked test: a one-GPU fine-tune of recipes/finetune.py (NCCL, bf16, the
#    Transformer Engine layer spec when TE is installed) against the HF reference on the same GPU
#    (tests/test_gpu.py), and the multi-GPU / Slurm-GRES tests, which say why they skip on a
#    machine with fewer GPUs;
# 2. the step-time ratio of our recipe against HF + DeepSpeed at the same batch, on the GPU
#    (benchmarks/finetune_bench.py);
# 3. with 2+ GPUs, DeepSpeed's overlap_comm on/off at ZeRO-2/3 and FSDP2 beside ZeRO-3
#    (benchmarks/overlap_bench.py; on one GPU it runs at DP1, where there is nothing to overlap).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
python_has_cuda=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')
if [ "$python_has_cuda" != 1 ]; then
    echo "gpu_suite: no CUDA device visible to $PY; nothing to run" >&2
    exit 2
fi
"$PY" -m pytest -m gpu -v -rs -p no:cacheprovider tests
"$PY" benchmarks/finetune_bench.py --repeats 3 --steps 20
"$PY" benchmarks/overlap_bench.py --repeats 3 --steps 20
