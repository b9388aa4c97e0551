"""``/v1``'s OpenAI rendering: a finished generation as a ``chat.completion`` or
``text_completion`` body, or streamed as server-sent events ending ``data: [DONE]``; logprobs in
OpenAI's two shapes, usage, finish reasons, and the 500 GENERATION_FAILED of a failed generation
(companion contract 4). Used by :mod:`miserver.http.v1`.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from miserver.http import keys
from miserver.http.errors import openai_error_body
from miserver.http.model_header import (
    HEADER,
    model_header,
    response_model_header,
    spans_extra,
)
from miserver.http.v1_admission import Job, RequestCancelled
from miserver.http.v1_structured import ChoiceDeltas, chat_message
from miserver.serving.engine.generation import (
    Finished,
    GenerationError,
    NonFiniteLogits,
    Started,
    TextDelta,
    TokenLogprob,
)
from miserver.spec import codes
from miserver.spec.errors import ApiError

log = logging.getLogger("miserver.v1")

_encoder = msgspec.json.Encoder()


OUTCOME = web.RequestKey("millm_outcome", str)  # how a stream that opened ended
DISCONNECTED = "CLIENT_DISCONNECTED"


def _completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# --- logprobs shapes ---------------------------------------------------------------------------
def _chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    """One ``content`` entry of chat logprobs; ``bytes`` (its own and each alternative's) are
    the token's raw bytes (part of a character for a byte-fragment token, e.g. ``[148]``)."""
    return {
        "token": lp.text,
        "logprob": lp.logprob,
        "bytes": list(lp.bytes),
        "top_logprobs": [
            {"token": text, "logprob": value, "bytes": list(raw)} for _i, text, value, raw in lp.top
        ],
    }


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (added tokens marked special, and the named
    ones): the tokens a completion's text leaves out (``skip_special_tokens``)."""
    ids = {
        int(i)
        for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
        if getattr(t, "special", False)
    }
    ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", None) or ())
    return frozenset(ids)


class _CompletionLogprobs:
    """OpenAI's legacy ``logprobs`` object, one block per answer or per streamed chunk.

    ``text_offset`` counts characters of the returned ``text`` (echoed prompt and completion),
    across the blocks of one answer: a token's offset is the number of whole characters its
    predecessors' bytes make, so the byte-fragment tokens of one character all have that
    character's offset (OpenAI's rule). A special token stands for its content when the text
    holds it there (a control token written in an echoed prompt), and for nothing otherwise (a
    BOS the tokenizer added, a special token generated: the completion's text skips them).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._specials = special_token_ids(tokenizer)
        self._text = ""
        self._chars = 0  # whole characters the tokens so far make
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _offset(self, lp: TokenLogprob) -> int:
        offset = self._chars
        if lp.token_id in self._specials:
            if lp.text and self._text.startswith(lp.text, offset):
                self._chars += len(lp.text)
        else:
            self._chars += len(self._utf8.decode(lp.bytes))
        return min(offset, len(self._text))

    def block(
        self, entries: tuple[TokenLogprob, ...] | list[TokenLogprob], text: str
    ) -> dict[str, Any]:
        """The block of ``entries``, whose text (this block's part of ``text``) is ``text``."""
        self._text += text
        tokens, token_logprobs, top, offsets = [], [], [], []
        for lp in entries:
            tokens.append(lp.text)
            token_logprobs.append(lp.logprob)
            top.append(
                {text: value for _i, text, value, _b in lp.top}
                if lp.logprob is not None or lp.top
                else None
            )
            offsets.append(self._offset(lp))
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }


def _usage(fins: list[Finished]) -> dict[str, int]:
    """OpenAI's usage of one request: the prompt once, the completion tokens of every choice."""
    prompt = fins[0].prompt_tokens
    completion = sum(fin.completion_tokens for fin in fins)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _finish_reason(fin: Finished, called: bool = False) -> str:
    """``length``, ``tool_calls`` (the answer ended holding a tool call) or ``stop``."""
    if fin.finish_reason == "length":
        return "length"
    return "tool_calls" if called else "stop"


def generation_failed(app: web.Application, job: Job, exc: GenerationError) -> ApiError:
    """The 500 GENERATION_FAILED of a generation that failed, counted in
    ``miserver_generation_failures_total{reason}`` and logged once. Non-finite logits (the
    weights hold NaN or infinity: issue 16 item 10) are reason ``non_finite_logits``, logged
    as an error naming the served parameter set and what to do; any other failure ``error``."""
    if isinstance(exc.__cause__, ApiError):  # a refusal that ended it (a parked sequence on a
        return exc.__cause__  # torn set: 503 WEIGHTS_TORN, as a held request gets; contract 4b)
    non_finite = isinstance(exc.__cause__, NonFiniteLogits)
    reason = "non_finite_logits" if non_finite else "error"
    metrics = app.get(keys.METRICS)
    if metrics is not None:
        metrics.generation_failures.labels(reason=reason).inc()
    if non_finite:
        log.error(
            "generation failed: non-finite logits (NaN or infinity) from %s; the served weights "
            "hold non-finite values: load finite weights (POST /api/weights/load)",
            model_header(job.resident),
        )
        message = f"{job.resident.served_name}: {exc.__cause__}"
        return ApiError(codes.GENERATION_FAILED, message, reason=reason)
    return ApiError(codes.GENERATION_FAILED, str(exc), reason=reason)


async def _choice(events: Any) -> tuple[str, list[TokenLogprob], Finished]:
    text_parts: list[str] = []
    lps: list[TokenLogprob] = []
    fin: Finished | None = None
    async for ev in events:
        if isinstance(ev, TextDelta):
            text_parts.append(ev.text)
            lps.extend(ev.logprobs)
        elif isinstance(ev, Finished):
            fin = ev
    assert fin is not None
    return "".join(text_parts), lps, fin


async def collect(
    app: web.Application, job: Job, events: list[Any], firsts: list[Started]
) -> dict[str, Any]:
    """The non-streamed body of a request: one choice per sequence (``choices[i].index`` is
    ``i``), usage summed over the choices (contract 4).

    Raises:
        ApiError: 500 GENERATION_FAILED.
        RequestCancelled: a choice was cancelled (the client went away).
    """
    body, _fins = await _collect(app, job, events, firsts)
    return body


async def collect_with_header(
    app: web.Application, job: Job, events: list[Any], firsts: list[Started], header: str
) -> tuple[dict[str, Any], str]:
    """:func:`collect`, and the response's ``X-miLLM-Model``: ``header`` (the set the request
    was admitted on) unless a choice spans sets (contract 4: then the set of the last token,
    with ``from_commits`` the set of the first). Raises as :func:`collect`."""
    body, fins = await _collect(app, job, events, firsts)
    if any(fin.weight_spans for fin in fins):
        header = response_model_header(job.resident, [fin.weight_spans for fin in fins])
    return body, header


async def _collect(
    app: web.Application, job: Job, events: list[Any], firsts: list[Started]
) -> tuple[dict[str, Any], list[Finished]]:
    try:
        results = await asyncio.gather(*(_choice(stream) for stream in events))
    except GenerationError as exc:
        raise generation_failed(app, job, exc) from exc
    if any(fin.finish_reason == "cancelled" for _t, _l, fin in results):
        raise RequestCancelled
    created = int(time.time())
    name = job.resident.served_name
    fins = [fin for _t, _l, fin in results]
    choices = []
    for index, ((text, lps, fin), first) in enumerate(zip(results, firsts, strict=True)):
        if job.kind == "chat":
            message, called = chat_message(text, job.structured)
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": {"content": [_chat_logprob(lp) for lp in lps], "refusal": None}
                    if job.want_logprobs
                    else None,
                    "finish_reason": _finish_reason(fin, called),
                    **spans_extra(fin.weight_spans),
                }
            )
            continue
        logprobs = None
        if job.want_logprobs:
            block = _CompletionLogprobs(job.resident.tokenizer)
            entries = list(first.prompt_logprobs or ()) + lps
            logprobs = block.block(entries, (job.echo_text or "") + text)
        choices.append(
            {
                "index": index,
                "text": (job.echo_text or "") + text,
                "logprobs": logprobs,
                "finish_reason": _finish_reason(fin),
                **spans_extra(fin.weight_spans),
            }
        )
    chat = job.kind == "chat"
    body = {
        "id": _completion_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": name,
        "system_fingerprint": None,
        "choices": choices,
        "usage": _usage(fins),
    }
    return body, fins


def _sse(payload: Any) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


async def _merged(events: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """The events of every choice as ``(index, event)``, in the order they come; a choice's
    :class:`GenerationError` is raised (the others are stopped by the caller)."""
    if len(events) == 1:
        async for ev in events[0]:
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    end = object()

    async def pump(index: int, stream: Any) -> None:
        try:
            async for ev in stream:
                await queue.put((index, ev))
        except GenerationError as exc:
            await queue.put((index, exc))
        await queue.put((index, end))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(events)]
    try:
        open_streams = len(tasks)
        while open_streams:
            index, ev = await queue.get()
            if ev is end:
                open_streams -= 1
            elif isinstance(ev, GenerationError):
                raise ev
            else:
                yield index, ev
    finally:
        for task in tasks:
            task.cancel()


async def _chain(
    first: tuple[int, Any] | None, rest: AsyncIterator[tuple[int, Any]]
) -> AsyncIterator[tuple[int, Any]]:
    """``first`` (when there is one), then what ``rest`` yields; closing it closes ``rest``."""
    try:
        if first is not None:
            yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


async def stream_response(request: web.Request, job: Job, running: Any) -> web.StreamResponse:
    """Stream a request's choices as server-sent events (contract 4): each chunk carries one
    choice's ``index``; each choice ends with its own chunk carrying its ``finish_reason`` and
    ``millm_model``; then the usage chunk (``stream_options.include_usage``, summed over the
    choices) and ``data: [DONE]``. The stream opens once the first token is out: a generation
    error before it (the prompt's pass, the first token's logits) is the JSON 500
    ``generation_failed`` (raised as :class:`ApiError`; docs/openai-compatibility.md, issue 32
    item 13); one after it ends the stream with one error event."""
    header = running.header
    firsts: list[Started] = running.firsts
    merged_events = _merged(running.events)
    try:
        opening: tuple[int, Any] | None = await merged_events.__anext__()
    except StopAsyncIteration:
        opening = None
    except GenerationError as exc:
        await merged_events.aclose()
        running.cancel()
        await running.wait()  # the slot is free before the client sees the answer
        request[OUTCOME] = codes.GENERATION_FAILED.name
        raise generation_failed(request.app, job, exc) from None
    except BaseException:
        await merged_events.aclose()
        raise
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            HEADER: header,
        }
    )
    await resp.prepare(request)
    created = int(time.time())
    name = job.resident.served_name
    chat = job.kind == "chat"
    cid = _completion_id("chatcmpl" if chat else "cmpl")
    obj = "chat.completion.chunk" if chat else "text_completion"
    lp_blocks = [_CompletionLogprobs(job.resident.tokenizer) for _ in firsts]
    deltas = [ChoiceDeltas(job.structured) for _ in firsts]  # chat: content and tool calls

    def chunk(choice: dict[str, Any] | None, **extra: Any) -> bytes:
        body: dict[str, Any] = {
            "id": cid,
            "object": obj,
            "created": created,
            "model": name,
            "system_fingerprint": None,
            "choices": [choice] if choice is not None else [],
        }
        body.update(extra)
        return _sse(body)

    def delta_choice(
        index: int,
        text: str,
        lps: tuple[TokenLogprob, ...] | list[TokenLogprob],
        finish: str | None = None,
        role: bool = False,
        delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if chat:
            if delta is None:
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if text or role:
                    delta["content"] = text
            logprobs = (
                {"content": [_chat_logprob(lp) for lp in lps], "refusal": None}
                if job.want_logprobs and lps
                else None
            )
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        block = lp_blocks[index]
        logprobs = block.block(lps, text) if job.want_logprobs and (lps or text) else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    request[OUTCOME] = "served"
    try:
        for index, first in enumerate(firsts):
            if chat:
                await resp.write(chunk(delta_choice(index, "", (), role=True)))
            elif job.echo_text is not None:
                await resp.write(
                    chunk(delta_choice(index, job.echo_text, first.prompt_logprobs or ()))
                )
        fins: dict[int, Finished] = {}
        try:
            async with contextlib.aclosing(_chain(opening, merged_events)) as merged:
                async for index, ev in merged:
                    if isinstance(ev, TextDelta):
                        if chat:
                            pieces = deltas[index].feed(ev.text) if ev.text else []
                            if not pieces and ev.logprobs:
                                pieces = [{}]  # the text is held (maybe a tool call)
                            for i, piece in enumerate(pieces):
                                lps = ev.logprobs if i == 0 else ()
                                await resp.write(chunk(delta_choice(index, "", lps, delta=piece)))
                        elif ev.text or ev.logprobs:
                            await resp.write(chunk(delta_choice(index, ev.text, ev.logprobs)))
                    elif isinstance(ev, Finished):
                        fins[index] = ev
                        if ev.finish_reason == "cancelled":
                            break
                        if chat:
                            for piece in deltas[index].finish():
                                await resp.write(chunk(delta_choice(index, "", (), delta=piece)))
                        if len(fins) == len(firsts):
                            await running.wait()  # the slot is free before the client sees the end
                        called = chat and deltas[index].calls > 0
                        final = delta_choice(index, "", (), finish=_finish_reason(ev, called))
                        if not chat:
                            final["logprobs"] = None
                        final.update(spans_extra(ev.weight_spans))  # contract 4
                        # the set of this choice's last token (and its first, when another)
                        said = (
                            response_model_header(job.resident, [ev.weight_spans])
                            if ev.weight_spans
                            else header
                        )
                        await resp.write(chunk(final, millm_model=said))
        except GenerationError as exc:
            err = generation_failed(request.app, job, exc)
            log.warning("stream ended by a generation error: %s", exc)
            request[OUTCOME] = codes.GENERATION_FAILED.name
            running.cancel()
            await running.wait()  # the slot is free before the client sees the end
            await resp.write(_sse(openai_error_body(err)))
            await resp.write_eof()
            return resp
        if any(fin.finish_reason == "cancelled" for fin in fins.values()):
            running.cancel()
            request[OUTCOME] = DISCONNECTED
            return resp
        if job.include_usage:
            spans = [fins[i].weight_spans for i in sorted(fins)]
            said = response_model_header(job.resident, spans) if any(spans) else header
            await resp.write(
                chunk(None, usage=_usage([fins[i] for i in sorted(fins)]), millm_model=said)
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionError:  # the client went away mid-stream
        running.cancel()
        request[OUTCOME] = DISCONNECTED
    except asyncio.CancelledError:
        running.cancel()
        raise
    return resp
