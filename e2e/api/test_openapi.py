"""Schemathesis (pinned, from PyPI) over Bulkhead's own /openapi.json, every check on: no
server errors, status codes, content types, headers and bodies as documented, schema-valid
requests accepted and schema-invalid ones refused, authentication never ignored, undocumented
methods answered 405. Exceptions, each with its reason, are in schemathesis.toml and
hooks.py. The run needs 0 failures."""
import os
import subprocess
import sys

import pytest

from conftest import new_tenant, start_server, stop_server

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMATHESIS = os.path.join(os.path.dirname(sys.executable), "schemathesis")


@pytest.fixture(scope="module")
def api_server():
    # Its own server: schemathesis creates tenants, tokens, models and workers as it goes.
    # A 128-token window keeps each generation short; limits high enough never to bind.
    proc, base, _ = start_server(
        "[limits]\ntext_generation_per_min = 1000000\nembeddings_per_min = 1000000\n"
        '[[node.text_models]]\nname = "@cf/huggingfacetb/smollm2-135m-instruct"\ncontext_window = 128\n'
        '[[node.embedding_models]]\nname = "@cf/sentence-transformers/all-minilm-l6-v2"\n',
        prefix="bulkhead-openapi-")
    yield base
    stop_server(proc)


def _schemathesis(base, token, account, wasm, tag_args):
    env = dict(os.environ, BULKHEAD_E2E_ACCOUNT=account, BULKHEAD_E2E_WORKER_WASM=wasm,
               NO_COLOR="1")
    cmd = [SCHEMATHESIS, "--config-file", os.path.join(HERE, "schemathesis.toml"), "run",
           f"{base}/openapi.json", "-H", f"Authorization: Bearer {token}",
           # Every check runs by default; `--checks all` here would also override the
           # per-operation exceptions of the config file.
           "--phases", "examples,coverage,fuzzing,stateful",
           # A generation health check, not a server check: negative cases are rare to
           # generate for operations whose only parameters are unconstrained strings.
           "--suppress-health-check", "filter_too_much", *tag_args]
    done = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]


def test_the_tenant_operations_conform(api_server, worker_wasm):
    account, token = new_tenant(api_server, "schemathesis")
    _schemathesis(api_server, token, account, worker_wasm["path"], ["--exclude-tag", "admin"])


def test_the_admin_operations_conform(api_server, worker_wasm):
    account, _ = new_tenant(api_server, "schemathesis-admin")
    _schemathesis(api_server, "e2e-admin-token", account, worker_wasm["path"],
                  ["--include-tag", "admin", "--max-examples", "50"])
