"""A real JS worker end to end: built with `bulkhead worker build` (componentize-js),
deployed through the workers API, called over HTTP; its env.AI.run calls reach the real
SmolLM2 and MiniLM models as the tenant that owns it."""
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest


def _request(url, method="GET", data=None, headers=None, token=None):
    headers = dict(headers or {})
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


@pytest.fixture(scope="session")
def worker(server, worker_wasm):
    tenant = server["call"]("POST", "/admin/v1/tenants", {"name": "workers-e2e"})["result"]
    token = server["call"]("POST", f"/admin/v1/tenants/{tenant['id']}/tokens", {"name": "w"})["result"]["token"]
    acct = tenant["id"]
    status, body, _ = _request(
        f"{server['base']}/client/v4/accounts/{acct}/workers/scripts/e2e?cpu_ms=200",
        "PUT", worker_wasm["bytes"], {"Content-Type": "application/wasm"}, token)
    assert status == 200, body
    deployed = json.loads(body)["result"]
    assert deployed["name"] == "e2e" and deployed["cpu_ms"] == 200
    # A worker is its own origin, never a path of the control plane's.
    return {"host": f"e2e.{acct}.workers.localhost", "account": acct, "token": token,
            "server": server}


def _to_worker(worker, path, method="GET", data=None, headers=None):
    """A request to the deployed worker, by its host name."""
    return _request(worker["server"]["base"] + path, method, data,
                    {"Host": worker["host"], **(headers or {})})


def test_text_generation_through_env_ai_run(worker, text_model):
    status, body, _ = _to_worker(worker, "/text?model=" + urllib.parse.quote(text_model))
    assert status == 200, body
    out = json.loads(body)
    assert "Berlin" in out["response"], out
    assert out["usage"]["completion_tokens"] > 0


def test_structured_output_through_env_ai_run(worker):
    status, body, _ = _to_worker(worker, "/json")
    assert status == 200, body
    out = json.loads(body)["response"]
    assert isinstance(out, dict), body
    assert set(out) == {"city", "country"} and out["country"] in ("France", "Italy", "Spain"), out
    assert len(out["city"]) <= 24, out


def test_a_tool_loop_through_env_ai_run(worker):
    # The worker asks with tools, runs the call it gets and sends the result back.
    status, body, _ = _to_worker(worker, "/tools")
    assert status == 200, body
    out = json.loads(body)
    call = out["call"]
    assert call["name"] == call["function"]["name"] == "get_weather", call
    assert call["id"].startswith("call_") and call["type"] == "function", call
    # Both shapes of the arguments: the object, and the JSON text that parses to it.
    assert set(call["arguments"]) == {"city"} and len(call["arguments"]["city"]) <= 24, call
    assert json.loads(call["function"]["arguments"]) == call["arguments"]
    assert isinstance(out["answer"], str) and out["answer"], out
    assert out["usage"]["prompt_tokens"] > 0


def test_embeddings_through_env_ai_run(worker):
    status, body, _ = _to_worker(worker, "/embed")
    assert status == 200, body
    out = json.loads(body)
    assert out["shape"] == [2, 384]
    assert len(out["data"]) == 2 and len(out["data"][0]) == 384
    # The same vectors as the REST API gives the owner.
    s, rest, _ = _request(
        f"{worker['server']['base']}/client/v4/accounts/{worker['account']}/ai/run/"
        "@cf/sentence-transformers/all-minilm-l6-v2",
        "POST", json.dumps({"text": ["hello", "world"]}).encode(),
        {"Content-Type": "application/json"}, worker["token"])
    assert s == 200
    rest = json.loads(rest)["result"]["data"]
    for a, b in zip(out["data"], rest):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5


def test_streaming_returns_sse_frames_ending_in_done(worker):
    status, body, headers = _to_worker(worker, "/stream")
    assert status == 200, body
    assert headers["content-type"].startswith("text/event-stream")
    frames = [f for f in body.decode().split("\n\n") if f]
    assert frames[-1] == "data: [DONE]", frames
    pieces = [json.loads(f[len("data: "):]) for f in frames[:-1]]
    assert all(f.startswith("data: ") for f in frames)
    assert "usage" in pieces[-1]
    assert "".join(p["response"] for p in pieces).strip()


def test_an_oversized_prompt_is_5021_inside_js(worker):
    status, body, _ = _to_worker(worker, "/oversized")
    assert status == 422, body
    out = json.loads(body)
    assert out["caught"].startswith("5021: "), out
    assert out["code"] == 5021 and out["status"] == 413 and out["name"] == "AiError"


def test_raw_responses_and_checked_options(worker):
    status, body, _ = _to_worker(worker, "/raw")
    assert status == 400, body
    env = json.loads(body)
    assert env["success"] is False and env["errors"][0]["code"] == 5007
    status, body, _ = _to_worker(worker, "/bad-option")
    assert status == 400
    assert body.decode().startswith("5006: ") and "gateway" in body.decode()


def test_no_ambient_access(worker):
    status, body, _ = _to_worker(worker, "/ambient")
    assert status == 200, body
    assert json.loads(body) == {"env": ["AI"], "process": "undefined", "fs": "unavailable"}
    # Outgoing HTTP is denied, even to the control plane on loopback.
    status, body, _ = _to_worker(worker, "/fetch",
                               headers={"x-target": worker["server"]["base"] + "/health"})
    assert status == 403, body
    assert body.decode().startswith("denied"), body


def test_an_uncaught_exception_is_500_1101_and_counted(worker):
    def exceptions():
        _, m, _ = _request(worker["server"]["base"] + "/metrics", token=worker["server"]["admin"])
        for line in m.decode().splitlines():
            if line.startswith('bulkhead_worker_requests_total{outcome="exception"}'):
                return float(line.split()[-1])
        return 0.0
    before = exceptions()
    status, body, _ = _to_worker(worker, "/throw")
    assert status == 500, body
    assert json.loads(body)["errors"][0]["code"] == 1101
    # Counted once the guest is done, just after the answer: wait for it, bounded.
    deadline = time.time() + 5
    while exceptions() < before + 1 and time.time() < deadline:
        time.sleep(0.05)
    assert exceptions() == before + 1
    status, body, _ = _to_worker(worker, "/echo")
    assert (status, body) == (200, b"ok")


def test_an_answer_that_is_not_a_response_is_500_1101(worker):
    status, body, _ = _to_worker(worker, "/not-a-response")
    assert status == 500, body
    assert json.loads(body)["errors"][0]["code"] == 1101
    status, body, _ = _to_worker(worker, "/echo")
    assert (status, body) == (200, b"ok")


def test_workers_are_served_only_on_their_own_host_names(worker):
    status, body, _ = _to_worker(worker, "/echo")
    assert (status, body) == (200, b"ok")
    # The control plane's origin (the admin UI's) serves no worker under any path.
    status, body, _ = _request(f"{worker['server']['base']}/workers/{worker['account']}/e2e/echo")
    assert status == 404, body
    assert json.loads(body)["errors"][0]["code"] == 7000
