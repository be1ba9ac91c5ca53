#!/usr/bin/env bash
# End-to-end tests with real clients against the real `bulkhead` binary: the official SDKs
# (pytest), the 2026 incident as separate control-plane, prefill and decode processes
# (pytest), the adversarial soak (bounded), then the admin UI: its logic (Vitest), and the UI itself in headless Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=e2e/.venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check -r e2e/requirements.txt
# Builds (and embeds) the admin UI too, installing web/node_modules on first use. All
# targets, like test.sh, so the dependencies keep one feature set and are built only once.
cargo build --quiet --workspace --all-targets
export BULKHEAD_BIN="${CARGO_TARGET_DIR:-$PWD/target}/debug/bulkhead"
"$venv/bin/python" -m pytest -q e2e/sdk e2e/incident e2e/workers e2e/api
# The adversarial soak, bounded: 2,000 requests and one cycle of faults on its own
# PostgreSQL, Redis, replicas and nodes (the full run is in docs/reliability.md).
"$venv/bin/python" e2e/soak/soak.py --requests 2000

npm_ci() { # DIR: install its locked packages when they are missing or older than the lock
  if [ ! "$1/node_modules/.package-lock.json" -nt "$1/package-lock.json" ]; then
    (cd "$1" && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error)
  fi
}
npm_ci web
(cd web && npm run --silent typecheck && npx vitest run)

if [ ! -x "${CHROMIUM_PATH:-/usr/bin/chromium}" ]; then
  echo "e2e/run.sh: ${CHROMIUM_PATH:-/usr/bin/chromium} is missing: apt-get install -y chromium" >&2
  exit 1
fi
npm_ci e2e/web
(cd e2e/web && node --test --test-concurrency=1 --test-reporter=spec)
