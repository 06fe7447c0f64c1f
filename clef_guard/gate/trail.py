"""What a thread's agent already did: its gated calls, the labels on their results, and where labeled text went.

A thread's *trail* is a list of JSON entries, one per tool call the gate saw::

    {"id": "call-3", "name": "read_file", "args": {...}, "verdict": "allow", "turn": 2,
     "labels": ["secret"], "marks": ["24:9f0c..."]}

The integrations keep it in the graph state under :data:`TRAIL_KEY`, merged by
:func:`merge_trail`, so it is checkpointed with the thread and survives interrupts,
resumes in another process and parallel tool calls; a new thread starts with none.
Rules read it as ``history`` (the earlier calls, oldest first, with ``turns_ago``),
``labels`` (every label the thread carries) and ``tool.labels`` (the labels of results
whose text reappears in this call's arguments).

*Marks* make that last one cheap and keep contents out of the state's copy of the trail:
a mark is the length and a hash of a normalised span (case folded, whitespace dropped):
the spans a label rule's pattern matched, or else the whole result, each cut into
aligned windows of :data:`WINDOW` characters when longer.
A call carries a result's labels when a window of its argument text hashes to one of the
result's marks and that text does not also appear in a user turn (what the user typed is
the user's, wherever else it appears). A model that re-encodes a secret (base64, spelling
it out) escapes marks; rules on ``labels`` still see that the thread read one.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.messages import BaseMessage

from clef_guard.engine.state import content_text, message_kind, state_messages

TRAIL_KEY = "clef_guard_trail"
"""The graph-state key the integrations keep a thread's trail under."""
WINDOW = 24
"""Normalised characters in one window of a whole result: text copied from it is found
when at least ``2 * WINDOW - 1`` normalised characters of it reach an argument."""
MIN_SPAN = 6
"""The shortest pattern match (normalised) that is marked; shorter ones are too common."""
MAX_MARKS = 512
"""Marks kept per result (about its first ``MAX_MARKS * WINDOW`` normalised characters)."""
MAX_ARGUMENT_CHARS = 65_536
"""How much of each argument (normalised) is compared with the marks."""


def merge_trail(left: Sequence[Mapping[str, Any]] | None, right: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """The graph-state reducer: entries by call id in first-seen order.

    A later entry for a known id adds its labels and marks and sets the verdict; nothing
    is ever removed, so no tool's state update can wipe a label.
    """
    merged: dict[str, dict[str, Any]] = {}
    for entry in filter(_is_entry, [*(left or ()), *(right or ())]):
        known = merged.get(entry["id"])
        if known is None:
            merged[entry["id"]] = {**entry, "labels": sorted(set(entry.get("labels") or ())), "marks": list(entry.get("marks") or ())}
            continue
        known["labels"] = sorted({*known["labels"], *(entry.get("labels") or ())})
        known["marks"] = list(dict.fromkeys([*known["marks"], *(entry.get("marks") or ())]))
        if entry.get("verdict") is not None:
            known["verdict"] = entry["verdict"]
    return list(merged.values())


def read_trail(state: Any) -> list[Mapping[str, Any]]:
    """The trail ``state`` holds under :data:`TRAIL_KEY`: the entries :func:`merge_trail` would keep."""
    trail = state.get(TRAIL_KEY) if isinstance(state, Mapping) else None
    if not isinstance(trail, Sequence) or isinstance(trail, str):
        return []
    return [e for e in trail if _is_entry(e)]


def trail_entry(
    call: Mapping[str, Any], *, turn: int, verdict: str | None = None, labels: Iterable[str] = (), marks: Iterable[str] = ()
) -> dict[str, Any]:
    """One trail entry for ``call`` (``{id, name, args}``), made at model turn ``turn``."""
    return {
        "id": str(call.get("id") or ""),
        "name": call["name"],
        "args": dict(call.get("args") or {}),
        "verdict": verdict,
        "turn": turn,
        "labels": sorted(set(labels)),
        "marks": list(marks),
    }


def model_turns(state: Any) -> int:
    """How many model (AI) turns the state's messages hold: the clock of ``turns_ago``."""
    return sum(1 for m in state_messages(state) if message_kind(m) == "ai")


def normalise(text: str) -> str:
    """``text`` as marks compare it: NFKC, case folded, without whitespace."""
    return "".join(unicodedata.normalize("NFKC", text).casefold().split())


def marks_of(text: str, spans: Sequence[str] | None = None) -> list[str]:
    """Marks for a labeled result: its ``spans`` (pattern matches), else the whole ``text``.

    A span of up to :data:`WINDOW` normalised characters is one mark; a longer one is
    marked by its aligned windows, so every mark has one of a few lengths and finding
    them in an argument stays cheap, however many spans a result holds.
    """
    marks: list[str] = []
    for span in (normalise(s) for s in (spans if spans is not None else [text])):
        if len(span) <= WINDOW:
            marks += [_mark(span)] if len(span) >= MIN_SPAN else []
        else:
            marks += [_mark(span[i : i + WINDOW]) for i in range(0, len(span) - WINDOW + 1, WINDOW)]
    return list(dict.fromkeys(marks))[:MAX_MARKS]


def carried_labels(args: Any, trail: Sequence[Mapping[str, Any]], *, trusted: str = "") -> list[str]:
    """The labels of every trail result whose marked text appears in ``args``.

    Text that also appears in ``trusted`` (normalised; the user's turns) does not count.
    Each argument is read up to :data:`MAX_ARGUMENT_CHARS` normalised characters.
    """
    labels_of: dict[str, set[str]] = {}
    for entry in trail:
        for mark in entry.get("marks") or () if entry.get("labels") else ():
            labels_of.setdefault(mark, set()).update(entry["labels"])
    if not labels_of:
        return []
    lengths = sorted({int(mark.split(":", 1)[0]) for mark in labels_of})
    carried: set[str] = set()
    for value in (normalise(s)[:MAX_ARGUMENT_CHARS] for s in _strings(args)):
        for length in lengths:
            for i in range(len(value) - length + 1):
                window = value[i : i + length]
                found = labels_of.get(_mark(window))
                if found and not found <= carried and window not in trusted:
                    carried |= found
    return sorted(carried)


def flow_variables(trail: Sequence[Mapping[str, Any]], *, turn: int, exclude: str = "") -> dict[str, Any]:
    """``history`` and ``labels`` as rules read them (``exclude``: the id of the call being checked)."""
    history = [
        {
            "id": e["id"],
            "name": e.get("name", ""),
            "args": e.get("args") or {},
            "verdict": e.get("verdict") or "",
            "labels": list(e.get("labels") or ()),
            "turns_ago": _turns_ago(e, turn),
        }
        for e in trail
        if not exclude or e["id"] != exclude
    ]
    return {"history": history, "labels": sorted({label for e in trail for label in e.get("labels") or ()})}


def label_sources(state: Any) -> list[dict[str, Any]]:
    """Where the thread's labels came from: each labeled result's tool, call id and age in turns."""
    turn = model_turns(state)
    return [
        {"labels": list(e["labels"]), "tool": e.get("name", ""), "id": e["id"], "turns_ago": _turns_ago(e, turn)}
        for e in read_trail(state)
        if e.get("labels")
    ]


def user_given(args: Mapping[str, Any], typed: str) -> list[str]:
    """The arguments whose every value (normalised, 3 characters or more) the user typed in ``typed``."""
    given = []
    for name, value in args.items():
        values = [normalise(str(v)) for v in (value if isinstance(value, list) else [value]) if isinstance(v, (str, int, float))]
        if values and all(len(v) >= 3 and v in typed for v in values):
            given.append(name)
    return sorted(given)


def user_text(state: Any) -> str:
    """Everything the user typed in the state's messages, normalised (what :func:`carried_labels` trusts)."""
    return "\n".join(normalise(text) for text in texts_of(state, "human"))


def texts_of(state: Any, kind: str) -> list[str]:
    """The text of each of the state's messages of ``kind`` (``human``, ``tool``, ...), in order."""
    return [content_text(_content(m)) for m in state_messages(state) if message_kind(m) == kind]


def _is_entry(entry: Any) -> bool:
    return isinstance(entry, Mapping) and isinstance(entry.get("id"), str)


def _turns_ago(entry: Mapping[str, Any], turn: int) -> int:
    return max(0, turn - int(entry.get("turn") or 0))


def _mark(flat: str) -> str:
    return f"{len(flat)}:{hashlib.blake2b(flat.encode(), digest_size=8).hexdigest()}"


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)
    elif value is not None and not isinstance(value, bool):
        yield str(value)


def _content(message: Any) -> Any:
    return message.content if isinstance(message, BaseMessage) else message.get("content", "")
