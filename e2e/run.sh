#!/usr/bin/env bash
# End-to-end tests with real clients against the real `bulkhead` binary.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=e2e/.venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check -r e2e/requirements.txt
cargo build --quiet --bin bulkhead
export BULKHEAD_BIN="$PWD/target/debug/bulkhead"
"$venv/bin/python" -m pytest -q e2e/sdk e2e/incident
