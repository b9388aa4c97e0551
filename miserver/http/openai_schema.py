"""The request bodies of ``/v1`` (OpenAI-compatible) and their strict validation (contract 4).

Bodies are decoded with msgspec into the Structs below, strictly: a boolean is not an integer, a
string is not a number, ``1.0`` is not an integer. No OpenAI field is silently ignored (issue
33): each is honoured, or accepted only at the values that change nothing (``frequency_penalty``
0, ``modalities`` ``["text"]``, ...: :data:`ONLY_WHEN`), any other value a 400 naming it; any
field OpenAI does not define is a 400 naming it. Range checks that need no model (``temperature`` 0..2, ``top_p`` (0, 1], ``n`` at least 1 (its upper bound, ``MAX_BATCH_SIZE``, is a setting: checked by the route),
at most 4 non-empty stop sequences, ...) are made here; checks against the model's context window
are made by :mod:`miserver.http.v1` once the prompt is tokenized.

Every refusal is an :class:`~miserver.spec.errors.ApiError` with code ``INVALID_REQUEST`` (400)
and ``param`` naming the field (``messages[2].role``), raised before anything is queued.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from miserver.spec import codes
from miserver.spec.errors import ApiError
from miserver.spec.json_syntax import decode_error_message, plain_validation_message

#: Seeds a ``torch.Generator`` accepts.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_STOP_SEQUENCES = 4
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices.
    ``include_obfuscation`` (OpenAI's padding of stream chunks) only false: none is added."""

    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    """A content part. Only ``{"type": "text", "text": ...}`` is supported (text models)."""

    type: Literal["text"]
    text: str


class ToolCallFunction(msgspec.Struct, forbid_unknown_fields=True):
    """``tool_calls[i].function`` of an assistant message: ``arguments`` is JSON text."""

    name: str
    arguments: str


class MessageToolCall(msgspec.Struct, forbid_unknown_fields=True):
    """One call an assistant message made (its ``id`` is what a ``tool`` message answers)."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One message. Roles: system, developer (treated as system), user, assistant, tool (the
    result of an assistant's call: ``tool_call_id`` names it)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # OpenAI's other assistant-message fields: a refusal is history text the template cannot
    # show (accepted only null); audio and the deprecated function_call are a 400.
    refusal: str | None = None
    function_call: Any = None
    audio: Any = None


class ChatCompletionRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/chat/completions``."""

    model: str
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Defined by OpenAI; accepted only at the values that change nothing (ONLY_WHEN).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a one-element
    list of either (one prompt per request: ``n`` is 1)."""

    model: str
    prompt: Any
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    response_format: Any = None
    # Defined by OpenAI; accepted only at the values that change nothing (ONLY_WHEN).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None


#: The OpenAI fields miserver does not act on, with the values accepted because they change
#: nothing (None, the field's absence, always is); any other value is a 400 naming the field
#: and saying why (docs/openai-compatibility.md, "Fields"). ``user``, ``safety_identifier``
#: and ``prompt_cache_key`` are not here: they identify the caller or a cache bucket and never
#: change an answer (also at OpenAI), so every value is accepted.
ONLY_WHEN: dict[str, tuple[Any, str]] = {
    "frequency_penalty": (
        lambda v: v == 0,
        "penalties are not implemented; send 0 or leave it out",
    ),
    "presence_penalty": (lambda v: v == 0, "penalties are not implemented; send 0 or leave it out"),
    "logit_bias": (lambda v: not v, "logit_bias is not implemented; send {} or leave it out"),
    "metadata": (lambda v: not v, "miserver stores no completions (store is not supported)"),
    "store": (lambda v: v is False, "miserver stores no completions; send false or leave it out"),
    "service_tier": (
        lambda v: v in ("auto", "default"),
        "miserver has one service tier: send auto or default, or leave it out",
    ),
    "functions": (lambda v: False, "functions is deprecated by OpenAI: send tools"),
    "function_call": (lambda v: False, "function_call is deprecated by OpenAI: send tool_choice"),
    "modalities": (lambda v: v == ["text"], 'only text output: send ["text"] or leave it out'),
    "audio": (lambda v: False, "audio output is not supported (text models)"),
    "prediction": (lambda v: False, "predicted outputs are not supported"),
    "reasoning_effort": (lambda v: False, "reasoning_effort is for OpenAI's reasoning models"),
    "verbosity": (lambda v: False, "verbosity is for OpenAI's reasoning models"),
    "web_search_options": (lambda v: False, "web search is not supported"),
    "suffix": (lambda v: v == "", "suffix (insertion) is not supported; leave it out"),
}


def check_only_when(req: Any) -> None:
    """Refuse an OpenAI field miserver does not act on, sent with a value that would change
    the answer (:data:`ONLY_WHEN`), and the same on messages and ``stream_options``.

    Raises:
        ApiError: 400 INVALID_REQUEST naming the field.
    """
    for name, (accepted, why) in ONLY_WHEN.items():
        value = getattr(req, name, None)
        if value is not None and not accepted(value):
            raise _bad(f"unsupported value of {name}: {why}", name)
    options = req.stream_options
    if options is not None and options.include_obfuscation:
        raise _bad(
            "stream_options.include_obfuscation: miserver adds no obfuscation; send false",
            "stream_options.include_obfuscation",
        )
    for i, message in enumerate(getattr(req, "messages", None) or ()):
        for name, why in (
            ("refusal", "a refusal cannot be shown to the model; put it in content"),
            ("audio", "audio is not supported (text models)"),
            ("function_call", "function_call is deprecated by OpenAI: send tool_calls"),
        ):
            if getattr(message, name) is not None:
                raise _bad(f"unsupported messages[{i}].{name}: {why}", f"messages[{i}].{name}")


_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`")
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(codes.INVALID_REQUEST, message, param=param)


def _param_of(message: str) -> tuple[str, str | None]:
    """Split msgspec's ``... - at `$.a[0].b``` into (message, ``a[0].b``)."""
    path = None
    match = _AT.search(message)
    if match:
        message = message[: match.start()]
        path = match.group("path").lstrip(".") or None
    for pattern in (_UNKNOWN, _MISSING):
        m = pattern.search(message)
        if m:
            path = f"{path}.{m.group('field')}" if path else m.group("field")
    return message, path


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode a request body into ``kind`` strictly.

    Raises:
        ApiError: 400 INVALID_REQUEST: not JSON, not an object, a wrong type, an unknown field
            (named, and said to be unsupported), a missing required field.
    """
    if not body.strip():
        raise _bad("the request body is empty; send a JSON object", None)
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message, param = _param_of(str(exc))
        if message.startswith("Expected `object`") and param is None:
            raise _bad("the request body must be a JSON object", None) from None
        if _UNKNOWN.search(message):
            raise _bad(
                f"unsupported field {param!r}: it is not an OpenAI "
                f"{'chat completion' if kind is ChatCompletionRequest else 'completion'}"
                " request field",
                param,
            ) from None
        if message.startswith("Invalid enum value") and param and param.endswith(".role"):
            raise _bad(
                f"{message.replace('Invalid enum value', 'unsupported role')} at {param}: "
                "roles are system, developer, user, assistant and tool",
                param,
            ) from None
        if (
            message.startswith("Invalid enum value")
            and param
            and param.endswith(".type")
            and ".content" in param
        ):
            raise _bad(
                f"unsupported content part type at {param}: only text parts are supported", param
            ) from None
        raise _bad(plain_validation_message(message, param), param) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _bad(decode_error_message(body, exc), None) from None


# --- shared range checks --------------------------------------------------------------------
def check_common(req: ChatCompletionRequest | CompletionRequest) -> tuple[str, ...]:
    """Range checks shared by both routes; returns the stop sequences as a tuple.

    Raises:
        ApiError: 400 INVALID_REQUEST naming the field.
    """
    if not req.model.strip():
        raise _bad("model must name a served model or a catalogue row", "model")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise _bad(f"temperature must be between 0 and 2, got {req.temperature}", "temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise _bad(f"top_p must be greater than 0 and at most 1, got {req.top_p}", "top_p")
    if req.n is not None and req.n < 1:
        raise _bad(f"n must be at least 1, got {req.n}", "n")
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
        raise _bad(f"seed must be within [{SEED_MIN}, {SEED_MAX}]", "seed")
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options is only allowed when stream is true", "stream_options")
    check_only_when(req)
    stops: tuple[str, ...]
    if req.stop is None:
        stops = ()
    elif isinstance(req.stop, str):
        stops = (req.stop,)
    else:
        stops = tuple(req.stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise _bad(f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise _bad("stop sequences must not be empty strings", "stop")
    return stops


def _check_max_tokens(value: int | None, param: str) -> None:
    if value is not None and value < 1:
        raise _bad(f"{param} must be at least 1, got {value}", param)


def message_text(message: ChatMessage) -> str:
    """The text of one message (content parts joined)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def check_chat(req: ChatCompletionRequest) -> tuple[str, ...]:
    """All model-independent checks of a chat request; returns its stop sequences.

    Raises:
        ApiError: 400 INVALID_REQUEST naming the field (an empty ``messages`` list, a non-
            assistant message without content, both max_tokens and max_completion_tokens, ...).
    """
    stops = check_common(req)
    if not req.messages:
        raise _bad("messages must hold at least one message", "messages")
    for i, message in enumerate(req.messages):
        if message.content is None and message.role != "assistant":
            raise _bad(
                f"messages[{i}].content is required for role {message.role}",
                f"messages[{i}].content",
            )
        if message.content is None and message.tool_calls is None:
            raise _bad(f"messages[{i}].content is required", f"messages[{i}].content")
        if message.tool_calls is not None and message.role != "assistant":
            raise _bad(
                f"messages[{i}].tool_calls is only for role assistant", f"messages[{i}].tool_calls"
            )
        if message.role == "tool" and not message.tool_call_id:
            raise _bad(
                f"messages[{i}].tool_call_id is required for role tool (the id of the call "
                "it answers)",
                f"messages[{i}].tool_call_id",
            )
        if message.role != "tool" and message.tool_call_id is not None:
            raise _bad(
                f"messages[{i}].tool_call_id is only for role tool", f"messages[{i}].tool_call_id"
            )
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise _bad(
            "give one of max_tokens and max_completion_tokens, not both", "max_completion_tokens"
        )
    _check_max_tokens(req.max_tokens, "max_tokens")
    _check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_CHAT_TOP_LOGPROBS:
            raise _bad(
                f"top_logprobs must be between 0 and {MAX_CHAT_TOP_LOGPROBS}, got "
                f"{req.top_logprobs}",
                "top_logprobs",
            )
        if not req.logprobs:
            raise _bad("top_logprobs needs logprobs set to true", "top_logprobs")
    return stops


PromptSpec = str | list[int]


def check_completion(req: CompletionRequest) -> tuple[PromptSpec, tuple[str, ...]]:
    """All model-independent checks of a completion request; returns ``(prompt, stops)``.

    ``prompt`` is a string or a list of token ids (a one-element list is unwrapped).

    Raises:
        ApiError: 400 INVALID_REQUEST naming the field.
    """
    stops = check_common(req)
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt:
            raise _bad("prompt must not be an empty list", "prompt")
        if all(isinstance(t, str) for t in prompt) or all(isinstance(t, list) for t in prompt):
            raise _bad(
                "prompt: one prompt per request (n asks for several choices of it); send the prompts "
                "as separate requests",
                "prompt",
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise _bad(
                "prompt must be a string or a list of non-negative integer token ids", "prompt"
            )
    elif not isinstance(prompt, str):
        raise _bad("prompt must be a string or a list of integer token ids", "prompt")
    _check_max_tokens(req.max_tokens, "max_tokens")
    if req.best_of is not None and req.best_of != 1:
        raise _bad(f"best_of must be 1, got {req.best_of}", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise _bad(
            f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {req.logprobs}",
            "logprobs",
        )
    return prompt, stops


def check_body(endpoint: str, body: Any) -> None:
    """Every check ``endpoint`` (``/v1/chat/completions`` or ``/v1/completions``) makes of a
    decoded JSON ``body`` before it looks at a model: the strict schema (:func:`decode`) and
    :func:`check_chat` / :func:`check_completion`. A Batch input line's body is checked so at
    upload (contract 7; issue 32, item 13); what needs the model (the context window, ``n``
    against ``MAX_BATCH_SIZE``, the model's name) is checked when the row runs.

    Raises:
        ApiError: 400 INVALID_REQUEST naming the field, as the route would answer.
        ValueError: ``endpoint`` is neither route.
    """
    if endpoint == "/v1/chat/completions":
        check_chat(decode(msgspec.json.encode(body), ChatCompletionRequest))
    elif endpoint == "/v1/completions":
        check_completion(decode(msgspec.json.encode(body), CompletionRequest))
    else:
        raise ValueError(f"no request body is defined for {endpoint!r}")
