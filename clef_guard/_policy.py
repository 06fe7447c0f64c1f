"""Policy files: YAML -> validated model -> compiled policy.

A policy says what it applies to, what the engine sees, which typed questions to ask,
and an ordered list of rules (CEL conditions over the answers, the tool call and the
context) that pick ``allow``, ``confirm``, ``escalate`` or ``deny``. Loading compiles
every CEL program once and checks that rules only name questions and thresholds that
exist. Every fault raises :class:`PolicyError` with the file, line, column and field.

Variables a CEL expression can use:

- ``answers.<question>``: a noul is its probability of yes (a double); a choice is
  ``{choice, confidence, probabilities}``; a score is ``{score, confidence, probabilities}``
  (probabilities keyed by the level as a string);
- ``thresholds.<name>``: the policy's named thresholds, after calibration overrides;
- ``tool``: ``{name, args, args_json, id}`` of the proposed call, ``args_json`` being the
  arguments as one JSON string (sorted keys) for pattern checks; ``result`` too after it ran;
- ``context``: what the integration adds (``step``, ``route``, user-supplied fields).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import cel
import yaml
from langchain_core.decisions import Choice, Noul, Score
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from clef_guard._errors import PolicyError, RequestError
from clef_guard._requests import parse_questions

Action = Literal["allow", "confirm", "escalate", "deny"]
Phase = Literal["before_tool", "after_tool", "route"]
SEVERITY: dict[str, int] = {"allow": 0, "confirm": 1, "escalate": 2, "deny": 3}
"""Strictness order: when several policies decide, the strictest action wins."""

PolicyQuestion = Annotated[Noul | Choice | Score, Field(discriminator="type")]
_NAME = r"^[a-z0-9][a-z0-9_.-]*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AppliesTo(_Strict):
    """Which situations a policy checks."""

    tools: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    """Tool-name globs (``delete_*``, ``send_?mail``, ``*``)."""
    steps: list[str] | None = None
    """Graph step or route-name globs; ``None`` matches any step."""
    when: str | None = None
    """A CEL condition over ``tool`` and ``context`` (e.g. argument checks)."""
    phase: Phase = "before_tool"
    """``before_tool`` gates a proposed call, ``after_tool`` its result, ``route`` a branch."""


class StateView(_Strict):
    """What the engine sees. Serialised as a mapping with these keys, in this order:
    ``fields``, ``messages``, ``tool`` (name, args, description), ``tool_result``."""

    tool_call: bool = True
    tool_description: bool = True
    messages: int = Field(default=6, ge=0)
    """How many of the latest messages to include (0: none)."""
    opening: bool = True
    """Also include the conversation's opening when the latest messages leave it out: its
    leading system turns and first user turn, which say whom the agent serves and what it
    was asked (a ``requested`` question cannot be answered without them)."""
    fields: list[str] = Field(default_factory=list)
    """Top-level state keys to include besides the messages."""
    tool_result: bool = False


class Rule(_Strict):
    """``when`` (CEL) holds -> ``then``; the first rule that holds decides."""

    id: str = Field(pattern=_NAME)
    when: str
    then: Action
    message: str = ""
    """Told to the agent (and shown to the user) when this rule decides."""


class PolicyFile(_Strict):
    """The schema of a policy file."""

    version: Literal[1]
    name: str = Field(pattern=_NAME)
    description: str = ""
    applies_to: AppliesTo = Field(default_factory=AppliesTo)
    state: StateView = Field(default_factory=StateView)
    questions: dict[str, PolicyQuestion] = Field(min_length=1)
    thresholds: dict[str, Annotated[float, Field(ge=0.0, le=1.0)]] = Field(default_factory=dict)
    rules: list[Rule] = Field(min_length=1)
    default: Action = "allow"
    """The action when no rule holds."""
    on_error: Action = "deny"
    """The action when the engine fails or times out, or a rule cannot be evaluated."""

    @field_validator("questions")
    @classmethod
    def _question_ids(cls, questions: dict[str, Any]) -> dict[str, Any]:
        for qid in questions:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", qid):
                raise ValueError(f"question id {qid!r} must be an identifier (letters, digits, _) to be usable in CEL")
        return questions


@dataclass(frozen=True)
class CompiledRule:
    """A rule with its CEL program compiled."""

    id: str
    then: str
    message: str
    source: str
    program: Any = field(repr=False)


@dataclass(frozen=True)
class Policy:
    """A loaded, compiled policy. Build with :func:`load_policies` or :func:`load_policy`."""

    name: str
    description: str
    applies_to: AppliesTo
    state: StateView
    questions: dict[str, Noul | Choice | Score]
    thresholds: dict[str, float]
    rules: tuple[CompiledRule, ...]
    default: str
    on_error: str
    source: str
    _applies_program: Any = field(default=None, repr=False)

    def matches(self, tool_name: str, *, phase: str, step: str | None, context: Mapping[str, Any], tool: Mapping[str, Any]) -> bool:
        """Whether this policy checks the given call at this phase and step."""
        if phase != self.applies_to.phase:
            return False
        if not any(fnmatch.fnmatchcase(tool_name, pattern) for pattern in self.applies_to.tools):
            return False
        if self.applies_to.steps is not None and not (
            step is not None and any(fnmatch.fnmatchcase(step, pattern) for pattern in self.applies_to.steps)
        ):
            return False
        if self._applies_program is None:
            return True
        return self._applies_program.execute({"tool": dict(tool), "context": dict(context)}) is True

    def with_thresholds(self, overrides: Mapping[str, float]) -> Policy:
        """A copy whose named thresholds are replaced by ``overrides`` (calibration)."""
        unknown = set(overrides) - set(self.thresholds)
        if unknown:
            raise PolicyError(
                f"calibration sets thresholds {sorted(unknown)} that policy {self.name!r} does not define",
                field="thresholds",
                hint=f"known thresholds: {sorted(self.thresholds)}",
            )
        return replace(self, thresholds={**self.thresholds, **{k: float(v) for k, v in overrides.items()}})


def load_policies(*paths: str | Path) -> list[Policy]:
    """Load policy files; a folder loads its ``*.yaml`` and ``*.yml`` files in name order."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
        else:
            files.append(path)
    policies = [load_policy(p) for p in files]
    seen: dict[str, str] = {}
    for policy in policies:
        if policy.name in seen:
            raise PolicyError(
                f"policy name {policy.name!r} is already used by {seen[policy.name]}",
                file=policy.source,
                field="name",
                hint="give every policy a distinct name",
            )
        seen[policy.name] = policy.source
    return policies


def load_policy(path: str | Path) -> Policy:
    """Load and compile one policy file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"cannot read the file: {exc}", file=str(path)) from None
    return parse_policy(text, source=str(path))


def parse_policy(text: str, *, source: str = "<policy>") -> Policy:
    """Validate and compile a policy from YAML text; ``source`` names it in errors."""
    root, data = _compose(text, source)
    if not isinstance(data, dict):
        raise PolicyError(
            "a policy file must be a YAML mapping", file=source, line=1, column=1, hint="start with 'version: 1'"
        )
    try:
        spec = PolicyFile.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc, root, source) from None
    except (TypeError, ValueError, RecursionError) as exc:
        raise PolicyError(f"invalid policy: {exc}", file=source, line=1, column=1) from None
    where = _Locator(root, source, text)
    try:
        parse_questions(spec.questions)
    except RequestError as exc:
        path = ["questions", exc.question or "", *(exc.field or "").split(".")]
        raise where.error(str(exc).split(": ", 1)[-1], path) from None
    applies_program = None
    if spec.applies_to.when is not None:
        applies_program = _compile(spec.applies_to.when, ["applies_to", "when"], where, spec)
    rules = tuple(
        CompiledRule(rule.id, rule.then, rule.message, rule.when, _compile(rule.when, ["rules", i, "when"], where, spec))
        for i, rule in enumerate(spec.rules)
    )
    ids = [rule.id for rule in spec.rules]
    for i, rule_id in enumerate(ids):
        if rule_id in ids[:i]:
            raise where.error(f"rule id {rule_id!r} is used twice", ["rules", i, "id"], hint="give each rule its own id")
    return Policy(
        name=spec.name,
        description=spec.description,
        applies_to=spec.applies_to,
        state=spec.state,
        questions=dict(spec.questions),
        thresholds=dict(spec.thresholds),
        rules=rules,
        default=spec.default,
        on_error=spec.on_error,
        source=source,
        _applies_program=applies_program,
    )


def probe_answers(questions: Mapping[str, Noul | Choice | Score]) -> dict[str, Any]:
    """Answers of the right shape (uniform) for every question, to dry-run rules."""
    probe: dict[str, Any] = {}
    for qid, q in questions.items():
        if isinstance(q, Noul):
            probe[qid] = 0.5
        elif isinstance(q, Choice):
            labels = list(q.criteria)
            probe[qid] = {"choice": labels[0], "confidence": 0.0, "probabilities": {k: 1 / len(labels) for k in labels}}
        else:
            n = len(q.criteria)
            probe[qid] = {"score": (n - 1) / 2, "confidence": 0.0, "probabilities": {str(i): 1 / n for i in range(n)}}
    return probe


_REGEX_LITERAL = re.compile(r"""\.matches\(\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')\s*\)""")
_REFERENCE = re.compile(r"\b(answers|thresholds)\s*(?:\.\s*([A-Za-z_]\w*)|\[\s*[\"']([^\"']*)[\"']\s*\])")


def _compile(expression: str, path: list[Any], where: _Locator, spec: PolicyFile) -> Any:
    try:
        program = cel.compile(expression)
    except (ValueError, RuntimeError) as exc:
        detail = str(exc).splitlines()
        raise where.error(
            f"invalid CEL: {detail[0]}",
            path,
            hint="CEL reads like 'answers.destructive >= thresholds.destructive && tool.name == \"rm\"'",
        ) from None
    known = {"answers": set(spec.questions), "thresholds": set(spec.thresholds)}
    for match in _REFERENCE.finditer(expression):
        kind, name = match.group(1), match.group(2) or match.group(3)
        if name not in known[kind]:
            close = difflib.get_close_matches(name, sorted(known[kind]), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"defined: {sorted(known[kind]) or 'none'}"
            what = "question" if kind == "answers" else "threshold"
            raise where.error(
                f"names {what} {name!r}, which this policy does not define", path, hint=hint, snippet=match.group(0)
            )
    for match in _REGEX_LITERAL.finditer(expression):
        try:
            cel.evaluate(f'"".matches({match.group(1)})')
        except (RuntimeError, ValueError) as exc:
            raise where.error(
                f"invalid regular expression: {str(exc).splitlines()[-1].strip()}",
                path,
                hint="CEL uses RE2: no look-ahead, look-behind or back-references",
                snippet=match.group(1),
            ) from None
    _dry_run(program, expression, path, where, spec)
    return program


def _dry_run(program: Any, expression: str, path: list[Any], where: _Locator, spec: PolicyFile) -> None:
    """Evaluate once on uniform answers to catch type errors and non-boolean results."""
    context = {
        "answers": probe_answers(spec.questions),
        "thresholds": dict(spec.thresholds),
        "tool": {"name": "", "args": {}, "args_json": "{}", "id": "", "result": ""},
        "context": {},
    }
    try:
        result = program.execute(context)
    except (KeyError, IndexError):
        return  # a missing tool argument or context key: a runtime matter, guarded by has()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise where.error(f"CEL type error: {str(exc).splitlines()[0]}", path, hint="convert with double(x) or int(x)") from None
    except ArithmeticError as exc:  # such a rule would fail closed on every call
        raise where.error(f"CEL arithmetic error: {exc}", path, hint="guard the divisor: 'x != 0 && y / x > 1'") from None
    if not isinstance(result, bool):
        raise where.error(
            f"must be true or false, but gives a {type(result).__name__}", path, hint="compare it: 'answers.x >= 0.5'"
        )


class _Locator:
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


def _compose(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    """The node tree (for positions) and the data of ``text``."""
    try:
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


def _validation_error(exc: ValidationError, root: yaml.Node | None, source: str) -> PolicyError:
    first = exc.errors()[0]
    path = [part for part in first["loc"] if part not in ("noul", "choice", "score")]
    where = _Locator(root, source)
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
