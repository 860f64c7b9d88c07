#!/usr/bin/env bash
# The main job: sets up .venv if needed, makes the embedded tiny DeepSeek-V3-style checkpoint if
# missing, serves it expert-parallel over 2 ranks (torchrun), sends a few requests with the openai
# client, prints the answers with tokens/s and writes an expert-load report to out/report.
# `bash scripts/run.sh --offline` instead generates offline in one process (`moe generate`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = "--offline" ]; then
  shift
  exec .venv/bin/moe -v generate "$@"
fi
exec .venv/bin/python scripts/demo.py
