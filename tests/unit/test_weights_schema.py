"""docs/schemas/millm-weights-api-v1.json is generated from the routes' Structs and is fresh."""

import json
from pathlib import Path

import jsonschema
import msgspec

from miserver.spec import schema
from miserver.spec import weights as W

ROOT = Path(__file__).resolve().parents[2]
PATH = ROOT / "docs" / "schemas" / "millm-weights-api-v1.json"


def test_committed_schema_is_fresh():
    assert PATH.exists(), "run `miserver docs` and commit docs/schemas/millm-weights-api-v1.json"
    assert PATH.read_text(encoding="utf-8") == schema.render(), (
        "docs/schemas/millm-weights-api-v1.json is stale: run `miserver docs` and commit it"
    )


def test_every_route_is_described_and_a_real_body_validates():
    doc = schema.weights_api_schema()
    assert set(doc["routes"]) == set(W.ROUTES)
    resolver_doc = {"$defs": doc["$defs"]}
    body = {
        "success": True,
        "error": None,
        "data": msgspec.to_builtins(
            W.CommitEndResponse(
                weights_state="clean", steps_since_load=3, commit_ms=1.5, overran=False
            )
        ),
    }
    route = dict(doc["routes"]["POST /api/weights/commit-end"]["response"], **resolver_doc)
    jsonschema.validate(body, route)
    bad = dict(body, data=dict(body["data"], weights_state="dirty"))
    try:
        jsonschema.validate(bad, route)
    except jsonschema.ValidationError:
        pass
    else:
        raise AssertionError("an invalid weights_state validated")


def test_errors_list_every_code_with_its_reasons():
    doc = schema.weights_api_schema()
    assert doc["errors"]["BARRIER_UNAVAILABLE"]["reasons"] == [
        "cbm",
        "concurrency",
        "hold_unsupported",  # contract 4b: a hold on an engine that cannot park (issue 30)
    ]
    assert doc["errors"]["MODEL_NOT_LOADED"]["status"] == [400, 409]
    assert json.loads(schema.render()) == doc
