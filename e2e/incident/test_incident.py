"""The 2026 incident as a regression suite.

The leak happened in disaggregated serving: a prompt rejected at prefill was swapped for a
one-token placeholder, handed to decode, and decode attended over other customers' stale KV
pages while the client got HTTP 200. Here the real control plane, a prefill node with a
small pool and a decode node run as separate processes; many tenants at once send prompts
longer than the prefill pool, longer than the context window, exactly at the limit, one past
it, and normal prompts that each carry a unique canary. Every oversized request must get 413
with its numbers and never a 200; every normal request must get its own canary back and
never another tenant's; decode's isolation alarm stays at zero; both pools return to full.
"""
import concurrent.futures
import json
import os
import re
import secrets
import socket
import subprocess
import tempfile
import time

import httpx
import pytest

ADMIN = "incident-admin-token"
# What the nodes' APIs accept (the control plane learns it from their heartbeats; the test
# presents it to read node metrics).
NODE_API = "e2e-incident-node-api-token-0123456789"
from conftest import TEXT_MODELS

MODEL = "@cf/huggingfacetb/smollm2-135m-instruct"
WINDOW = 512
PREFILL_POOL = 1024  # = WINDOW x the default safety factor 2.0
# One word per tenant; canaries are WORD-NNNN in a three-times repeated prompt, which the 135M
# model continues with the canary (23 of 24 tried, greedy).
CANARY_WORDS = ["KESTREL", "ORCHID", "QUARTZ", "MAPLE", "FALCON", "COBALT"]
TENANTS = len(CANARY_WORDS)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, proc, log, seconds=120):
    deadline = time.time() + seconds
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"{url} did not come up: " + open(log).read()[-3000:])
        time.sleep(0.2)


class Cluster:
    def __init__(self):
        self.binary = os.environ["BULKHEAD_BIN"]
        self.dir = tempfile.mkdtemp(prefix="bulkhead-incident-")
        self.procs = []
        # The cluster's KV transfer key, as an operator makes it; every node gets the file.
        key = subprocess.run([self.binary, "transfer-key"], capture_output=True, text=True,
                             check=True, timeout=60).stdout
        self.key_file = self.write("transfer.key", key)
        os.chmod(self.key_file, 0o600)

    def spawn(self, name, args, env=None):
        log = os.path.join(self.dir, f"{name}.log")
        proc = subprocess.Popen([self.binary, *args], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                env=dict(os.environ, RUST_LOG="warn",
                                         BULKHEAD_TRANSFER_KEY_FILE=self.key_file, **(env or {})))
        self.procs.append(proc)
        return proc, log

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def node_env(c, node_id):
    """A node's credentials: a node token minted for its id (never the admin token) and the
    token its own API accepts."""
    r = c.admin.post(f"/admin/v1/nodes/{node_id}/tokens", json={"name": "e2e"})
    assert r.status_code == 200, r.text
    return {"BULKHEAD_NODE_TOKEN": r.json()["result"]["token"], "BULKHEAD_NODE_API_TOKEN": NODE_API}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    cp_port = free_port()
    c.cp = f"http://127.0.0.1:{cp_port}"
    # The control plane serves no model itself: generations go to the prefill node.
    cfg = c.write("serve.toml", "[node]\ntext_models = []\nembedding_models = []\n")
    proc, log = c.spawn("serve", ["serve", "--config", cfg],
                        env={"BULKHEAD_ADMIN_TOKEN": ADMIN, "BULKHEAD_DATA": c.dir,
                             "BULKHEAD_LISTEN": f"127.0.0.1:{cp_port}"})
    wait_http(c.cp + "/health", proc, log)
    c.admin = httpx.Client(base_url=c.cp, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    transfer = f"127.0.0.1:{free_port()}"
    dport, pport = free_port(), free_port()
    c.decode, c.prefill = f"http://127.0.0.1:{dport}", f"http://127.0.0.1:{pport}"
    common = ["--context-window", str(WINDOW), "--control-plane", c.cp]
    proc, log = c.spawn("decode", ["node", "--role", "decode", "--listen", f"127.0.0.1:{dport}",
                                   "--pool-tokens", "8192", "--transfer-listen", transfer,
                                   "--node-id", "decode-1", *common],
                        env=node_env(c, "decode-1"))
    wait_http(c.decode + "/health", proc, log)
    proc, log = c.spawn("prefill", ["node", "--role", "prefill", "--listen", f"127.0.0.1:{pport}",
                                    "--pool-tokens", str(PREFILL_POOL), "--decode-peer", transfer,
                                    "--node-id", "prefill-1", *common],
                        env=node_env(c, "prefill-1"))
    wait_http(c.prefill + "/health", proc, log)
    deadline = time.time() + 30
    while True:
        nodes = c.admin.get("/admin/v1/nodes").json()["result"]
        if {n["id"] for n in nodes if n.get("healthy")} >= {"prefill-1", "decode-1"}:
            break
        assert time.time() < deadline, nodes
        time.sleep(0.2)
    # Registered private; published through the gate (both pools fit 512 x 2). The nodes
    # serve the default models: both families.
    for model in TEXT_MODELS:
        r = c.admin.patch("/admin/v1/models/" + model.replace("/", "%2F"), json={"visibility": "public"})
        assert r.status_code == 200, r.text
    yield c
    c.stop()


def tenant(c, name):
    t = c.admin.post("/admin/v1/tenants", json={"name": name}).json()["result"]
    tok = c.admin.post(f"/admin/v1/tenants/{t['id']}/tokens", json={"name": "t"}).json()["result"]
    return {"account": t["id"], "token": tok["token"], "name": name}


def run(c, t, body, model=MODEL, tries=6):
    """One request as the official SDK sends it: retried on 429 after `retry-after`."""
    for attempt in range(tries):
        r = httpx.post(f"{c.cp}/client/v4/accounts/{t['account']}/ai/run/{model}", json=body,
                       headers={"Authorization": f"Bearer {t['token']}"}, timeout=180)
        if r.status_code != 429 or attempt + 1 == tries:
            return r.status_code, r.text
        time.sleep(float(r.headers.get("retry-after", "1")))


def pool(url, model):
    state = httpx.get(url + "/v1/state", headers={"Authorization": f"Bearer {NODE_API}"},
                      timeout=10)
    assert state.status_code == 200, state.text
    state = state.json()
    m = next(m for m in state["models"] if m["name"] == model)
    return m


def wait_pool_full(url, model=MODEL):
    deadline = time.time() + 30
    while True:
        m = pool(url, model)
        p = m["pool"]
        assert p["isolation_violations"] == 0, p
        if p["pages_free"] == p["pages_total"] and p["pages_reserved"] == 0 and m["running"] == 0:
            return p
        assert time.time() < deadline, f"pool of {url} not back to full: {m}"
        time.sleep(0.2)


def metric(url, name):
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {NODE_API}"},
                     timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def words(n):
    return " ".join(f"w{i}" for i in range(n))


@pytest.mark.parametrize("model", TEXT_MODELS, ids=["smollm2", "gemma3"])
def test_incident_mix_of_oversized_and_canary_prompts(cluster, model):
    c = cluster
    tenants = [tenant(c, f"{model.rsplit('/', 1)[1]}-tenant-{i}") for i in range(TENANTS)]
    # Measure a long prompt once, so one request can sit exactly at the window.
    at_limit_words = 135  # ~3.5 tokens a word for SmolLM2, fewer for Gemma
    at_limit_prompt = words(at_limit_words)
    s, body = run(c, tenants[0], {"prompt": at_limit_prompt, "raw": True, "max_tokens": 1, "temperature": 0},
                  model)
    assert s == 200, body
    n = json.loads(body)["result"]["usage"]["prompt_tokens"]
    assert n < WINDOW - 8, n
    # Words enough for 40 tokens past the window, whatever this model's tokens per word.
    over_window_words = (WINDOW + 40) * at_limit_words // n + 1

    jobs = []  # (tenant, kind, body, canary)
    canaries = {}

    def canary_body(canary):
        # Six lines of the code before the open one: with three, a code the model copied
        # alone could lose to another continuation in the storm, where the prefill node
        # chunks prompts differently (other attention sum orders move logits a little).
        return {"prompt": "".join(f"Code: {canary}\n" for _ in range(6)) + "Code:",
                "raw": True, "max_tokens": 8, "temperature": 0}

    for i, t in enumerate(tenants):
        for k in range(2):
            # Vetted alone first: the 135M model copies most codes but not every one
            # (e.g. it answers "1.0.0.0" to MAPLE-3079, unified or not), so the storm
            # asserts on codes it is known to answer.
            for _ in range(8):
                canary = f"{CANARY_WORDS[i]}-{1000 + secrets.randbelow(9000)}"
                s, body = run(c, t, canary_body(canary), model)
                assert s == 200, body
                if canary in json.loads(body)["result"]["response"]:
                    break
            else:
                pytest.fail(f"no {CANARY_WORDS[i]} code was copied by the model")
            canaries[canary] = t["name"]
            jobs.append((t, "canary", canary_body(canary), canary))
        jobs.append((t, "over_pool", {"prompt": words(PREFILL_POOL + 100), "raw": True, "max_tokens": 8}, None))
        jobs.append((t, "over_window", {"prompt": words(over_window_words), "raw": True, "max_tokens": 8},
                     None))
        jobs.append((t, "at_limit", {"prompt": at_limit_prompt, "raw": True, "max_tokens": WINDOW - n,
                                     "temperature": 0}, None))
        jobs.append((t, "one_past", {"prompt": at_limit_prompt, "raw": True, "max_tokens": WINDOW - n + 1}, None))
    started_before = metric(c.decode, "bulkhead_kv_transfers_started_total")
    # Interleave kinds and tenants so oversized and normal requests overlap in flight.
    jobs.sort(key=lambda j: secrets.randbelow(1 << 30))

    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool_:
        results = list(pool_.map(lambda j: (j, run(c, j[0], j[2], model)), jobs))

    admitted = 0
    for (t, kind, _, canary), (status, text) in results:
        # No response, success or error, carries another tenant's canary.
        for other, owner in canaries.items():
            if owner != t["name"]:
                assert other not in text, f"{t['name']} got {owner}'s canary: {text}"
        if kind in ("over_pool", "over_window", "one_past"):
            assert status == 413, f"{kind}: {status} {text}"
            err = json.loads(text)["errors"][0]
            assert err["code"] == 5021, text
            assert re.search(r"\b512\b", err["message"]), f"the numbers: {text}"
            assert json.loads(text)["success"] is False
        else:
            assert status == 200, f"{kind}: {status} {text}"
            admitted += 1
            result = json.loads(text)["result"]
            if kind == "canary":
                assert canary in result["response"], f"{t['name']} did not get its own answer: {text}"
            else:
                assert result["usage"]["prompt_tokens"] == n

    # Rejected requests never reached decode: one transfer per admitted request only.
    assert metric(c.decode, "bulkhead_kv_transfers_started_total") - started_before == admitted
    assert metric(c.decode, "bulkhead_kv_isolation_violations_total") == 0
    assert metric(c.prefill, "bulkhead_kv_isolation_violations_total") == 0
    assert metric(c.decode, "bulkhead_kv_transfers_failed_total") == 0
    wait_pool_full(c.prefill, model)
    wait_pool_full(c.decode, model)


def test_the_incident_deployment_is_refused_everywhere(cluster):
    """A prefill pool smaller than the context window (681,280 vs 1,048,576, scaled by
    1/1024: 665 vs 1024) is refused by the startup check, `bulkhead check` and the gate."""
    c = cluster
    # Startup check: the node does not start.
    proc, log = c.spawn("bad-prefill", ["node", "--role", "prefill", "--listen", f"127.0.0.1:{free_port()}",
                                        "--pool-tokens", "665", "--context-window", "1024",
                                        "--safety-factor", "1", "--decode-peer", "127.0.0.1:9"])
    assert proc.wait(timeout=120) != 0
    out = open(log).read()
    assert "refusing to start" in out and "1024" in out and "672" in out, out
    assert "panicked" not in out

    # `bulkhead check` on the same deployment.
    cfg = c.write("incident-node.toml", 'role = "prefill"\npool_tokens = 665\nsafety_factor = 1.0\n'
                                        '[transfer]\npeers = ["127.0.0.1:9"]\n'
                                        f'[[text_models]]\nname = "{MODEL}"\ncontext_window = 1024\n')
    r = subprocess.run([c.binary, "check", "--config", cfg], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "672" in r.stderr and "1024" in r.stderr, r.stderr

    # The publish gate: the catalog advertises a 1024-token window for a model whose serving
    # prefill node has a 672-token pool (its own served window of 256 fits, so it starts).
    name = "@cf/example/long-context"
    r = c.admin.post("/admin/v1/models", json={"name": name, "task": "text-generation",
                                               "context_window": 1024, "max_output_tokens": 64})
    assert r.status_code == 200, r.text
    port = free_port()
    # An operator's model under its own name: the bundled SmolLM2 file as its weights.
    models = os.environ.get("BULKHEAD_MODELS") or os.path.expanduser("~/.cache/bulkhead/models")
    gguf = os.path.join(models, "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")
    node_cfg = c.write("small-node.toml", 'role = "prefill"\npool_tokens = 665\n'
                                          '[transfer]\npeers = ["127.0.0.1:9"]\n'
                                          f'[[text_models]]\nname = "{name}"\npath = "{gguf}"\n'
                                          'context_window = 256\n')
    proc, log = c.spawn("small-prefill", ["node", "--config", node_cfg, "--listen", f"127.0.0.1:{port}",
                                          "--control-plane", c.cp, "--node-id", "small-prefill"],
                        env=node_env(c, "small-prefill"))
    wait_http(f"http://127.0.0.1:{port}/health", proc, log)
    deadline = time.time() + 30
    while not any(n["id"] == "small-prefill" and n.get("healthy")
                  for n in c.admin.get("/admin/v1/nodes").json()["result"]):
        assert time.time() < deadline
        time.sleep(0.2)
    r = c.admin.patch("/admin/v1/models/" + name.replace("/", "%2F"), json={"visibility": "public"})
    assert r.status_code == 409, r.text
    msg = r.json()["errors"][0]["message"]
    assert "672" in msg and "1024" in msg and "2048" in msg, msg
    # Still private: a tenant gets the same 400 as for a model that does not exist.
    t = tenant(c, "gate-tenant")
    s, body = httpx.post(f"{c.cp}/client/v4/accounts/{t['account']}/ai/run/{name}",
                         json={"prompt": "hi"}, headers={"Authorization": f"Bearer {t['token']}"},
                         timeout=60).status_code, None
    assert s == 400


@pytest.mark.parametrize("model", TEXT_MODELS, ids=["smollm2", "gemma3"])
def test_constrained_answers_across_the_transfer(cluster, model):
    # The prefill node renders the tools into the prompt; the decode node, which samples,
    # compiles the grammar from the request's transferred sampling parameters.
    t = tenant(cluster, "tools-across-" + model.rsplit("/", 1)[1])
    weather = {"type": "object", "additionalProperties": False, "required": ["city"],
               "properties": {"city": {"type": "string", "maxLength": 20}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    status, text = run(cluster, t, {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": tools, "tool_choice": "required", "temperature": 0, "max_tokens": 200}, model)
    assert status == 200, text
    call = json.loads(text)["result"]["tool_calls"][0]
    assert call["name"] == "get_weather", call
    assert set(call["arguments"]) == {"city"} and len(call["arguments"]["city"]) <= 20, call
    status, text = run(cluster, t, {
        "prompt": "Name a city.", "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": weather}}, model)
    assert status == 200, text
    answer = json.loads(text)["result"]["response"]
    assert set(answer) == {"city"} and len(answer["city"]) <= 20, answer
    wait_pool_full(cluster.prefill, model)
    wait_pool_full(cluster.decode, model)
