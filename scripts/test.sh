#!/usr/bin/env bash
# Run the test suite; extra arguments go to pytest (e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q tests "$@"
