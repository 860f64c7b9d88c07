#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite (slow multi-process tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# -P: the checkout root stays off sys.path, so its folders never shadow PyPI packages named `kernels`, `server`...
exec .venv/bin/python -P -m pytest -q -ra "$@"
