"""``/v1/chat/completions``' rendering of tool calls (issue 33): a finished choice's text as
``message.content`` + ``message.tool_calls``, and a streamed choice's text as OpenAI content and
tool-call deltas (:mod:`miserver.serving.structured.tools` parses). Used by
:mod:`miserver.http.v1_rendering`.
"""

from __future__ import annotations

from typing import Any

from miserver.serving.structured.request import Structured
from miserver.serving.structured.tools import ToolCall, ToolCallParser, parse_answer


def parses_tools(structured: Structured | None) -> bool:
    """Whether a chat choice's text is parsed for tool calls."""
    return structured is not None and structured.tools is not None


def chat_message(text: str, structured: Structured | None) -> tuple[dict[str, Any], bool]:
    """``(message, called)``: the ``chat.completion`` message of a choice whose text is
    ``text``, and whether it holds tool calls (``finish_reason`` ``tool_calls``)."""
    if not parses_tools(structured):
        return {"role": "assistant", "content": text, "refusal": None}, False
    assert structured is not None and structured.tools is not None
    assert structured.tool_format is not None
    content, calls = parse_answer(text, structured.tools, structured.tool_format)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = [call.openai() for call in calls]
    return message, bool(calls)


class ChoiceDeltas:
    """One streamed choice's ``delta`` objects from its text pieces: content as it becomes
    final, each tool call as one delta once its block is complete (``index``, ``id``, ``type``,
    ``function.name`` and the whole ``function.arguments``: the SDK's stream helpers
    assemble it)."""

    def __init__(self, structured: Structured | None) -> None:
        self._parser: ToolCallParser | None = None
        if parses_tools(structured):
            assert structured is not None and structured.tools is not None
            assert structured.tool_format is not None
            self._parser = ToolCallParser(structured.tools, structured.tool_format)
        self.calls = 0

    def _deltas(self, items: list[str | ToolCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, str):
                out.append({"content": item})
            else:
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": self.calls,
                                "id": item.id,
                                "type": "function",
                                "function": {"name": item.name, "arguments": item.arguments},
                            }
                        ]
                    }
                )
                self.calls += 1
        return out

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas final after ``text`` (maybe none: text held while it may be a call)."""
        if self._parser is None:
            return [{"content": text}] if text else []
        return self._deltas(self._parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas left at the end of the choice."""
        if self._parser is None:
            return []
        return self._deltas(self._parser.finish())
