#!/usr/bin/env bash
# The prefix-reuse benchmark (`sgl-kvmap bench`, issue 24) against two live SGLang servers on one GPU.
#
#   bash benchmarks/bench_live.sh SMALL_MODEL_DIR LARGE_MODEL_DIR PACK_SMALL_TO_LARGE [PACK_LARGE_TO_SMALL] \
#       -- --workload workload.json --policy POLICY [--policy ...] [more bench_live.py options]
#
# NOT RUN YET. No machine this project has had has a GPU with SGLang 0.5.23 and the models on it
# (the lent GPU machine cannot carry SGLang's wheels). Everything below the servers (the replay
# client, its records, the launch commands) is tested on CPU against stand-in servers
# (tests/test_bench_live.py); the servers themselves have never been started by it.
#
# Requirements, all on the machine that runs this:
#   - an NVIDIA GPU with room for both models and their KV pools (--mem-fraction-static: 0.3 for
#     SMALL, 0.45 for LARGE by default), and SGLang 0.5.23 installed with its GPU dependencies
#     (`pip install 'sglang==0.5.23'`); this script installs nothing;
#   - sgl-kvmap installed in the same environment (`pip install -e .`): the servers import
#     sgl_kvmap.sglang.storage;
#   - the pair's models in Hugging Face format on local disk (SMALL_MODEL_DIR, LARGE_MODEL_DIR);
#   - a pack for the pair, a folder (`sgl-kvmap fit SMALL LARGE --out DIR`, or `sgl-kvmap resolve
#     SMALL LARGE` and its printed path); one per direction to translate both ways;
#   - room under /dev/shm (or --store-path) for the shared HiCache file store.
#
# What it does: for each mode (reprefill, translated, tail) and each policy it starts both
# servers (reprefill: HiCache + SGLang's file store, no sgl-kvmap; translated/tail: the
# commands of `sgl-kvmap sglang-args`, with tail_pages 0 / the default tail), waits for
# /health, replays the trace one request at a time, stops them and deletes the store. Writes
# records.jsonl, the servers' logs and the report to --out (benchmarks/results/bench_live).
# `-- --dry-run` prints the servers' commands only. Supersedes sglang_e2e.sh/.py (removed).
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n 4,5p "$0"; exit 2; }
[ $# -ge 3 ] || usage
small=$1 large=$2; shift 2
packs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do packs+=(--pack "$1"); shift; done
[ $# -gt 0 ] && shift  # the --
command -v nvidia-smi >/dev/null || { echo "no NVIDIA GPU here (nvidia-smi)"; exit 1; }
python - <<'PY' || exit 1
import sys
try:
    import sglang
except ImportError:
    sys.exit("SGLang is not installed: pip install 'sglang==0.5.23' (with its GPU dependencies)")
if sglang.__version__ != "0.5.23":
    sys.exit(f"sgl-kvmap is written for SGLang 0.5.23, this is {sglang.__version__}")
import sgl_kvmap.sglang.storage  # the servers import it
PY
python benchmarks/bench_live.py "$small" "$large" "${packs[@]}" "$@"
