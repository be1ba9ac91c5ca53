#!/usr/bin/env bash
# The whole test suite: Rust unit and integration tests (real models; SQLite and the
# PostgreSQL at 127.0.0.1:5432), then end-to-end tests with real SDK clients.
set -euo pipefail
cd "$(dirname "$0")"
# One build of every target, so every later step (the model fetch, the tests, the e2e
# binary) sees the same feature set: building the binary alone first would resolve features
# without the dev-dependencies and compile most dependencies twice.
cargo build --workspace --all-targets
"${CARGO_TARGET_DIR:-target}/debug/bulkhead" models fetch
cargo test --workspace --all-targets
./e2e/run.sh
