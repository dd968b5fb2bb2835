#!/usr/bin/env bash
# Everything sgl-kvmap checks on a GPU, in one run (one H200: about 5 minutes):
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# 1. the kernel tests on CUDA: translate_pages' compiled Triton body against the torch
#    reference, every mapper family, dtype and RoPE layout (tests/test_kernels.py);
# 2. benchmarks/serving_gpu_check.py: the SGLang extension's translation on the GPU (host
#    pages in SGLang's four host layouts, one TP rank's heads, straight between device pools)
#    against the torch reference, timed against the map's bare matrix products
#    -> OUT_DIR/serving_gpu_check.json (no SGLang, no weights: random maps in the pair's shapes);
# 3. benchmarks/kernel_speed.py: Triton vs torch bodies vs the target's re-prefill on the real
#    pair's geometry, both directions, 512 / 2,048 / 8,192 tokens -> OUT_DIR/kernel_speed.json,
#    with what a hand-off repair adds on the GPU: the source's draft, serial vs parallel
#    (Repair.sweeps), and the target's hand-off forward over 0 / 112 / 240 anchors + tail.
# Needs torch, triton, transformers, safetensors, click, tqdm, pytest and jsonschema (a CUDA image of
# PyTorch has all but jsonschema: install it, or carry its wheels and `pip install --target`);
# sgl-kvmap runs from this checkout, nothing is installed. The SGLang end-to-end benchmark is
# separate: benchmarks/bench_live.sh (it needs the models and SGLang).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py
python3 benchmarks/serving_gpu_check.py --out "$out"
python3 benchmarks/kernel_speed.py --out "$out"
