#!/usr/bin/env bash
# Creates .venv and installs the project with its test dependencies. Idempotent and quick when done.
# CPU torch where there is no GPU (the local torch==2.13.0 wheel); the normal CUDA build on GPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=".venv/.installed-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
[ -f "$stamp" ] && exit 0
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch 2.13.0 ($(command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && echo CUDA build || echo CPU build))"
  $PIP install -q "torch==2.13.0"
fi
echo "[setup] installing the project and its test dependencies"
$PIP install -q -e ".[dev]"
rm -f .venv/.installed-*
touch "$stamp"
echo "[setup] done"
