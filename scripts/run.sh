#!/usr/bin/env bash
# The main job: sets up .venv if needed, makes the embedded tiny DeepSeek-V3-style checkpoint if
# missing, then generates from a few prompts and prints them with tokens/s.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/moe -v generate "$@"
