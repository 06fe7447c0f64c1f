"""Where a fault sits in a policy's YAML: line, column and dotted field of every error."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from clef_guard.errors import PolicyError
from clef_guard.policy.schema import AppliesTo, PolicyFile, Rule, StateView


class Locator:
    """Maps a field path to the line and column of its node in the YAML source."""

    def __init__(self, root: yaml.Node | None, source: str, text: str = "") -> None:
        self.root = root
        self.source = source
        self.text = text

    def mark(self, path: Iterable[Any]) -> tuple[int | None, int | None]:
        node = self.root
        for part in path:
            if isinstance(node, yaml.MappingNode):
                for key, value in node.value:
                    if key.value == str(part):
                        node = value
                        break
                else:
                    continue  # a pydantic tag (union member) or a key not written: stay here
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                node = node.value[part]
        if node is None:
            return None, None
        return node.start_mark.line + 1, node.start_mark.column + 1

    def key_mark(self, path: list[Any]) -> tuple[int | None, int | None]:
        """Position of the key itself (for unknown fields)."""
        parent = self.root
        for part in path[:-1]:
            if isinstance(parent, yaml.MappingNode):
                parent = next((v for k, v in parent.value if k.value == str(part)), parent)
            elif isinstance(parent, yaml.SequenceNode) and isinstance(part, int) and part < len(parent.value):
                parent = parent.value[part]
        if isinstance(parent, yaml.MappingNode):
            for key, _ in parent.value:
                if key.value == str(path[-1]):
                    return key.start_mark.line + 1, key.start_mark.column + 1
        return self.mark(path)

    def error(
        self, problem: str, path: list[Any], *, hint: str | None = None, snippet: str | None = None, key: bool = False
    ) -> PolicyError:
        """A PolicyError at ``path``; at ``snippet`` inside its value when that is found in the source."""
        line, column = self.key_mark(path) if key else self.mark(path)
        if snippet and line is not None:
            start = sum(len(row) + 1 for row in self.text.split("\n")[: line - 1])
            found = self.text.find(snippet.split("\n")[0], start)
            if found >= 0:
                line = self.text.count("\n", 0, found) + 1
                column = found - (self.text.rfind("\n", 0, found) + 1) + 1
        return PolicyError(problem, file=self.source, line=line, column=column, field=_dotted(path), hint=hint)


MAX_POLICY_BYTES = 256 * 1024
"""Largest policy file read (the built-in ones are under 5 KB)."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists a policy file may have."""


def compose(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    """The node tree (for positions) and the data of ``text``.

    Hostile files are refused before they are built: more than :data:`MAX_POLICY_BYTES`,
    anchors or aliases (a policy needs none, and they make exponential or endless
    documents), nesting deeper than :data:`MAX_DEPTH`, or more than one document.
    """
    if len(text.encode("utf-8", "surrogatepass")) > MAX_POLICY_BYTES:
        raise PolicyError(f"the file is larger than {MAX_POLICY_BYTES // 1024} KB", file=source, hint="a policy is a short file")
    try:
        _screen_events(text, source)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None:
            _reject_duplicate_keys(root, source)
        data = yaml.safe_load(text) if root is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyError(
            f"malformed YAML: {problem}",
            file=source,
            line=mark.line + 1 if mark else None,
            column=mark.column + 1 if mark else None,
            hint="check the indentation and quoting around this spot",
        ) from None
    return root, data


def _screen_events(text: str, source: str) -> None:
    """Walk the YAML event stream (linear, no document built) and refuse what a policy never needs."""
    depth = documents = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        where = {"file": source, "line": event.start_mark.line + 1, "column": event.start_mark.column + 1}
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise PolicyError("anchors and aliases (&name, *name) are not allowed in a policy", hint="write the value out", **where)
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise PolicyError(f"nested deeper than {MAX_DEPTH} levels", hint="a policy is a shallow file", **where)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        elif isinstance(event, yaml.DocumentStartEvent):
            documents += 1
            if documents > 1:
                raise PolicyError("a policy file holds one YAML document", hint="put each policy in its own file", **where)


def _reject_duplicate_keys(node: yaml.Node, source: str) -> None:
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, yaml.MappingNode):
            seen: set[Any] = set()
            for key, value in current.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in seen:
                        raise PolicyError(
                            f"key {key.value!r} appears twice in the same mapping",
                            file=source,
                            line=key.start_mark.line + 1,
                            column=key.start_mark.column + 1,
                            hint="keep one of them",
                        )
                    seen.add(key.value)
                stack.append(value)
        elif isinstance(current, yaml.SequenceNode):
            stack.extend(current.value)


_MODEL_AT: dict[str, type[BaseModel]] = {"applies_to": AppliesTo, "state": StateView, "rules": Rule}


def validation_error(exc: ValidationError, root: yaml.Node | None, source: str) -> PolicyError:
    first = exc.errors()[0]
    path = [part for part in first["loc"] if part not in ("noul", "choice", "score")]
    where = Locator(root, source)
    kind = first["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_fields(path)
        close = difflib.get_close_matches(str(path[-1]), allowed, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"allowed here: {', '.join(allowed)}"
        return where.error(f"unknown field {path[-1]!r}", path, hint=hint, key=True)
    if kind == "missing":
        return where.error("is required", path, hint=f"add '{path[-1]}:'" if path else None)
    hints = {
        "less_than_equal": "thresholds are probabilities: write a number from 0 to 1",
        "greater_than_equal": "write a number from 0 to 1" if path and path[0] == "thresholds" else None,
        "too_short": "it must not be empty",
        "string_pattern_mismatch": "use lowercase letters, digits, '-', '_' or '.'",
        "union_tag_invalid": "type is one of noul, choice, score",
        "union_tag_not_found": "add 'type: noul', 'type: choice' or 'type: score'",
        "string_type": "quote it: YAML reads bare yes, no, on, off, numbers and dates as other types",
        "float_type": "write a number without quotes (YAML's yes, no, on and off are not numbers)",
        "int_type": "write a whole number without quotes (true and false are not numbers)",
        "bool_type": "write true or false",
    }
    return where.error(first["msg"], path, hint=hints.get(kind))


def _allowed_fields(path: list[Any]) -> list[str]:
    if len(path) >= 3 and path[0] == "questions":
        return ["type", "instructions", "criteria"]
    model = _MODEL_AT.get(str(path[0])) if len(path) > 1 else PolicyFile
    return list((model or PolicyFile).model_fields)


def _dotted(path: Iterable[Any]) -> str:
    text = ""
    for part in path:
        if part == "":
            continue
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text
