#!/usr/bin/env bash
# Check selfspec's speculators export / import against the real speculators library.
#
#   scripts/interop_speculators.sh [--json RESULTS.json]
#
# speculators pins torch and transformers versions other than .venv's, so it never goes into
# .venv. It goes into .venv-interop (git-ignored), made from the same Python, installed with
# --no-deps together with the few modules `import speculators` needs that .venv lacks, and
# transformers 5.19.0, the newest speculators 0.9.0 declares (the check passes with .venv's 5.25
# too, same numbers). A .pth file adds .venv's site-packages after the env's own, so torch,
# pydantic, safetensors, tokenizers and selfspec (editable) are .venv's very copies. Setup runs
# once (again when the pins change; it needs PyPI); then scripts/interop_speculators_check.py
# runs in the env.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MAIN_VENV="$ROOT/.venv"
ENV="$ROOT/.venv-interop"
SPECULATORS="speculators==0.9.0"
# What `import speculators` (its Eagle3 model, config and loading code) needs beyond .venv.
EXTRA=("transformers==5.19.0" "openai==3.63.0" "sniffio==1.3.1" "hs-connectors==0.9.0"
    "loguru==0.7.3")
PINS="$SPECULATORS ${EXTRA[*]}"
READY="$ENV/selfspec-interop-pins.txt"

if [[ ! -x "$MAIN_VENV/bin/python" ]]; then
    echo "no $MAIN_VENV: run scripts/setup.sh first" >&2
    exit 2
fi

if [[ "$(cat "$READY" 2>/dev/null)" != "$PINS" ]]; then
    rm -rf "$ENV"
    base_python="$("$MAIN_VENV/bin/python" -c 'import sys; print(sys._base_executable)')"
    echo "setting up $ENV from $base_python" >&2
    "$base_python" -m venv "$ENV"
    site="$("$ENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    main_site="$("$MAIN_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # addsitedir (not a bare path) so .venv's own .pth files, selfspec's editable finder among
    # them, are processed too.
    echo "import site; site.addsitedir('$main_site')" > "$site/zz-selfspec-main-venv.pth"
    "$ENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
        "$SPECULATORS" "${EXTRA[@]}"
    echo "$PINS" > "$READY"
fi

cd "$ROOT"
exec "$ENV/bin/python" scripts/interop_speculators_check.py "$@"
