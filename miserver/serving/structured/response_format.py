"""``response_format`` (OpenAI's chat and completion field): parsed, checked, compiled.

``{"type": "text"}`` (the default: free text), ``{"type": "json_object"}`` (any JSON object) and
``{"type": "json_schema", "json_schema": {"name", "description"?, "schema"?, "strict"?}}`` (a
JSON document valid under ``schema``). Every refusal is a 400 ``INVALID_REQUEST`` naming the
field, raised before anything is queued or any stream opens:

- :func:`parse_response_format` checks the shape and walks the schema: a keyword outside
  :data:`SUPPORTED_KEYWORDS` (``not``, ``if``, ``uniqueItems``, ...) is named with its place
  (``response_format.json_schema.schema.properties.tags.uniqueItems``). This check knows no
  grammar library, so every backend refuses the same schemas.
- :func:`compile_constraint` compiles the format for a transformers resident (llguidance,
  :mod:`miserver.serving.engine.constraints`); what the library still refuses (an unknown
  ``format``, a ``pattern`` it cannot parse) is a 400 with its message.
- :func:`compile_llama_cpp` does the same for a GGUF resident, whose llama.cpp enforces the
  schema with its own grammar (:func:`~miserver.serving.models.gguf.json_schema_grammar`).

``strict`` is accepted either way: the schema is always enforced (OpenAI's ``strict: true``
behaviour; ``false`` merely allows it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from miserver.spec import codes
from miserver.spec.errors import ApiError

#: JSON Schema keywords enforced (OpenAI's structured-output subset and more); annotations are
#: accepted and have no effect on the output.
SUPPORTED_KEYWORDS = frozenset(
    {
        # structure
        "type",
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "minProperties",
        "maxProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "$defs",
        "definitions",
        # strings
        "minLength",
        "maxLength",
        "pattern",
        "format",
        # numbers
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        # annotations
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "nullable",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
#: Keywords whose value is a map of name -> subschema, a list of subschemas, or one subschema.
_MAP_OF_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions")
_LIST_OF_SCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONE_SCHEMA = ("items", "additionalProperties")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MAX_DEPTH = 64


@dataclass(frozen=True)
class OutputFormat:
    """A checked ``response_format``.

    Attributes:
        type: ``json_object`` or ``json_schema`` (``text`` parses to None: nothing to enforce).
        schema: the JSON schema to enforce (``{"type": "object"}`` for ``json_object``).
        name: ``json_schema.name`` (None for ``json_object``).
        strict: ``json_schema.strict`` as sent (False when absent).
    """

    type: Literal["json_object", "json_schema"]
    schema: dict[str, Any]
    name: str | None = None
    strict: bool = False

    @property
    def description(self) -> str:
        """For logs and errors: ``json_schema 'person'`` or ``json_object``."""
        return f"json_schema {self.name!r}" if self.name else self.type


def _bad(message: str, param: str) -> ApiError:
    return ApiError(codes.INVALID_REQUEST, message, param=param)


def unsupported_features(schema: Any, where: str = "schema") -> list[str]:
    """The places of the keywords in ``schema`` (a JSON Schema) that miserver does not enforce,
    e.g. ``["schema.not", "schema.properties.tags.uniqueItems"]``; empty when all are.
    Booleans are schemas (``true``/``false``); a non-object, non-boolean schema is listed."""
    found: list[str] = []

    def walk(node: Any, at: str, depth: int) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, dict) or depth > _MAX_DEPTH:
            found.append(at + (" (not a schema)" if depth <= _MAX_DEPTH else " (nested too deep)"))
            return
        for key, value in node.items():
            if key not in SUPPORTED_KEYWORDS:
                found.append(f"{at}.{key}")
            elif key in _MAP_OF_SCHEMAS:
                if not isinstance(value, dict):
                    found.append(f"{at}.{key} (not an object)")
                    continue
                for name, sub in value.items():
                    walk(sub, f"{at}.{key}.{name}", depth + 1)
            elif key in _LIST_OF_SCHEMAS:
                if not isinstance(value, list):
                    found.append(f"{at}.{key} (not a list)")
                    continue
                for i, sub in enumerate(value):
                    walk(sub, f"{at}.{key}[{i}]", depth + 1)
            elif key in _ONE_SCHEMA:
                walk(value, f"{at}.{key}", depth + 1)

    walk(schema, where, 0)
    return found


def parse_response_format(value: Any, param: str = "response_format") -> OutputFormat | None:
    """Check ``response_format`` (the decoded JSON value); None for absent or ``text``.

    Raises:
        ApiError: 400 INVALID_REQUEST naming the field: not an object, an unknown ``type``, a
            ``json_schema`` without a valid ``name``, a ``schema`` that is not an object, an
            unknown field, or a schema keyword miserver does not enforce (named with its place).
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(f"{param} must be an object with a type", param)
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise _bad(f"unsupported field {param}.{extra[0]}", f"{param}.{extra[0]}")
    if kind == "text":
        if "json_schema" in value:
            raise _bad(f"{param}.json_schema is only for type json_schema", f"{param}.json_schema")
        return None
    if kind == "json_object":
        if "json_schema" in value:
            raise _bad(f"{param}.json_schema is only for type json_schema", f"{param}.json_schema")
        return OutputFormat("json_object", {"type": "object"})
    if kind != "json_schema":
        raise _bad(
            f"{param}.type must be one of text, json_object, json_schema; got {kind!r}",
            f"{param}.type",
        )
    spec = value.get("json_schema")
    at = f"{param}.json_schema"
    if not isinstance(spec, dict):
        raise _bad(f"{at} is required for type json_schema and must be an object", at)
    extra = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if extra:
        raise _bad(f"unsupported field {at}.{extra[0]}", f"{at}.{extra[0]}")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(
            f"{at}.name is required: 1 to 64 letters, digits, underscores or dashes", f"{at}.name"
        )
    if "description" in spec and not isinstance(spec["description"], str):
        raise _bad(f"{at}.description must be a string", f"{at}.description")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{at}.strict must be a boolean", f"{at}.strict")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _bad(f"{at}.schema must be a JSON Schema object", f"{at}.schema")
    unsupported = unsupported_features(schema, f"{at}.schema")
    if unsupported:
        first = unsupported[0]
        raise _bad(
            f"unsupported JSON Schema feature at {first}"
            + (f" (and {len(unsupported) - 1} more)" if len(unsupported) > 1 else "")
            + ": structured outputs enforce "
            + ", ".join(sorted(k for k in SUPPORTED_KEYWORDS if not k.startswith("$")))
            + ", $ref and $defs",
            first.split(" ")[0],
        )
    return OutputFormat("json_schema", schema, name, bool(strict))


def compile_constraint(fmt: OutputFormat, model: Any, tokenizer: Any, param: str) -> Any:
    """The :class:`~miserver.serving.engine.constraints.Constraint` enforcing ``fmt`` on a
    transformers resident (``model``'s logits width, ``tokenizer``). Slow the first time for a
    tokenizer (seconds: run it off the event loop).

    Raises:
        ApiError: 400 INVALID_REQUEST at ``param``: the grammar library refuses the schema (its
            message names the keyword or format).
    """
    from miserver.serving.engine.constraints import (
        ConstraintError,
        json_schema_constraint,
        model_vocab_size,
    )

    try:
        return json_schema_constraint(
            fmt.schema, tokenizer, model_vocab_size(model, tokenizer), fmt.description
        )
    except ConstraintError as exc:
        raise _bad(f"{param}: unsupported schema: {exc}", param) from None


def compile_llama_cpp(fmt: OutputFormat, param: str, build: Any) -> Any:
    """The grammar enforcing ``fmt`` on a GGUF resident (llama.cpp's own JSON-schema grammar;
    milliseconds): ``build(schema, description)`` is the resident kind's builder
    (:func:`~miserver.serving.models.gguf.json_schema_grammar`, passed in by the caller so this
    room does not reach into the models room).

    Raises:
        ApiError: 400 INVALID_REQUEST at ``param``: the grammar library refuses the schema.
    """
    from miserver.serving.engine.constraints import ConstraintError

    try:
        return build(fmt.schema, fmt.description)
    except ConstraintError as exc:
        raise _bad(f"{param}: unsupported schema: {exc}", param) from None
