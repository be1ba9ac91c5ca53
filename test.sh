#!/usr/bin/env bash
# The whole test suite. Fetches the bundled models (idempotent), then runs every test.
set -euo pipefail
cd "$(dirname "$0")"
cargo run --quiet --bin bulkhead -- models fetch
cargo test --workspace --all-targets
