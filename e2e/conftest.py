"""Starts one `bulkhead serve` (the real binary, embedded node, SQLite in a temp dir) for the
session, and creates a tenant with a token through the admin API."""
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

ADMIN = "e2e-admin-token"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(base, method, path, token, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="session")
def server():
    binary = os.environ["BULKHEAD_BIN"]
    port = _free_port()
    data = tempfile.mkdtemp(prefix="bulkhead-e2e-")
    config = os.path.join(data, "serve.toml")
    with open(config, "w") as f:
        # A small served window keeps the KV pool small (512 x 2.0 tokens).
        f.write('[[node.text_models]]\nname = "@cf/huggingfacetb/smollm2-135m-instruct"\ncontext_window = 512\n'
                '[[node.embedding_models]]\nname = "@cf/sentence-transformers/all-minilm-l6-v2"\n')
    env = dict(os.environ, BULKHEAD_ADMIN_TOKEN=ADMIN, BULKHEAD_DATA=data,
               BULKHEAD_LISTEN=f"127.0.0.1:{port}")
    log = open(os.path.join(data, "serve.log"), "w")
    proc = subprocess.Popen([binary, "serve", "--config", config], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            break
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError("bulkhead serve did not come up: " + open(log.name).read()[-2000:])
            time.sleep(0.3)
    tenant = _call(base, "POST", "/admin/v1/tenants", ADMIN, {"name": "sdk-tests"})["result"]
    token = _call(base, "POST", f"/admin/v1/tenants/{tenant['id']}/tokens", ADMIN, {"name": "sdk"})["result"]
    yield {"base": base, "account": tenant["id"], "token": token["token"], "admin": ADMIN,
           "call": lambda m, p, b=None: _call(base, m, p, ADMIN, b)}
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
