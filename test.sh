#!/usr/bin/env bash
# The whole test suite: Rust unit and integration tests (real models; SQLite and the
# PostgreSQL at 127.0.0.1:5432), then end-to-end tests with real SDK clients.
set -euo pipefail
cd "$(dirname "$0")"
cargo run --quiet --bin bulkhead -- models fetch
cargo test --workspace --all-targets
./e2e/run.sh
