#!/usr/bin/env bash
# The prefix-reuse benchmark against two live SGLang servers: `sgl-kvmap bench --live`, with the
# environment a live server needs on the machine this runs on.
#
#   bash benchmarks/bench_live.sh [sgl-kvmap bench options, e.g. --policy alternate --out DIR]
#
# Every replay starts both servers from the lines `sgl-kvmap sglang-args` prints for the pair
# (page size 64, SGLang's own prefetch threshold and policy, the prefetch deadline measured
# here), replays the trace through HTTP and stops them (sgl_kvmap/bench/live_run.py). Without a
# GPU the servers run SGLang's CPU engine in this project's CPU test environment: the stand-in
# sgl_kernel and the two HiCache fixes of scripts/sglang_cpu (set up by scripts/setup_cpu.sh),
# and a host-memory reserve a 24 GiB machine can meet (SGLang's default keeps 10 GiB free).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export PYTHONPATH="$PWD/scripts/sglang_cpu${PYTHONPATH:+:$PYTHONPATH}"
  export KVMAP_HICACHE_RESERVE_BYTES="${KVMAP_HICACHE_RESERVE_BYTES:-$((2 * 1024 ** 3))}"
fi
exec sgl-kvmap bench --live "$@"
