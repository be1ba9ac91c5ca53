"""Structured outputs through the official SDKs, on the real 135M model: `openai`'s
`chat.completions.parse` with a Pydantic model, twenty JSON schemas sampled at temperature
1.0 five times each (every answer parses and validates), and the `cloudflare` SDK's
`ai.run` with `response_format`."""
import concurrent.futures
import json
from typing import Literal

import jsonschema_rs
import pytest
from cloudflare import Cloudflare
from openai import OpenAI
from pydantic import BaseModel, Field

TEXT = "@cf/huggingfacetb/smollm2-135m-instruct"


@pytest.fixture
def openai_client(server):
    return OpenAI(api_key=server["token"], base_url=server["base"] + "/v1", max_retries=0)


class City(BaseModel):
    name: str = Field(max_length=30)
    country: Literal["France", "Italy", "Spain", "Germany"]
    population: int = Field(ge=1, le=50_000_000)
    coastal: bool


def test_openai_parse_with_a_pydantic_model(openai_client, text_model):
    r = openai_client.chat.completions.parse(
        model=text_model, messages=[{"role": "user", "content": "Describe a big city in Europe."}],
        response_format=City, temperature=1.0, seed=11, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    city = choice.message.parsed
    assert isinstance(city, City), choice.message
    assert city.country in ("France", "Italy", "Spain", "Germany")
    assert 1 <= city.population <= 50_000_000


def _obj(props, required=None, **extra):
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False, **extra}


SHORT = {"type": "string", "maxLength": 16}
SCHEMAS = [
    _obj({"answer": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"n": {"type": "integer", "minimum": -5, "maximum": 5}}),
    _obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    _obj({"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}}),
    _obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                     "minItems": 2, "maxItems": 4}}),
    _obj({"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": SHORT})}),
    _obj({"point": _obj({"x": {"type": "number", "minimum": -10, "maximum": 10},
                         "y": {"type": "number", "minimum": -10, "maximum": 10}})}),
    _obj({"title": SHORT, "done": {"type": "boolean"}, "priority": {"enum": [1, 2, 3]}}),
    _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]$"}}),
    _obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}}),
    _obj({"status": {"const": "ok"}, "count": {"type": "integer", "minimum": 0, "maximum": 100}}),
    _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}}),
    _obj({"items": {"type": "array", "maxItems": 2,
                    "items": _obj({"sku": {"type": "string", "pattern": "^[0-9]{4}$"},
                                   "qty": {"type": "integer", "minimum": 1, "maximum": 5}})}}),
    _obj({"a": SHORT, "b": SHORT}, required=["a"]),
    _obj({"matrix": {"type": "array", "minItems": 2, "maxItems": 2,
                     "items": {"type": "array", "minItems": 2, "maxItems": 2,
                               "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}),
    {"type": "object", "$defs": {"pet": _obj({"kind": {"enum": ["cat", "dog"]}, "name": SHORT})},
     "properties": {"pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "minItems": 1,
                             "maxItems": 2}},
     "required": ["pets"], "additionalProperties": False},
    _obj({"word": {"type": "string", "minLength": 3, "maxLength": 8, "pattern": "^[a-z]+$"},
          "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
]


def test_twenty_schemas_sampled_five_times_each_all_parse_and_validate(openai_client):
    assert len(SCHEMAS) == 20

    def ask(job):
        i, seed = job
        r = openai_client.chat.completions.create(
            model=TEXT, temperature=1.0, seed=seed, max_tokens=200,
            messages=[{"role": "user", "content": "Fill in this form with made-up values."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"form{i}", "strict": True, "schema": SCHEMAS[i]}})
        return i, seed, r.choices[0]

    jobs = [(i, seed) for i in range(len(SCHEMAS)) for seed in range(5)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for i, seed, choice in pool.map(ask, jobs):
            text = choice.message.content
            assert choice.finish_reason == "stop", (i, seed, text)
            value = json.loads(text)
            errors = [e.message for e in jsonschema_rs.validator_for(SCHEMAS[i]).iter_errors(value)]
            assert not errors, (i, seed, text, errors)


def test_cloudflare_sdk_run_with_response_format(server):
    client = Cloudflare(api_token=server["token"], base_url=server["base"] + "/client/v4", max_retries=0)
    schema = City.model_json_schema()
    out = client.ai.run(TEXT, account_id=server["account"], temperature=1.0, seed=5, max_tokens=120,
                        messages=[{"role": "user", "content": "Describe a big city in Europe."}],
                        response_format={"type": "json_schema", "json_schema": schema})
    # JSON mode answers with the object itself, as Workers AI does.
    City.model_validate(out["response"])
    out = client.ai.run(TEXT, account_id=server["account"], temperature=0, max_tokens=120,
                        prompt="Give the name and age of a person as JSON.",
                        response_format={"type": "json_object"})
    assert isinstance(out["response"], dict), out
