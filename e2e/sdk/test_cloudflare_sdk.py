"""The official `cloudflare` Python SDK against a running `bulkhead serve`."""
import cloudflare
import pytest
from cloudflare import Cloudflare

from conftest import GEMMA3

TEXT = "@cf/huggingfacetb/smollm2-135m-instruct"
EMBED = "@cf/sentence-transformers/all-minilm-l6-v2"


@pytest.fixture
def client(server):
    return Cloudflare(api_token=server["token"], base_url=server["base"] + "/client/v4", max_retries=0)


# A raw prompt (no chat template) both families continue with "Berlin".
CAPITALS = "The capital of France is Paris. The capital of Germany is"


def test_run_text_generation(client, server, text_model):
    # SDK v5 percent-encodes the model's slashes; the server must decode them.
    out = client.ai.run(text_model, account_id=server["account"], prompt=CAPITALS, raw=True,
                        temperature=0, max_tokens=6)
    assert "Berlin" in out["response"]
    assert out["usage"]["completion_tokens"] > 0


def test_run_embeddings(client, server):
    out = client.ai.run(EMBED, account_id=server["account"], text=["hello", "world"])
    assert out["shape"] == [2, 384]
    assert len(out["data"][0]) == 384


def test_streaming_through_the_streaming_response_wrapper(client, server, text_model):
    with client.ai.with_streaming_response.run(text_model, account_id=server["account"],
                                               prompt=CAPITALS, raw=True,
                                               temperature=0, max_tokens=6, stream=True) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert any("Berlin" in line for line in lines)


def test_errors_raise_the_right_exceptions(client, server, text_model):
    with pytest.raises(cloudflare.BadRequestError) as e:
        client.ai.run("@cf/nobody/nothing", account_id=server["account"], prompt="hi")
    assert e.value.body["errors"][0]["code"] == 5007
    with pytest.raises(cloudflare.APIStatusError) as e:
        client.ai.run(text_model, account_id=server["account"], prompt="word " * 700, max_tokens=8)
    assert e.value.status_code == 413
    assert e.value.body["errors"][0]["code"] == 5021
    bad = Cloudflare(api_token="bh_wrong", base_url=server["base"] + "/client/v4", max_retries=0)
    with pytest.raises(cloudflare.AuthenticationError):
        bad.ai.run(TEXT, account_id=server["account"], prompt="hi")


def test_model_search_paginates_to_an_empty_page(client, server):
    names = [m.name if hasattr(m, "name") else m["name"] for m in client.ai.models.list(account_id=server["account"], per_page=1)]
    assert TEXT in names and GEMMA3 in names and EMBED in names
    assert len(names) == 3


def test_a_private_model_is_a_bad_request(client, server):
    path = "/admin/v1/models/" + TEXT.replace("/", "%2F")
    server["call"]("PATCH", path, {"visibility": "private", "reason": "sdk test"})
    try:
        with pytest.raises(cloudflare.BadRequestError) as e:
            client.ai.run(TEXT, account_id=server["account"], prompt="hi", max_tokens=2)
        assert e.value.body["errors"][0]["code"] == 5007
    finally:
        server["call"]("PATCH", path, {"visibility": "public"})
    out = client.ai.run(TEXT, account_id=server["account"], prompt="hi", max_tokens=2)
    assert "response" in out
