#!/usr/bin/env bash
# Install sgl-kvmap (editable, with test tools) and SGLang 0.5.23 into the current Python on a
# CPU-only machine. SGLang's own pins pull CUDA wheels; here torch 2.14.1 / torchvision 0.29.1
# (its pin, CUDA builds that run on CPU) come from the machine's local package index, SGLang
# itself is installed without its GPU dependencies, and only the pure-Python packages its
# KV-cache layer imports are added, then those a live `sglang.launch_server` on this CPU needs
# (the lines `sgl-kvmap sglang-args --device cpu` prints put sgl_kvmap/sglang/cpu_engine/ on
# PYTHONPATH, the CPU stand-ins of sgl_kernel and of two HiCache lines: nothing here changes
# SGLang's files). On a GPU machine use
# `pip install -e '.[sglang]'` instead.
# Last, olah (the local test Hub's mirror server) goes into .venv-olah, a virtual environment of
# its own.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q torch==2.14.1 torchvision==0.29.1 nvidia-nvjitlink==13.4.92
pip install -q --no-deps sglang==0.5.23
pip install -q torch==2.14.1 orjson psutil pybase64 requests packaging starlette msgspec pydantic \
  pyzmq tqdm ipython aiohttp dill einops gguf partial-json-parser transformers==5.19.0 \
  tokenizers==0.23.2 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 \
  openai==2.8.0 setproctitle uvicorn fastapi
# What a live server imports beyond the KV-cache layer (SGLang's own pins where it has one).
pip install -q torch==2.14.1 uvloop==0.23.0 python-multipart==0.0.34 prometheus-client==0.26.0 \
  interegular==0.3.3 xxhash==4.1.0 zstandard==0.25.0 tiktoken==0.14.0 blobfile==3.0.0 \
  watchfiles==1.3.0 scipy==1.17.1 pillow==13.0.0 regex==2026.5.9 distro==1.9.0 \
  nvidia-ml-py==13.615.71 jsonschema==4.26.0 xgrammar==0.2.7 soundfile==0.13.1
# accelerate: fit --device-map (big-model inference: sharded and offloaded loading)
pip install -q torch==2.14.1 transformers==5.19.0 accelerate==1.16.0 -e '.[dev,bench]'
# The test Hub (tests/hub_servers.py) runs olah, a Hugging Face mirror server, from its own virtual
# environment, so olah's web-framework pins never touch this one; without it the Hub tests skip.
if ! .venv-olah/bin/python -c "import olah.server" 2>/dev/null; then
  { python -m venv --clear .venv-olah && .venv-olah/bin/pip install -q olah==0.5.4; } ||
    echo "olah could not be installed: the Hub tests (tests/test_hub_servers.py) will skip" >&2
fi
# Mooncake, SGLang's distributed HiCache store (tests/test_sglang_mooncake.py runs a real master and
# clients on 127.0.0.1): its CPU wheel, pinned by hash, plus the three Debian libraries its binaries
# link and these machines lack, unpacked (no root, nothing system-wide) into .mooncake/lib, where
# sgl_kvmap.sglang.mooncake finds them. Without them only the Mooncake tests skip.
bash scripts/setup_mooncake.sh ||
  echo "Mooncake could not be installed: the Mooncake tests (tests/test_sglang_mooncake.py) will skip" >&2
python -c "import sglang.srt.managers.scheduler, sgl_kvmap; print('sgl-kvmap ready')"
