#!/usr/bin/env bash
# The lowest supported versions, checked by hand (not in CI: PyPI's torch 2.11 for Linux is the CUDA
# build, about 1.7 GB to download with its NVIDIA libraries). It builds what the GPU image we target
# has (Python 3.12, torch 2.11, transformers 5.17, accelerate 1.15, safetensors 0.8), installs this
# checkout into it as a user would, checks that torch stayed, and runs the CPU quick start and a
# few parity tests. Usage: bash .ci/lowest-versions.sh [WORKDIR]   (needs python3.12 and internet)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-/tmp/lowest-versions}"
mkdir -p "$work"
python3.12 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q torch==2.11.0
printf 'torch==2.11.0\ntransformers==5.17.0\naccelerate==1.15.0\nsafetensors==0.8.0\n' > "$work/site-pins.txt"
probe='import torch; print(torch.__version__, torch.__file__)'
before="$("$py" -c "$probe" 2>/dev/null)"
"$py" -m pip install -q -c "$work/site-pins.txt" -e "$repo[test]"
after="$("$py" -c "$probe" 2>/dev/null)"
echo "torch before: $before"; echo "torch after:  $after"
[ "$before" = "$after" ] || { echo "FAIL: installing the project changed torch" >&2; exit 1; }
mkdir -p "$work/quickstart" && (cd "$work/quickstart" && env -u PYTHONPATH OMP_NUM_THREADS=1 "$work/venv/bin/toolkit" quickstart)
cd "$repo" && env -u PYTHONPATH "$py" -m pytest -q -p no:cacheprovider tests/test_convert_parity.py \
    tests/test_convert_roundtrip.py tests/test_lora.py
