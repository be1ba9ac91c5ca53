#!/usr/bin/env bash
# The whole test suite: Rust unit and integration tests (real models; SQLite and the
# PostgreSQL at 127.0.0.1:5432), then end-to-end tests with real SDK clients, schemathesis
# over the OpenAPI document and the admin UI in headless Chromium (installed when missing).
set -euo pipefail
cd "$(dirname "$0")"
# The admin UI's browser tests drive Debian's Chromium (never a browser a tool downloads).
if [ ! -x "${CHROMIUM_PATH:-/usr/bin/chromium}" ]; then
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq chromium >/dev/null
fi
# One build of every target, so every later step (the model fetch, the tests, the e2e
# binary) sees the same feature set: building the binary alone first would resolve features
# without the dev-dependencies and compile most dependencies twice.
cargo build --workspace --all-targets
"${CARGO_TARGET_DIR:-target}/debug/bulkhead" models fetch
cargo test --workspace --all-targets
./e2e/run.sh
