"""``/v1`` request preparation: a decoded request body becomes a :class:`~miserver.http.v1_admission.Job`
(companion contract 4).

For a chat or a completion request: the strict checks of the body
(:mod:`miserver.http.openai_schema`), admission for a resident (:func:`~miserver.http.v1_admission.admit`),
the prompt's token ids (the chat template, or the raw prompt; in a worker thread), the checks
against the resident's context window and ``MAX_BATCH_SIZE`` (400 INVALID_REQUEST naming the
parameter), the structured-output fields (``response_format``, ``tools``, ``tool_choice``:
:mod:`miserver.serving.structured`, checked before admission, compiled into the request's
grammar after it), and the sampling parameters. Used by :mod:`miserver.http.v1`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from miserver.http import keys
from miserver.http import openai_schema as schema
from miserver.http.v1_admission import Job, admit
from miserver.serving.engine.generation import SamplingParams, context_length
from miserver.serving.engine.prompts import (
    PromptError,
    chat_prompt_ids,
    max_token_chars,
    render_chat,
)
from miserver.serving.engine.slot import Priority
from miserver.serving.models.gguf import json_schema_grammar
from miserver.serving.models.host import Resident
from miserver.serving.structured.request import (
    Structured,
    check_for_model,
    check_request,
    request_constraint,
)
from miserver.serving.structured.response_format import compile_llama_cpp
from miserver.serving.structured.tools import template_message
from miserver.spec import codes
from miserver.spec.errors import ApiError

#: Default ``max_tokens`` of ``/v1/completions`` (OpenAI's).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def bad_request(message: str, param: str | None) -> ApiError:
    """400 INVALID_REQUEST naming ``param``."""
    return ApiError(codes.INVALID_REQUEST, message, param=param)


async def read_body(request: web.Request) -> bytes:
    """The body (413 JSON via the app's limits when too large)."""
    return await request.read()


def _named_adapter(resident: Resident, model: str) -> dict[str, Any] | None:
    """The resident's adapter block when ``model`` names its applied adapter, else None."""
    block = resident.adapter_block
    return block if block and block.get("name") == model else None


def _check_context(
    resident: Resident,
    prompt_ids: list[int],
    max_tokens: int | None,
    default: int | None,
    param: str,
    prompt_param: str,
) -> int:
    context = context_length(resident.model)
    n = len(prompt_ids)
    if n >= context:
        raise bad_request(
            f"the prompt is {n} tokens; the context window of {resident.served_name} is "
            f"{context} tokens",
            prompt_param,
        )
    if max_tokens is None:
        return min(default, context - n) if default is not None else context - n
    if max_tokens > context:
        raise bad_request(
            f"{param} must be at most the context window ({context}), got {max_tokens}", param
        )
    if n + max_tokens > context:
        raise bad_request(
            f"the prompt ({n} tokens) plus {param} ({max_tokens}) exceeds the context "
            f"window of {context} tokens",
            param,
        )
    return max_tokens


def _check_length(resident: Resident, text: str, prompt_param: str) -> None:
    """Refuse, before tokenizing, a text too long for any tokenization of it to fit.

    A token covers at most :func:`~miserver.serving.engine.prompts.max_token_chars` characters, so a
    text of more than ``context * max_token_chars`` characters is more than ``context`` tokens:
    the 400 the context check would give after tokenizing (~10 CPU-seconds for 8 MB), at once.
    """
    per_token = max_token_chars(resident.tokenizer)
    if per_token is None:
        return
    context = context_length(resident.model)
    if len(text) > context * per_token:
        raise bad_request(
            f"the prompt is {len(text)} characters, more than the context window of "
            f"{resident.served_name} ({context} tokens of at most {per_token} characters) "
            "can hold",
            prompt_param,
        )


def _template_message(m: schema.ChatMessage) -> dict[str, Any]:
    """One message as chat templates take it (``developer`` as ``system``; an assistant's
    ``tool_calls`` and a ``tool`` message's ``tool_call_id`` in transformers' shape)."""
    message: dict[str, Any] = {
        "role": "system" if m.role == "developer" else m.role,
        "content": schema.message_text(m),
    }
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": c.type, "function": msgspec.to_builtins(c.function)}
            for c in m.tool_calls
        ]
    if m.role == "tool":
        message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
    return template_message(message) if m.tool_calls else message


def _chat_prompt(
    resident: Resident, req: schema.ChatCompletionRequest, structured: Structured
) -> list[int]:
    """The prompt ids of a chat request: the chat template (given the request's tools unless
    ``tool_choice`` is ``none``), message content as text
    (:func:`~miserver.serving.engine.prompts.chat_prompt_ids`). Runs in a worker thread."""
    tok = resident.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise bad_request(
            f"model {resident.served_name} has no chat template; use /v1/completions", "messages"
        )
    messages = [_template_message(m) for m in req.messages]
    tools = list(structured.tools.tools) if structured.tools is not None else None
    try:
        text = render_chat(tok, messages, tools)
        _check_length(resident, text, "messages")
        return chat_prompt_ids(tok, messages, text, tools)
    except PromptError as exc:
        raise bad_request(str(exc), "messages") from None


async def _constraint(resident: Resident, structured: Structured) -> Any:
    """The request's grammar for this resident, or None: on a transformers resident
    :func:`request_constraint` (in a worker thread: llguidance's view of a tokenizer costs
    seconds the first time); on a GGUF resident (``response_format`` only: tools were refused
    by :func:`_check_gguf_tools`) llama.cpp's own JSON-schema grammar
    (:func:`~miserver.serving.structured.response_format.compile_llama_cpp`)."""
    if not structured.any:
        return None
    if resident.kind == "gguf":  # llama.cpp samples, under its own JSON-schema grammar
        _check_gguf_tools(resident, structured)
        assert structured.output is not None
        return await asyncio.to_thread(
            compile_llama_cpp, structured.output, "response_format", json_schema_grammar
        )
    return await asyncio.to_thread(
        request_constraint, structured, resident.model, resident.tokenizer
    )


def _check_gguf_tools(resident: Resident, structured: Structured) -> None:
    """Refuse ``tools`` on a GGUF resident (before the template's tool format is looked at):
    miserver's tool-call grammars and parsers need its own sampler, which llama.cpp is not.

    Raises:
        ApiError: 400 INVALID_REQUEST naming ``tools``.
    """
    if resident.kind == "gguf" and structured.tools is not None:
        raise bad_request(
            f"tools (tool calls) are not available on {resident.served_name}: it is a GGUF "
            "model served by llama.cpp, where miserver's tool-call grammar cannot steer the "
            "sampler; use a safetensors row (response_format works on both)",
            "tools",
        )


def _completion_prompt(resident: Resident, prompt: schema.PromptSpec) -> list[int]:
    """The prompt ids of a completion request. A string prompt is the caller's raw text, its
    special-token strings parsed as control tokens (docs/decisions.md). Runs in a worker
    thread."""
    tok = resident.tokenizer
    if isinstance(prompt, str):
        _check_length(resident, prompt, "prompt")
        ids = list(tok(prompt)["input_ids"])
    else:
        vocab = len(tok)
        bad = next((t for t in prompt if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (size {vocab})", "prompt")
        ids = list(prompt)
    if not ids:
        bos = getattr(tok, "bos_token_id", None)
        if bos is None:
            raise bad_request("the prompt is empty", "prompt")
        ids = [bos]
    return ids


def check_n(app: web.Application, req: Any) -> None:
    """``n`` within 1..``MAX_BATCH_SIZE`` (contract 4: the choices of one request are granted
    together and share one prefill), checked before admission.

    Raises:
        ApiError: 400 INVALID_REQUEST naming ``n``.
    """
    limit = app[keys.SCHEDULER].max_batch_size
    if req.n is not None and not 1 <= req.n <= limit:
        raise bad_request(
            f"n must be between 1 and {limit} (MAX_BATCH_SIZE: the choices of one request are "
            f"decoded together in one batch), got {req.n}",
            "n",
        )


def _sampling(
    req: Any,
    stops: tuple[str, ...],
    max_tokens: int,
    logprobs: int | None,
    echo: bool,
    constraint: Any = None,
) -> SamplingParams:
    return SamplingParams(
        constraint=constraint,
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        seed=req.seed,
        stop=stops,
        logprobs=logprobs,
        echo=echo,
    )


async def prepare_chat(
    app: web.Application,
    req: schema.ChatCompletionRequest,
    load_policy: str | None,
    priority: Priority = Priority.INTERACTIVE,
    may_load: bool = True,
) -> Job:
    stops = schema.check_chat(req)
    structured = check_request(
        req.response_format, req.tools, req.tool_choice, req.parallel_tool_calls
    )
    resident = await admit(app, req.model, load_policy, priority, may_load=may_load)
    adapter = _named_adapter(resident, req.model)
    _check_gguf_tools(resident, structured)
    structured = check_for_model(structured, resident.tokenizer)
    prompt_ids = await asyncio.to_thread(_chat_prompt, resident, req, structured)
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = _check_context(resident, prompt_ids, given, None, param, "messages")
    want = bool(req.logprobs)
    logprobs = (req.top_logprobs or 0) if want else None
    constraint = await _constraint(resident, structured)
    return Job(
        "chat",
        resident,
        prompt_ids,
        _sampling(req, stops, max_tokens, logprobs, False, constraint),
        bool(req.stream),
        bool(req.stream_options and req.stream_options.include_usage),
        None,
        want,
        adapter,
        req.n or 1,
        req.model,
        structured if structured.any else None,
    )


async def prepare_completion(
    app: web.Application,
    req: schema.CompletionRequest,
    load_policy: str | None,
    priority: Priority = Priority.INTERACTIVE,
    may_load: bool = True,
) -> Job:
    prompt, stops = schema.check_completion(req)
    structured = check_request(req.response_format)
    resident = await admit(app, req.model, load_policy, priority, may_load=may_load)
    adapter = _named_adapter(resident, req.model)
    prompt_ids = await asyncio.to_thread(_completion_prompt, resident, prompt)
    max_tokens = _check_context(
        resident, prompt_ids, req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, "max_tokens", "prompt"
    )
    echo = bool(req.echo)
    echo_text = None
    if echo:
        echo_text = prompt if isinstance(prompt, str) else resident.tokenizer.decode(prompt_ids)
    want = req.logprobs is not None
    if echo and want and resident.kind == "gguf":
        raise bad_request(
            f"echo with logprobs (the prompt's logprobs) is not available on "
            f"{resident.served_name}: it is a GGUF model served by llama.cpp, which does not "
            "score the prompt; drop echo or logprobs",
            "echo",
        )
    constraint = await _constraint(resident, structured)
    return Job(
        "completion",
        resident,
        prompt_ids,
        _sampling(req, stops, max_tokens, req.logprobs, echo and want, constraint),
        bool(req.stream),
        bool(req.stream_options and req.stream_options.include_usage),
        echo_text,
        want,
        adapter,
        req.n or 1,
        req.model,
    )
