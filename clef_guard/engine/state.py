"""Deterministic serialisation of a decision state into text segments.

A state (text, JSON, LangChain messages, or any nesting of these) becomes a list of
segments. Each segment is tokenized on its own, so appending a message to a
conversation appends tokens and leaves every earlier token unchanged: this is what
lets the engine's prefix cache serve a growing agent state.

The format, fixed and documented so users can predict what the engine reads:

- a string is one segment, as is;
- a message is one segment: ``"<role>: <text>"``, then one line
  ``"tool_call <name> <json args>"`` per proposed tool call; a tool result reads
  ``"tool <name>: <text>"``; non-text content blocks show as ``[<type>]``;
- a mapping with a string ``role`` and a ``content`` (and at most ``name``, ``tool_calls``,
  ``tool_call_id``, ``id``) is a message in dict form, OpenAI's or LangChain's, and reads
  as that message; a role LangChain does not know (``agent``, ``environment``) is kept
  as written;
- any other mapping is rendered key by key in sorted order, ``"<key>:"`` then its value;
- a sequence is rendered item by item; messages and nested containers keep their own
  segments, scalars are written as JSON.

JSON is written with sorted keys and no ASCII escaping.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import BaseMessage, ChatMessage, convert_to_messages

from clef_guard.errors import RequestError

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "tool"}
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "id"})
_KNOWN_ROLES = frozenset({"user", "human", "assistant", "ai", "system", "developer", "tool", "function"})
"""Roles LangChain reads: a mapping in one of these that it cannot read is a broken message, not other data."""


def state_segments(state: Any) -> list[str]:
    """Serialise ``state`` into its ordered text segments."""
    segments: list[str] = []
    _render(state, segments, path="state")
    return segments


def head_and_tail(segments: list[str], chars: int, marker: str) -> list[str]:
    """``segments`` cut to their first quarter and last three quarters of ``chars`` characters,
    ``marker`` between them; unchanged when they are no longer than that."""
    if sum(map(len, segments)) <= chars:
        return segments
    head: list[str] = []
    tail: list[str] = []
    for kept, room, order in ((head, chars // 4, segments), (tail, chars - chars // 4, segments[::-1])):
        for segment in order:
            if room <= 0:
                break
            kept.append(segment[:room] if kept is head else segment[-room:])
            room -= len(segment)
    return [*head, marker, *tail[::-1]]


def to_json(value: Any) -> str:
    """Deterministic JSON: sorted keys, unicode kept, messages as their rendering."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=_json_default)


def render_message(message: BaseMessage) -> str:
    """One message as ``role: text`` plus its tool calls, one per line."""
    role = message.role if isinstance(message, ChatMessage) else _ROLES.get(message.type, message.type)
    if role == "tool" and getattr(message, "name", None):
        role = f"tool {message.name}"
    lines = [f"{role}: {content_text(message.content)}"]
    for call in getattr(message, "tool_calls", None) or []:
        lines.append(f"tool_call {call['name']} {to_json(call.get('args', {}))}")
    return "\n".join(lines)


def content_text(content: Any) -> str:
    """Text of a message content or question instructions: strings as is, JSON otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, (str, Mapping)) for b in content):
        return "\n".join(_block_text(block) for block in content)
    return to_json(content)


def _block_text(block: str | Mapping[str, Any]) -> str:
    if isinstance(block, str):
        return block
    if block.get("type") == "text" and isinstance(block.get("text"), str):
        return block["text"]
    return f"[{block.get('type', 'block')}]"


def _render(value: Any, out: list[str], path: str) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, BaseMessage):
        out.append(render_message(value))
    elif isinstance(value, Mapping) and (message := as_message(value)) is not None:
        out.append(render_message(message))
    elif isinstance(value, Mapping) and _message_shaped(value) and (set(value) <= {"role", "content"} or value["role"] in _KNOWN_ROLES):
        raise _unreadable(value, path)
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            out.append(f"{key}:")
            _render(value[key], out, f"{path}.{key}")
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        for index, item in enumerate(value):
            _render(item, out, f"{path}[{index}]")
    elif value is None or isinstance(value, (bool, int, float)):
        out.append(to_json(value))
    else:
        raise RequestError(
            f"cannot serialise a {type(value).__name__}; a state holds text, JSON values and "
            "LangChain messages",
            field=path,
        )


def as_message(value: Mapping[str, Any]) -> BaseMessage | None:
    """The message a role/content mapping stands for, or ``None`` when it is other data (or unreadable)."""
    if not _message_shaped(value):
        return None
    try:
        return convert_to_messages([dict(value)])[0]
    except (KeyError, ValueError, TypeError):  # a role LangChain does not know, a tool result without its call id
        pass
    if set(value) <= {"role", "content"}:
        try:
            return ChatMessage(role=value["role"], content=value["content"])
        except ValueError:  # content that is neither text nor content blocks
            return None
    return None


def _message_shaped(value: Mapping[str, Any]) -> bool:
    return isinstance(value.get("role"), str) and "content" in value and set(value) <= _MESSAGE_KEYS


def _unreadable(value: Mapping[str, Any], path: str) -> RequestError:
    """Why a message-shaped mapping is not a message, without repeating what it holds."""
    content = value.get("content")
    if not isinstance(content, (str, list)):
        problem = f"its content is a {type(content).__name__}, not text or a list of content blocks"
    else:
        problem = "its tool calls or other fields are not in the shape LangChain reads"
    return RequestError(f"a {value['role']!r} message cannot be read: {problem}", field=path)


def _json_default(value: Any) -> Any:
    if isinstance(value, BaseMessage):
        return render_message(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
