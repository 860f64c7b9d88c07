#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite (slow multi-process tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -ra "$@"
