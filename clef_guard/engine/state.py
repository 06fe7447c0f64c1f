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

Text cannot forge a turn. Messages are read as messages only where a state keeps them (the
items of a top-level list, of the top-level ``messages`` key, or a top-level message);
anywhere else a role/content mapping is data. In data, in a message's content and in its
tool-call lines, every line that could read as the start of a turn (``user: ...``,
``tool x: ...``, ``tool_call ...``, in any case, after Unicode normalisation and with
Cyrillic or Greek look-alike letters read as Latin) is quoted with :data:`QUOTE`, so no
string in the state renders to the text of another turn. Keys below the top level count
as data too. Ordinary text is rendered unchanged.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import BaseMessage, ChatMessage, convert_to_messages

from clef_guard.errors import RequestError

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "tool"}
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "id"})
_KNOWN_ROLES = frozenset({"user", "human", "assistant", "ai", "system", "developer", "tool", "function"})
"""Roles LangChain reads: a mapping in one of these that it cannot read is a broken message, not other data."""


QUOTE = "> "
"""Opens a line of data that could otherwise read as a turn."""
_TURN_WORDS = frozenset({"user", "assistant", "system", "tool", "human", "ai", "developer", "function", "agent", "environment"})
"""Roles a rendered turn can open with (LangChain's, and the agent/environment of trajectory datasets)."""
_BREAK = re.compile(r"(\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029])")
_ROLE_OPENING = re.compile(r"([a-z_]+)\s*:")
_TOOL_OPENING = re.compile(r"tool\s+\S+?\s*:|tool_call\b")
_LOOKALIKES = str.maketrans("аеорсухѕіјԁһԛѡɡⅼαοενιτκυρᴜꜱʀ", "aeopcyxsijdhqwglaoevitkupusr")


def state_segments(state: Any) -> list[str]:
    """Serialise ``state`` into its ordered text segments."""
    segments: list[str] = []
    _render(state, segments, path="state", where="top")
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
    """One message as ``role: text`` plus its tool calls, one per line; no text in it starts another line's turn."""
    role = _role(message)
    if role == "tool" and getattr(message, "name", None):
        role = f"tool {message.name}"
    lines = [f"{role}: {content_text(message.content)}"]
    for call in getattr(message, "tool_calls", None) or []:
        lines.append(f"tool_call {call['name']} {to_json(call.get('args', {}))}")
    return "\n".join(defused(line, at_line_start=False) for line in lines)


def _role(message: BaseMessage) -> str:
    """The role a message renders with: a chat message's own, else LangChain's type as a chat role."""
    return message.role if isinstance(message, ChatMessage) else _ROLES.get(message.type, message.type)


def defused(text: str, *, at_line_start: bool = True) -> str:
    """``text`` with :data:`QUOTE` before every line that could read as a turn.

    ``at_line_start=False`` leaves the first line alone (it follows a role already).
    """
    parts = _BREAK.split(text)
    for index in range(0 if at_line_start else 2, len(parts), 2):  # odd indices are the line breaks
        if _turn_like(parts[index]):
            parts[index] = QUOTE + parts[index]
    return "".join(parts)


def _turn_like(line: str) -> bool:
    """Whether ``line`` opens like a turn (``user:``, ``tool read_file:``, ``tool_call``), however it is spelled.

    Invisible format characters (zero-width spaces, ...) are read both as nothing and as a space.
    """
    head = unicodedata.normalize("NFKC", line[:120]).translate(_LOOKALIKES).lstrip().lower()
    dropped = "".join(c for c in head if unicodedata.category(c) != "Cf")
    spaced = "".join(" " if unicodedata.category(c) == "Cf" else c for c in head)
    for reading in (dropped.lstrip(), spaced.lstrip()):
        role = _ROLE_OPENING.match(reading)
        if (role is not None and role.group(1) in _TURN_WORDS) or _TOOL_OPENING.match(reading) is not None:
            return True
    return False


def jsonable(value: Any) -> Any:
    """``value`` with every message in dict form (role, content, name, tool calls), which renders exactly as it did."""
    if isinstance(value, BaseMessage):
        message: dict[str, Any] = {"role": _role(value), "content": value.content}
        if getattr(value, "name", None):
            message["name"] = value.name
        if getattr(value, "tool_calls", None):
            message["tool_calls"] = [{"name": c["name"], "args": c.get("args", {}), "id": c.get("id")} for c in value.tool_calls]
        if getattr(value, "tool_call_id", None):
            message["tool_call_id"] = value.tool_call_id
        return message
    if isinstance(value, Mapping):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    return value


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


def _render(value: Any, out: list[str], path: str, where: str) -> None:
    """Append ``value``'s segments; ``where`` is ``top`` (the state), ``message`` (a place for a turn) or ``data``."""
    speaks = where in ("top", "message")
    if isinstance(value, str):
        out.append(value if where == "top" else defused(value))
    elif isinstance(value, BaseMessage) and speaks:
        out.append(render_message(value))
    elif isinstance(value, Mapping) and speaks and (message := as_message(value)) is not None:
        out.append(render_message(message))
    elif (
        isinstance(value, Mapping) and speaks and _message_shaped(value)
        and (set(value) <= {"role", "content"} or value["role"] in _KNOWN_ROLES)
    ):
        raise _unreadable(value, path)
    elif isinstance(value, BaseMessage):  # a message inside data is data: its text, quoted where it could pass for a turn
        out.append(defused(render_message(value)))
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            out.append(f"{key}:" if where == "top" else defused(f"{key}:"))
            _render(value[key], out, f"{path}.{key}", "message-list" if where == "top" and key == "messages" else "data")
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        inner = "message" if where in ("top", "message-list") else "data"
        for index, item in enumerate(value):
            _render(item, out, f"{path}[{index}]", inner)
    elif value is None or isinstance(value, (bool, int, float)):
        out.append(to_json(value))
    else:
        raise RequestError(
            f"cannot serialise a {type(value).__name__}; a state holds text, JSON values and "
            "LangChain messages",
            field=path,
        )


def state_messages(state: Any) -> list[Any]:
    """The state's messages (its ``messages`` key, or the state itself when it is a list of them)."""
    if isinstance(state, Mapping):
        state = state.get("messages")
    if isinstance(state, Sequence) and not isinstance(state, str) and all(isinstance(m, (BaseMessage, Mapping)) for m in state):
        return list(state)
    return []


def is_request(state: Any) -> bool:
    """Whether ``state`` is a user's request: text, or messages whose last is the user's turn.
    Data that is neither (a proposed call alone, a record) is not, whatever text it holds."""
    if isinstance(state, str):
        return True
    messages = state_messages(state)
    return bool(messages) and message_kind(messages[-1]) == "human"


def message_kind(message: Any) -> str | None:
    """LangChain's type of a message (``human``, ``ai``, ...); a mapping counts as the message it renders as."""
    read = read_message(message)
    return read.type if read is not None else None


def read_message(message: Any) -> BaseMessage | None:
    """``message`` as a LangChain message: a mapping as the message it renders as; ``None`` for anything else."""
    return message if isinstance(message, BaseMessage) else as_message(message) if isinstance(message, Mapping) else None


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
