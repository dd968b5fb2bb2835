#!/usr/bin/env bash
# Lint, then test: ruff's linter and formatter (the checks .pre-commit-config.yaml runs), then
# pytest with any arguments given. Run it after scripts/setup_cpu.sh, as .ci/run does.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
python -m pytest "$@"
