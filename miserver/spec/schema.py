"""The published JSON schema of the weights API, generated from the routes' Structs.

``docs/schemas/millm-weights-api-v1.json`` (weights page: Rebuilding the tensors in the trainer)
is this module's output: every route of :data:`miserver.spec.weights.ROUTES` with its request
body and its response (the ``data`` of the management envelope), the error envelope with every
code and its allowed reasons, and the shared definitions under ``$defs``. ``miserver docs``
writes it; a test fails when the committed file is stale.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from miserver.spec import codes
from miserver.spec.weights import ROUTES

SCHEMA_ID = "https://miserver.dev/schemas/millm-weights-api-v1.json"


def weights_api_schema() -> dict[str, Any]:
    """The schema as a JSON-ready dict (JSON Schema 2020-12)."""
    types: list[Any] = []
    for request, response in ROUTES.values():
        if request is not None:
            types.append(request)
        types.append(response)
    refs, defs = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    ref_of = dict(zip(types, refs, strict=True))
    routes: dict[str, Any] = {}
    for route, (request, response) in ROUTES.items():
        routes[route] = {
            "request": ref_of[request] if request is not None else None,
            "response": {
                "type": "object",
                "properties": {
                    "success": {"const": True},
                    "data": ref_of[response],
                    "error": {"type": "null"},
                },
                "required": ["success", "data", "error"],
            },
        }
    error_codes = {
        name: {"status": sorted({c.status, *c.other_statuses}), "reasons": list(c.reasons)}
        for name, c in sorted(codes.ALL.items())
    }
    from miserver.spec.weights import V1_EXTENSIONS

    ext_refs, ext_defs = msgspec.json.schema_components(
        list(V1_EXTENSIONS.values()), ref_template="#/$defs/{name}"
    )
    defs.update(ext_defs)
    for name, schema in zip(V1_EXTENSIONS, ext_refs, strict=True):
        defs[name] = {
            **schema,
            "description": "/v1 extension (contract 4): a choice's millm_weight_spans, the "
            "tokens each parameter set produced, in order; present only when they span more "
            "than one set",
        }
    defs["Error"] = {
        "type": "object",
        "properties": {
            "code": {"enum": sorted(codes.ALL)},
            "message": {"type": "string"},
            "reason": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "details": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        },
        "required": ["code", "message", "reason", "details"],
    }
    defs["ErrorEnvelope"] = {
        "type": "object",
        "properties": {
            "success": {"const": False},
            "data": {"type": "null"},
            "error": {"$ref": "#/$defs/Error"},
        },
        "required": ["success", "data", "error"],
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "miserver weights API v1 (/api/weights)",
        "description": "Generated from miserver/spec/weights.py and miserver/spec/codes.py by "
        "`miserver docs`; do not edit by hand.",
        "routes": routes,
        "errors": error_codes,
        "$defs": dict(sorted(defs.items())),
    }


def render() -> str:
    """The schema file's text (stable key order, trailing newline)."""
    return json.dumps(weights_api_schema(), indent=2, sort_keys=False) + "\n"
