#!/usr/bin/env bash
# Everything sgl-kvmap checks on a GPU, in one run (one H200: steps 1-3 took about 5 minutes):
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
#    (Repair.sweeps), and the target's hand-off forward over 0 / 112 / 240 anchors + tail;
# 4. the same at the paper's scale (issue 33): random weights shaped like Qwen3-14B -> 32B,
#    32,768 tokens, the Triton and torch translation against the 32B's prefill (SDPA) and the
#    map's matrix products' floor, bf16 -> OUT_DIR/paper_scale/kernel_speed.json (about 95 GB of
#    GPU memory at its peak: an H200; transformers with Qwen3, 4.51 or later).
# Needs torch, triton, transformers, safetensors, click, tqdm, pytest and jsonschema (a CUDA image of
# PyTorch has all but jsonschema: install it, or carry its wheels and `pip install --target`);
# sgl-kvmap runs from this checkout, nothing is installed. The SGLang end-to-end benchmark is
# separate: `sgl-kvmap bench --live` (it needs the models and SGLang).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py
python3 benchmarks/serving_gpu_check.py --out "$out"
python3 benchmarks/kernel_speed.py --out "$out"
python3 benchmarks/kernel_speed.py --pair qwen3-14b qwen3-32b --one-way --tokens 32768 --repeats 3 \
  --no-repairs --out "$out/paper_scale"
