#!/usr/bin/env bash
# GPU end-to-end check of the SGLang extension (one H200, under 8 minutes once models are cached):
#   bash benchmarks/sglang_e2e.sh SMALL_MODEL LARGE_MODEL PACK_SMALL_TO_LARGE [PACK_LARGE_TO_SMALL]
# Installs sgl-kvmap beside SGLang 0.5.23 (with its GPU dependencies), then runs
# benchmarks/sglang_e2e.py: two servers, a session moving from SMALL to LARGE, with and without
# sgl-kvmap; TTFT, prefill tokens computed and answer agreement -> benchmarks/results/sglang_e2e.json.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then sed -n 2,6p "$0"; exit 2; fi
small=$1 large=$2; shift 2
python -c "import sglang" 2>/dev/null || pip install -q 'sglang==0.5.23'
pip install -q --no-deps -e .
packs=(); for p in "$@"; do packs+=(--pack "$p"); done
timeout 480 python benchmarks/sglang_e2e.py "$small" "$large" "${packs[@]}"
