"""The official `openai` Python SDK against a running `bulkhead serve`."""
import openai
import pytest
from openai import OpenAI

from conftest import FEW_SHOT, GEMMA3

TEXT = "@cf/huggingfacetb/smollm2-135m-instruct"
EMBED = "@cf/sentence-transformers/all-minilm-l6-v2"


@pytest.fixture(params=["account", "root"])
def client(server, request):
    base = (server["base"] + f"/client/v4/accounts/{server['account']}/ai/v1") if request.param == "account" \
        else server["base"] + "/v1"
    return OpenAI(api_key=server["token"], base_url=base, max_retries=0)


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_completion(client, text_model):
    r = client.chat.completions.create(model=text_model, messages=FEW_SHOT, temperature=0, max_tokens=6)
    assert "Berlin" in r.choices[0].message.content
    assert r.model == text_model
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_completion_streaming_with_usage(client, text_model):
    stream = client.chat.completions.create(model=text_model, messages=FEW_SHOT, temperature=0, max_tokens=6,
                                            stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert "Berlin" in text
    assert usage is not None and usage.completion_tokens > 0


def test_models_list_and_retrieve(client):
    ids = [m.id for m in client.models.list()]
    assert TEXT in ids and GEMMA3 in ids and EMBED in ids
    assert client.models.retrieve(TEXT).id == TEXT
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("@cf/no/such-model")


def test_embeddings(client):
    # The SDK asks for base64 by default and decodes it.
    r = client.embeddings.create(model=EMBED, input=["a cat", "a dog"])
    assert len(r.data) == 2 and len(r.data[0].embedding) == 384
    norm = sum(x * x for x in r.data[0].embedding) ** 0.5
    assert abs(norm - 1.0) < 1e-3


def test_errors_are_openai_shaped(client, text_model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="@cf/nobody/nothing", messages=QUESTION)
    # The SDK hands over the inner `error` object of the body.
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=text_model, messages=[{"role": "user", "content": "word " * 700}],
                                       max_tokens=8)
    assert e.value.status_code == 413
