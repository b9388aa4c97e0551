"""A request's structured-output fields together: checked without the model, then against the
model's template, then compiled into the one constraint its sequences decode under.

Order (every refusal a 400 before anything is queued or any stream opens):
:func:`check_request` (shapes and schema features, no model), :func:`check_for_model` (the
chat template's tool format), :func:`request_constraint` (the grammar, in a worker thread:
the first one of a tokenizer costs seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from miserver.serving.structured.response_format import (
    OutputFormat,
    compile_constraint,
    parse_response_format,
)
from miserver.serving.structured.tools import (
    ToolFormat,
    ToolSpec,
    parse_tools,
    tool_constraint,
    tool_format,
)


@dataclass(frozen=True)
class Structured:
    """What a request asked for beyond free text.

    Attributes:
        output: its ``response_format`` (None: free text).
        tools: its tools (None: none, or ``tool_choice: "none"``).
        tool_format: the template's tool-call format, once :func:`check_for_model` ran.
    """

    output: OutputFormat | None = None
    tools: ToolSpec | None = None
    tool_format: ToolFormat | None = None

    @property
    def any(self) -> bool:
        return self.output is not None or self.tools is not None


def check_request(
    response_format: Any = None,
    tools: Any = None,
    tool_choice: Any = None,
    parallel_tool_calls: Any = None,
) -> Structured:
    """The model-independent checks (:func:`parse_response_format`, :func:`parse_tools`).

    Raises:
        ApiError: 400 INVALID_REQUEST naming the field.
    """
    output = parse_response_format(response_format)
    spec = parse_tools(tools, tool_choice, parallel_tool_calls)
    return Structured(output, spec)


def check_for_model(structured: Structured, tokenizer: Any) -> Structured:
    """``structured`` with the model's tool format (tools only).

    Raises:
        ApiError: 400 INVALID_REQUEST naming ``tools``: the template takes no tools.
    """
    if structured.tools is None:
        return structured
    return replace(structured, tool_format=tool_format(tokenizer))


def request_constraint(structured: Structured, model: Any, tokenizer: Any) -> Any:
    """The :class:`~miserver.serving.engine.constraints.Constraint` the request decodes under,
    or None (free text, or tools with ``tool_choice`` ``auto`` and no ``response_format``: the
    model chooses and its calls are parsed). Enforced tools: the call grammar; ``auto`` tools
    with a ``response_format``: calls or the format; otherwise the format.

    Raises:
        ApiError: 400 INVALID_REQUEST naming ``response_format`` or ``tools``: the grammar
            library refuses the schema.
    """
    output, spec = structured.output, structured.tools
    if spec is not None:
        assert structured.tool_format is not None, "check_for_model first"
        if spec.enforced:
            return tool_constraint(spec, structured.tool_format, model, tokenizer)
        if output is not None:
            return tool_constraint(
                spec, structured.tool_format, model, tokenizer, answer_schema=output.schema
            )
        return None
    if output is not None:
        return compile_constraint(output, model, tokenizer, "response_format")
    return None
