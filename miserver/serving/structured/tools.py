"""``tools`` and ``tool_choice`` on ``/v1/chat/completions`` (issue 33), as OpenAI shapes them.

- **Checked** (:func:`parse_tools`): ``tools`` a list of ``{"type": "function", "function":
  {"name", "description"?, "parameters"?, "strict"?}}`` (``parameters`` a JSON Schema checked as
  ``response_format``'s is); ``tool_choice`` ``"none"``, ``"auto"`` (the default with tools),
  ``"required"`` or ``{"type": "function", "function": {"name"}}`` naming one of them.
- **Rendered** through the model's own chat template (``apply_chat_template(tools=...)``):
  :func:`tool_format` reads the template for its tool-call format, and a template that takes no
  tools is a 400 naming ``tools``. Two formats are known: ``hermes`` (a template that writes
  ``<tool_call>`` blocks: Qwen2.5, Qwen3, Hermes, SmolLM3) and ``json`` (a template that takes
  ``tools`` and writes a call as a bare JSON object with ``name`` and ``parameters``: Llama 3.1,
  3.2, 3.3). ``tool_choice: "none"`` renders no tools.
- **Enforced** for ``"required"`` and a named function by a grammar
  (:func:`tool_call_grammar`: the format's call syntax around a JSON object whose ``name`` is
  one of the allowed functions and whose arguments follow its ``parameters``).
- **Parsed** (:class:`ToolCallParser`): the output's calls become ``message.tool_calls`` (ids
  ``call_<24 hex>``, arguments a JSON string) and the text around them ``content``; streamed, a
  call goes out as one OpenAI tool-call delta once its block is complete, and the text before it
  as content deltas. ``finish_reason`` is ``"tool_calls"`` when the answer holds a call.
- **History**: assistant messages with ``tool_calls`` and ``role: "tool"`` messages are passed
  to the template in the shape transformers' templates take (:func:`template_message`).
"""

from __future__ import annotations

import contextlib
import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from miserver.serving.structured.response_format import unsupported_features
from miserver.spec import codes
from miserver.spec.errors import ApiError

ToolFormat = Literal["hermes", "json"]
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}


def _bad(message: str, param: str) -> ApiError:
    return ApiError(codes.INVALID_REQUEST, message, param=param)


@dataclass(frozen=True)
class ToolSpec:
    """A checked ``tools`` / ``tool_choice`` pair.

    Attributes:
        tools: the function definitions as OpenAI's ``tools`` (what the template is given).
        choice: ``auto``, ``required``, ``none`` or ``function`` (one named function).
        name: the named function when ``choice`` is ``function``.
        parallel: ``parallel_tool_calls`` (default True): several calls in one answer.
    """

    tools: tuple[dict[str, Any], ...]
    choice: Literal["auto", "required", "none", "function"]
    name: str | None = None
    parallel: bool = True

    @property
    def renders_tools(self) -> bool:
        """Whether the template is given the tools (``none`` renders none)."""
        return self.choice != "none" and bool(self.tools)

    @property
    def enforced(self) -> bool:
        """Whether a grammar forces a call (``required`` or a named function)."""
        return self.choice in ("required", "function")

    def allowed(self) -> list[dict[str, Any]]:
        """The functions a call may name (``function`` objects)."""
        functions = [t["function"] for t in self.tools]
        if self.choice == "function":
            return [f for f in functions if f["name"] == self.name]
        return functions


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any = None) -> ToolSpec | None:
    """Check ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (decoded JSON values); None
    when there is nothing to do (no tools; ``tool_choice`` absent or ``"none"``).

    Raises:
        ApiError: 400 INVALID_REQUEST naming the field (``tools[1].function.name``,
            ``tool_choice``): a malformed definition, a duplicate name, an unsupported schema
            feature in ``parameters``, a ``tool_choice`` that is not one of the four shapes or
            names a function not in ``tools``, ``tool_choice`` other than ``none`` without tools.
    """
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None:
        if tool_choice not in (None, "none"):
            raise _bad("tool_choice needs tools: no tools were given", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list of function tools", "tools")
    checked: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(f'{at} must be {{"type": "function", "function": {{...}}}}', f"{at}.type")
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise _bad(f"unsupported field {at}.{extra[0]}", f"{at}.{extra[0]}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _bad(f"{at}.function must be an object", f"{at}.function")
        extra = sorted(set(function) - _FUNCTION_FIELDS)
        if extra:
            raise _bad(f"unsupported field {at}.function.{extra[0]}", f"{at}.function.{extra[0]}")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise _bad(
                f"{at}.function.name must be a name of 1 to 64 characters", f"{at}.function.name"
            )
        if name in names:
            raise _bad(f"{at}.function.name: {name!r} is defined twice", f"{at}.function.name")
        names.add(name)
        if "description" in function and not isinstance(function["description"], str):
            raise _bad(f"{at}.function.description must be a string", f"{at}.function.description")
        if "strict" in function and not isinstance(function["strict"], (bool, type(None))):
            raise _bad(f"{at}.function.strict must be a boolean", f"{at}.function.strict")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise _bad(
                f"{at}.function.parameters must be a JSON Schema object",
                f"{at}.function.parameters",
            )
        unsupported = unsupported_features(parameters, f"{at}.function.parameters")
        if unsupported:
            raise _bad(
                f"unsupported JSON Schema feature at {unsupported[0]}", unsupported[0].split(" ")[0]
            )
        clean = {"name": name, "parameters": parameters}
        if "description" in function:
            clean["description"] = function["description"]
        checked.append({"type": "function", "function": clean})
    if not checked:
        raise _bad("tools must hold at least one tool (leave it out for none)", "tools")
    choice: Any = "auto" if tool_choice is None else tool_choice
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        if (
            choice.get("type") != "function"
            or set(choice) != {"type", "function"}
            or not isinstance(function, dict)
            or set(function) != {"name"}
            or not isinstance(function.get("name"), str)
        ):
            raise _bad(
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        name = function["name"]
        if name not in names:
            raise _bad(
                f"tool_choice names {name!r}, which is not in tools", "tool_choice.function.name"
            )
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise _bad(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if choice == "none":
        return None
    return ToolSpec(tuple(checked), choice, name, parallel_tool_calls is not False)


def tool_format(tokenizer: Any) -> ToolFormat:
    """The tool-call format of the model's chat template (module docstring).

    Raises:
        ApiError: 400 INVALID_REQUEST naming ``tools``: the model has no chat template, or its
            template takes no tools.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the tool one if any
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or "tools" not in template:
        raise _bad(
            "tools: this model's chat template defines no tool-call format, so it cannot be "
            "given tools; leave tools out, or serve a model whose template takes tools "
            "(Qwen2.5, Llama 3.1, Hermes, ...)",
            "tools",
        )
    return "hermes" if HERMES_OPEN in template else "json"


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI history message in the shape transformers' chat templates take: an assistant
    message's ``tool_calls`` with ``function.arguments`` decoded from its JSON string to an
    object (templates write it with ``tojson``), ``tool`` messages with ``tool_call_id`` and
    ``name`` kept; ``content`` always a string."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    calls = message.get("tool_calls")
    if calls:
        converted = []
        for call in calls:
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                with contextlib.suppress(json.JSONDecodeError):  # else kept as the string
                    function["arguments"] = json.loads(arguments) if arguments.strip() else {}
            converted.append({"id": call.get("id"), "type": "function", "function": function})
        out["tool_calls"] = converted
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


# --- the grammar ---------------------------------------------------------------------------------
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _call_schema(spec: ToolSpec, fmt: ToolFormat) -> dict[str, Any]:
    key = "parameters" if fmt == "json" else "arguments"
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for f in spec.allowed()
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": _JSON_STYLE}


def tool_call_grammar(
    spec: ToolSpec, fmt: ToolFormat, answer_schema: dict[str, Any] | None = None
) -> str:
    """The Lark grammar (llguidance's dialect) of a tool answer: one call (several,
    newline-separated, for ``hermes`` with ``parallel_tool_calls``) in the template's format,
    each a JSON object naming an allowed function with arguments valid under its
    ``parameters``. ``answer_schema``: the other answer allowed (``tool_choice`` ``auto`` with a
    ``response_format``: either calls, or a JSON document valid under it)."""
    lines = [f"body: %json {json.dumps(_call_schema(spec, fmt))}"]
    if fmt == "json":
        calls = "body"
    else:
        calls = "call" + (' ("\\n" call)*' if spec.parallel else "")
        lines.append(f'call: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"')
    if answer_schema is not None:
        lines.append(f"answer: %json {json.dumps({**answer_schema, 'x-guidance': _JSON_STYLE})}")
        calls = f"{calls} | answer"
    return "\n".join([f"start: {calls}", *lines]) + "\n"


def tool_constraint(
    spec: ToolSpec,
    fmt: ToolFormat,
    model: Any,
    tokenizer: Any,
    answer_schema: dict[str, Any] | None = None,
) -> Any:
    """The :class:`~miserver.serving.engine.constraints.Constraint` of
    :func:`tool_call_grammar` (seconds the first time for a tokenizer: off the event loop).

    Raises:
        ApiError: 400 INVALID_REQUEST naming ``tools``: the grammar library refuses a
            function's ``parameters`` (its message says why).
    """
    from miserver.serving.engine.constraints import (
        ConstraintError,
        lark_constraint,
        model_vocab_size,
    )

    try:
        return lark_constraint(
            tool_call_grammar(spec, fmt, answer_schema),
            tokenizer,
            model_vocab_size(model, tokenizer),
            f"tool_choice {spec.choice}",
        )
    except ConstraintError as exc:
        raise _bad(f"tools: unsupported parameters schema: {exc}", "tools") from None


# --- the parser -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        """As ``message.tool_calls[i]``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    """``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def _call_from(text: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """Splits a completion's text, fed in pieces, into content and :class:`ToolCall` s.

    :meth:`feed` and :meth:`finish` return the items that are final: ``str`` (content) or
    :class:`ToolCall`. A non-streamed answer feeds its whole text, then finishes: the same
    items as its stream. Content that is only whitespace around calls is dropped; a block that
    is not a valid call of a given function (or never closes) stays content; whitespace just
    before a call is dropped; an answer without
    calls is its text unchanged.
    """

    def __init__(self, spec: ToolSpec, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.names = {f["function"]["name"] for f in spec.tools}
        self.calls = 0
        self._buffer = ""
        self._in_call = False
        self._whitespace = ""  # held: dropped if a call or the end follows
        self._json_mode: bool | None = None  # json format: the answer is a call (starts "{")

    def _content(self, text: str) -> list[str | ToolCall]:
        # Trailing whitespace is held: dropped if a call follows, released with the next text.
        body = text.rstrip()
        if not body:
            self._whitespace += text
            return []
        out, self._whitespace = self._whitespace + body, text[len(body) :]
        return [out]

    def feed(self, text: str) -> list[str | ToolCall]:
        """Items final after ``text``."""
        self._buffer += text
        if self.fmt == "json":
            if self._json_mode is None:
                stripped = self._buffer.lstrip()
                if not stripped:
                    return []
                self._json_mode = stripped.startswith("{")
            if self._json_mode:
                return []  # the whole answer decides: held until finish
            out, self._buffer = self._content(self._buffer), ""
            return out
        out: list[str | ToolCall] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(HERMES_OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buffer, HERMES_OPEN)
                    out += self._content(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                out += self._content(self._buffer[:at])
                self._buffer = self._buffer[at:]
                self._in_call = True
            end = self._buffer.find(HERMES_CLOSE)
            if end < 0:
                return out
            block = self._buffer[: end + len(HERMES_CLOSE)]
            self._buffer = self._buffer[end + len(HERMES_CLOSE) :]
            self._in_call = False
            call = _call_from(block[len(HERMES_OPEN) : -len(HERMES_CLOSE)], self.names)
            if call is None:
                out += self._content(block)
            else:
                self._whitespace = ""
                self.calls += 1
                out.append(call)

    def finish(self) -> list[str | ToolCall]:
        """The items left at the end of the completion."""
        rest, self._buffer = self._buffer, ""
        if self.fmt == "json" and self._json_mode:
            call = _call_from(rest.strip(), self.names)
            if call is not None:
                self.calls += 1
                self._whitespace = ""
                return [call]
        out = self._content(rest)
        if self._whitespace and not self.calls:  # an answer without calls keeps its text whole
            out.append(self._whitespace)
        self._whitespace = ""
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that begins ``marker`` (0 if none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_answer(text: str, spec: ToolSpec, fmt: ToolFormat) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's ``(content, tool_calls)``: content None when the answer is only calls."""
    parser = ToolCallParser(spec, fmt)
    items = parser.feed(text) + parser.finish()
    calls = [i for i in items if isinstance(i, ToolCall)]
    content = "".join(i for i in items if isinstance(i, str))
    return (content or (None if calls else "")), calls
