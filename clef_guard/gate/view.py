"""The engine's view of a check: the call as policies read it, and the parts of the state a policy's ``state:`` asks for."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage

from clef_guard.engine.state import message_kind, read_message, state_messages
from clef_guard.errors import PolicyError
from clef_guard.gate.trail import normalise, texts_of, user_text
from clef_guard.policy.load import Policy


def engine_state(policy: Policy, call: Mapping[str, Any], state: Any, description: str | None) -> dict[str, Any]:
    """The state the engine sees for ``policy``: the parts its ``state:`` section asks for."""
    view = policy.state
    proposed = call if policy.applies_to.phase != "route" else None
    payload = _conversation(policy, state, upcoming=False, proposed=proposed)
    if view.tool_call:
        tool: dict[str, Any] = {"name": call["name"], "args": call["args"]}
        if view.tool_description and description:
            tool["description"] = description
        payload["tool"] = tool
    if view.tool_result and call.get("result") is not None:
        payload["tool_result"] = call["result"]
    return payload


COPIED_MIN_CHARS = 24
"""Shortest run of an argument's text, found verbatim in an earlier tool result, that the reading
without results leaves out (:func:`trusted_view`)."""
_IDENTIFIER = re.compile(r"[\x21-\x7e]+|[A-Z0-9]+(?: [A-Z0-9]+)*")
"""What stays when copied: one ASCII token (a path, URL, address, key) or spaced groups of capitals and digits (an IBAN)."""


class Copied:
    """What the trusted reading needs of ``state`` to leave text out of arguments: the tool results
    an argument may copy runs of :data:`COPIED_MIN_CHARS` or more characters from, and what the
    user typed (which stays, copied or not). Read from the state on first need, once per check."""

    def __init__(self, state: Any) -> None:
        self._state = state

    @functools.cached_property
    def results(self) -> list[str]:
        """The state's tool results long enough to be copied from."""
        return [r for r in texts_of(self._state, "tool") if len(r) >= COPIED_MIN_CHARS]

    @functools.cached_property
    def typed(self) -> str:
        """What the user typed, normalised: copied or not, it stays."""
        return user_text(self._state)

    @functools.cached_property
    def grams(self) -> frozenset[str]:
        """Every run of :data:`COPIED_MIN_CHARS` characters of the results."""
        return frozenset(r[i : i + COPIED_MIN_CHARS] for r in self.results for i in range(len(r) - COPIED_MIN_CHARS + 1))


def trusted_view(engine_view: Mapping[str, Any], copied: Copied, *, results: bool = True, prose: bool = True) -> dict[str, Any] | None:
    """``engine_view`` without what the user and the system did not write, or ``None`` when it
    holds none of it. ``results``: the earlier tool results (the calls that made them stay) and
    the prose the agent copied from them into the arguments of the call and of its earlier calls;
    ``prose``: every argument's prose, copied or not (the agent's model writes it, and whoever
    steers that model). Paths, ids, addresses, account numbers, numbers and what the user typed
    stay; an argument that held nothing else goes. The result a policy screens
    (``tool_result``) stays: it is what the question is about."""
    if prose:
        text: Callable[[str], str] | None = functools.partial(_unless_prose, copied=copied)
    else:
        text = functools.partial(_uncopied, copied=copied) if results and copied.results else None
    view = _rewritten(engine_view, text, results=results)
    return None if view == engine_view else view


def _rewritten(engine_view: Mapping[str, Any], text: Callable[[str], str] | None, *, results: bool) -> dict[str, Any]:
    """``engine_view`` with ``text`` made to every string in the arguments of the call and of the
    agent's calls shown, and (``results``) without the earlier tool results."""
    leave_out = functools.partial(_each_string, change=text) if text else None
    view = dict(engine_view)
    if "messages" in engine_view:
        kept = [m for m in engine_view["messages"] if not results or message_kind(m) != "tool"]
        view["messages"] = [_calls_with(m, leave_out) for m in kept] if leave_out else kept
    tool = engine_view.get("tool")
    if leave_out and isinstance(tool, Mapping) and "args" in tool:
        view["tool"] = {**tool, "args": leave_out(tool["args"])}
    return view


def _calls_with(message: Any, leave_out: Callable[[Any], Any]) -> Any:
    """An agent's message whose tool calls' arguments went through ``leave_out``; any other message as it is."""
    calls = getattr(message, "tool_calls", None) if isinstance(message, BaseMessage) else message.get("tool_calls")
    if not calls or message_kind(message) != "ai":
        return message
    return _updated(message, tool_calls=[{**c, "args": leave_out(c.get("args"))} if isinstance(c, Mapping) else c for c in calls])


def _each_string(value: Any, change: Callable[[str], str]) -> Any:
    """``value`` (a JSON value) with ``change`` made to every string in it; a mapping or list loses
    the entries that held nothing else."""
    if isinstance(value, Mapping):
        kept = {k: _each_string(v, change) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v != "" or value[k] == ""}
    if isinstance(value, list):
        return [v for v, was in ((_each_string(v, change), v) for v in value) if v != "" or was == ""]
    return change(value) if isinstance(value, str) else value


def _unless_prose(text: str, copied: Copied) -> str:
    """``text``, or nothing when it is prose (:func:`is_prose`) the user did not type."""
    return "" if is_prose(text) and normalise(text) not in copied.typed else text


PROSE_WORDS = 3
"""Words in a natural language that make a string prose (:func:`is_prose`)."""
_WORD = re.compile(r"(?<!\S)[^\W\d_]+[.,:;!?'\")]*(?!\S)")
_UNSPACED_WORDS = re.compile(r"[^\W\d_\x00-\x7f]{6,}")


def is_prose(text: str) -> bool:
    """Whether ``text`` is written in a natural language: :data:`PROSE_WORDS` or more words of
    letters alone, or six letters in a row of a script written without spaces. A path, URL,
    id, amount, account number, shell command or short SQL statement is not; a sentence is,
    whatever else it holds."""
    return len(_WORD.findall(text)) >= PROSE_WORDS or _UNSPACED_WORDS.search(text) is not None


def _uncopied(value: str, copied: Copied) -> str:
    """``value`` without the prose copied from earlier results (:class:`Copied`)."""
    if len(value) < COPIED_MIN_CHARS:
        return value
    grams, covered = copied.grams, [False] * len(value)
    for i in range(len(value) - COPIED_MIN_CHARS + 1):
        if value[i : i + COPIED_MIN_CHARS] in grams:
            covered[i : i + COPIED_MIN_CHARS] = [True] * COPIED_MIN_CHARS
    out, start = [], 0
    for end in range(len(value) + 1):
        if end < len(value) and covered[end] == covered[start]:
            continue
        piece = value[start:end]
        left_out = covered[start] and not _IDENTIFIER.fullmatch(piece.strip()) and normalise(piece) not in copied.typed
        out.append("" if left_out else piece)
        start = end
    return "".join(out)


MAX_WINDOWS = 16
"""Most windows one result is read in; a longer result gets wider windows (the engine keeps each one's head and tail)."""


def result_windows(result: str | None, size: int | None) -> list[tuple[int, int] | None]:
    """Character spans that cover ``result`` in windows of about ``size``, overlapping by a
    fifth so that a passage cut by one window's edge is whole in the next; ``[None]``
    (the whole result) when it is short or no size is set. Windows end at a line break
    where one falls in their last fifth."""
    if not result or size is None or len(result) <= size:
        return [None]
    size = max(size, -(-5 * len(result) // (3 * MAX_WINDOWS)) + 5)  # a window advances at least 3/5 of its size
    overlap = size // 5
    spans: list[tuple[int, int] | None] = []
    start = 0
    while True:
        end = min(start + size, len(result))
        if end < len(result):
            cut = result.rfind("\n", end - overlap, end)
            end = cut + 1 if cut > start else end
        spans.append((start, end))
        if end >= len(result):
            return spans
        start = end - overlap


_LINE = re.compile(r"[^\n]*\S[^\n]*")
LINE_READINGS = 4
"""Most readings of one text's lines (:func:`line_spans`); more lines are grouped."""


def line_spans(text: str | None) -> list[tuple[int, int]]:
    """Character spans of ``text``'s lines that hold something, consecutive lines grouped evenly
    into at most :data:`LINE_READINGS` spans; none for a text of one line."""
    lines = [match.span() for match in _LINE.finditer(text or "")]
    if len(lines) < 2:
        return []
    n, k = len(lines), min(len(lines), LINE_READINGS)
    return [(lines[i * n // k][0], lines[(i + 1) * n // k - 1][1]) for i in range(k)]


def argument_lines(engine_view: Mapping[str, Any], copied: Copied) -> list[dict[str, Any]]:
    """``engine_view`` with one of the call's prose arguments cut to one run of its lines
    (:func:`line_spans`), wherever the call shows it, and the other prose left out (earlier
    results stay), for each such run: a line an attacker adds to a message cannot change how
    its other lines read, in the same conversation."""
    args = (engine_view.get("tool") or {}).get("args")
    if not isinstance(args, Mapping):
        return []
    lines = [(value, value[a:b]) for value in args.values() if isinstance(value, str) and is_prose(value) for a, b in line_spans(value)]
    return [_rewritten(engine_view, functools.partial(_one_line, value=value, line=line, copied=copied), results=False) for value, line in lines]


def _one_line(text: str, value: str, line: str, copied: Copied) -> str:
    """``line`` for the argument ``value`` (wherever the call shows it), any other prose left out."""
    return line if text == value else _unless_prose(text, copied)


def upcoming_state(policy: Policy, state: Any) -> dict[str, Any] | None:
    """What ``policy``'s engine state for the next call on ``state`` begins with, or ``None``
    when it begins with nothing ``state`` holds yet.

    The next call comes in one more message (the model's, proposing it): the view keeps
    ``state``'s fields and the messages its window will hold then, before that message.
    Rendered, this is a prefix of the next call's engine state (its keys sort first).
    """
    return _conversation(policy, state, upcoming=True) or None


def _conversation(policy: Policy, state: Any, *, upcoming: bool, proposed: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``fields`` and ``messages`` of ``policy``'s view of ``state``; ``upcoming``: as the
    window will hold them once one more message arrives, without that message. A conversation
    in which no agent turn since the user's last one proposes ``proposed`` gets that turn at
    its end, as every integration's state has it (and every training row)."""
    view = policy.state
    payload: dict[str, Any] = {}
    if view.fields and isinstance(state, Mapping):
        payload["fields"] = {k: state[k] for k in view.fields if k in state}
    messages = state_messages(state)
    if proposed is not None and messages and not _proposes(messages, proposed):
        messages.append(AIMessage("", tool_calls=[{"name": proposed["name"], "args": proposed["args"], "id": proposed.get("id") or ""}]))
    if view.messages and messages:
        window = [*messages, None] if upcoming else messages  # None: the message still to come
        latest = window[-view.messages :]
        opening = _opening(window) if view.opening else []
        kept = [*opening[: len(window) - len(latest)], *latest]
        if not view.agent_text:
            kept = [_calls_only(message) for message in kept]
        payload["messages"] = kept[:-1] if upcoming else kept
    return payload


def _proposes(messages: Sequence[Any], call: Mapping[str, Any]) -> bool:
    """Whether an agent turn after the user's last one proposes ``call`` (the same id, or the same name and arguments)."""
    for message in reversed(messages):
        read = read_message(message)
        if read is None or read.type == "human":
            return False
        for proposed in getattr(read, "tool_calls", None) or []:
            if (call.get("id") and proposed.get("id") == call["id"]) or (
                proposed.get("name") == call["name"] and isinstance(proposed.get("args") or {}, Mapping)
                and normalise_call(proposed)["args"] == call["args"]
            ):
                return True
    return False


def _calls_only(message: Any) -> Any:
    """An agent's message with its text left out (its tool calls stay); any other message as it is."""
    return _updated(message, content="") if message is not None and message_kind(message) == "ai" else message


def _updated(message: BaseMessage | Mapping[str, Any], **changes: Any) -> Any:
    """A copy of ``message``, a LangChain message or a mapping, with ``changes``."""
    return message.model_copy(update=changes) if isinstance(message, BaseMessage) else {**message, **changes}


def _opening(messages: Sequence[Any]) -> list[Any]:
    """The conversation's leading system turns and, right after them, its first user turn.

    A mapping counts as the message it renders as (:func:`clef_guard.engine.state.as_message`).
    """
    for index, message in enumerate(messages):
        kind = message_kind(message)
        if kind != "system":
            return list(messages[: index + (kind == "human")])
    return list(messages)


def normalise_call(tool_call: Mapping[str, Any], result: Any = None) -> dict[str, Any]:
    """A tool call as policies read it: ``{name, args, args_json, id}`` (and ``result``), args as JSON values."""
    name = tool_call.get("name")
    if not isinstance(name, str) or not name:
        raise PolicyError("a tool call needs a non-empty 'name'", field="tool_call.name")
    args = tool_call.get("args") or {}
    if not isinstance(args, Mapping):
        raise PolicyError("a tool call's 'args' must be a mapping", field="tool_call.args")
    args_json = json.dumps(dict(args), default=str, sort_keys=True, ensure_ascii=False)
    call = {"name": name, "args": json.loads(args_json), "args_json": args_json, "id": str(tool_call.get("id") or "")}
    if result is not None:
        call["result"] = result if isinstance(result, str) else json.dumps(result, default=str, sort_keys=True)
    return call
