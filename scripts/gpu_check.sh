#!/usr/bin/env bash
# The GPU proof kit on a bare CUDA host (torch + triton only, no install, no network):
# runs the benchmark/gpu_check package from this tree. Usage: gpu_check.sh [--out DIR] [--plan] [--record] ...
# PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
export PYTHONPATH="$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m benchmark.gpu_check "$@"
