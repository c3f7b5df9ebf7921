"""What every tool-call format shares: the ToolCall and ParsedOutput values the chat route reads,
the ToolCallParser interface each format implements, and the small helpers the formats build on
(turning a decoded JSON object into a call, finding where content certainly ends)."""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

CALL_ID_PREFIX = "call_"
CALL_ID_RANDOM_BYTES = 12  # 24 hex characters, as OpenAI's ids carry
_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    """A fresh id in OpenAI's shape: "call_" and 24 random hex characters."""
    return CALL_ID_PREFIX + secrets.token_hex(CALL_ID_RANDOM_BYTES)


@dataclass(frozen=True)
class ToolCall:
    """One function call. `arguments` is json.dumps(parsed object, ensure_ascii=False), so a streamed
    and a whole parse of the same text carry the same text."""
    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict:
        """The entry of an assistant message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedOutput:
    """A generation split into its content (text outside tool calls, stripped; None when empty) and
    its tool calls, in the order the model wrote them."""
    content: str | None
    tool_calls: list[ToolCall]


class ToolCallParser(Protocol):
    """Reads one model family's tool-call format out of generated text."""
    name: str

    def parse(self, text: str, *, final: bool = True) -> ParsedOutput:
        """The content and tool calls of `text`. A malformed call never raises: its text stays content.
        final=False: `text` is a prefix of a generation still running, and the calls returned are
        only those no continuation can change or remove (streaming sends them early)."""
        ...

    def content_safe_end(self, text: str) -> int:
        """How many leading characters of `text` are certainly content: no tool-call marker starts in
        them, not even as a partial prefix at the end that more text could complete."""
        ...


def join_content(pieces: list[str]) -> str | None:
    """The content of a parse from its pieces outside tool calls: joined, stripped, None when empty."""
    return "".join(pieces).strip() or None


def decode_object_at(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON value starting at `start` after optional whitespace, and where it ends; None when no
    complete value starts there (malformed, or cut off by the end of the text)."""
    while start < len(text) and text[start].isspace():
        start += 1
    try:
        return _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        return None


def arguments_text(arguments: Any) -> str | None:
    """The canonical JSON text of a call's arguments, or None when they are no JSON object. Some
    models write the arguments as a string holding the object's JSON; that is read as the object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def call_from_object(obj: Any, *, arguments_required: bool = False) -> ToolCall | None:
    """The call a decoded `{"name": ..., "arguments": {...}}` object describes ("parameters" is read
    as a synonym of "arguments"; a string "id" the model gave is kept), or None when it is no call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    if key not in obj and arguments_required:
        return None
    arguments = arguments_text(obj.get(key, {}))
    if arguments is None:
        return None
    model_id = obj.get("id")
    if isinstance(model_id, str) and model_id:
        return ToolCall(obj["name"].strip(), arguments, model_id)
    return ToolCall(obj["name"].strip(), arguments)


def call_from_json(text: str) -> ToolCall | None:
    """The call a JSON text holding exactly one call object describes, or None."""
    try:
        return call_from_object(json.loads(text))
    except json.JSONDecodeError:
        return None


def marker_safe_end(text: str, marker: str) -> int:
    """content_safe_end for formats whose calls start at a fixed marker: the marker's first position,
    or, without one, the text less its longest ending that begins the marker."""
    start = text.find(marker)
    if start >= 0:
        return start
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return len(text)
