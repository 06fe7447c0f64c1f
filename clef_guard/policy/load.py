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
  ``labels`` (what :mod:`clef_guard.gate.trail` found of labeled results in the arguments),
  ``from_user`` (the arguments whose values the user typed in a turn),
  and what the tool declares of itself: ``annotations`` (MCP hints ``readOnlyHint``,
  ``destructiveHint``, ``idempotentHint``, ``openWorldHint``; ``null`` when undeclared),
  ``metadata`` and ``tags``;
- ``context``: what the integration adds (``step``, ``route``, user-supplied fields);
- ``history``: the thread's earlier tool calls, oldest first, each
  ``{id, name, args, verdict, labels, turns_ago}``; ``labels``: every label the thread carries.
- ``facts.<name>``: a named condition from the policy's ``facts:`` (written out where it is read).

A policy's ``labels:`` rules run on every tool result and attach labels to it.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib.resources import files
from pathlib import Path
from typing import Any

import cel
import regex
from langchain_core.decisions import Choice, Noul, Score
from pydantic import ValidationError

from clef_guard.engine.requests import parse_questions
from clef_guard.engine.screen import SCREENS
from clef_guard.errors import PolicyError, RequestError
from clef_guard.policy.locate import Locator, compose, validation_error
from clef_guard.policy.schema import AppliesTo, LabelRule, PolicyFile, StateView

BUILTIN_PACKAGE = "clef_guard.policy.builtin"
"""Where the built-in policies ship (the repository's ``policies/`` folder, as package data)."""
_BUILTIN_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
EMPTY_FLOW: Mapping[str, Any] = {"history": [], "labels": []}
"""``history`` and ``labels`` of a thread with no trail."""
HINTS = ("readOnlyHint", "destructiveHint", "idempotentHint", "openWorldHint")
"""The MCP tool annotations rules read as ``tool.annotations`` (``null`` when undeclared)."""

@dataclass(frozen=True)
class CompiledRule:
    """A rule with its CEL program compiled."""

    id: str
    then: str
    message: str
    source: str
    program: Any = field(repr=False)
    reads: tuple[str, ...] | None = None
    """The questions ``when`` reads, by name (``answers.x`` or ``answers["x"]``); ``None`` when it
    reads the answers map itself (``has(answers.x)``, ``answers.size()``, ...): then every
    question must be answered before it can be evaluated."""
    with_facts: Any = field(default=None, repr=False)
    """``when`` compiled to read the facts it names from a ``facts`` variable (the call's facts, worked
    out once: :meth:`Policy.fact_values`) instead of written out in it; ``None`` when it names none."""

    def program_for(self, variables: Mapping[str, Any]) -> Any:
        """The program to run on ``variables``: the one reading ``facts`` where they hold the call's facts."""
        return self.with_facts if self.with_facts is not None and "facts" in variables else self.program


@dataclass(frozen=True)
class CompiledLabel:
    """A label rule with its CEL condition and pattern compiled."""

    label: str
    tools: tuple[str, ...]
    reads_answers: bool
    """Whether ``when`` names ``answers``: it runs only when its policy was asked about the result."""
    program: Any = field(default=None, repr=False)
    pattern: Any = field(default=None, repr=False)
    """A compiled ``regex`` pattern, or ``None``."""

    def reads(self, tool_name: str) -> bool:
        """Whether this rule reads results of ``tool_name``."""
        return any(fnmatch.fnmatchcase(tool_name, pattern) for pattern in self.tools)


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
    mode: str = "enforce"
    """``enforce``, or ``shadow``: decided and audited, never blocking."""
    labels: tuple[CompiledLabel, ...] = ()
    screens: dict[str, str] = field(default_factory=dict)
    """Questions a screen answers in the gate's process (question id -> screen name), not the engine."""
    _applies_program: Any = field(default=None, repr=False)
    _fact_programs: tuple[tuple[str, Any], ...] = field(default=(), repr=False)
    """The facts' programs, where a rule reads a fact (facts only ``applies_to.when`` or a label rule
    reads are worked out where they are written out, so a call does not pay for them twice)."""

    def fact_values(self, variables: Mapping[str, Any]) -> dict[str, Any] | None:
        """Each fact's value on a call's ``variables``, worked out once for all the rules that read it;
        ``None`` where the policy has none or one cannot be evaluated (the rules then work their facts
        out inside their own conditions, as written out, so an error reads as it always did)."""
        if not self._fact_programs:
            return None
        try:
            return {name: program.execute(variables) for name, program in self._fact_programs}
        except Exception:  # e.g. a string method on a number: leave it to each rule, where CEL may absorb it
            return None

    def matches(
        self,
        tool_name: str,
        *,
        phase: str,
        step: str | None,
        context: Mapping[str, Any],
        tool: Mapping[str, Any],
        flow: Mapping[str, Any] | None = None,
    ) -> bool:
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
        variables = {"tool": dict(tool), "context": dict(context), **(flow or EMPTY_FLOW)}
        return self._applies_program.execute(variables) is True

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

    def with_state(self, **changes: Any) -> Policy:
        """A copy whose ``state:`` section has ``changes`` (``policy.with_state(result_lines=True)``), validated."""
        try:
            state = StateView.model_validate({**self.state.model_dump(), **changes})
        except ValidationError as exc:
            raise PolicyError(f"policy {self.name!r}: invalid state change {changes!r}: {exc}", field="state") from exc
        return replace(self, state=state)

    def without_screens(self) -> Policy:
        """A copy whose every question goes to the engine (to compare an engine's reading with a screen's)."""
        return replace(self, screens={})

    def without_trusted_reading(self) -> Policy:
        """A copy that reads each call once, as it is: no second reading without earlier results
        and prose (``state.check_without_results`` and ``check_without_prose`` off). Faster, and
        open to what the red team's injections do through those (SECURITY.md)."""
        return self.with_state(check_without_results=False, check_without_prose=False)


def builtin_policies() -> list[str]:
    """The names of the built-in policies, each loadable by name (``load_policy("destructive-actions")``)."""
    return sorted(entry.name.rsplit(".", 1)[0] for entry in files(BUILTIN_PACKAGE).iterdir() if entry.name.endswith(".yaml"))


def load_policies(*paths: str | Path) -> list[Policy]:
    """Load policy files or built-in policies by name; a folder loads its ``*.yaml`` and ``*.yml`` files in name order."""
    found: list[Path] = []
    for path in map(_resolve, paths):
        if path.is_dir():
            found += sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
        else:
            found.append(path)
    policies = [load_policy(p) for p in found]
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
    """Load and compile one policy file, or a built-in policy by name (see :func:`builtin_policies`)."""
    path = _resolve(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"cannot read the file: {exc}", file=str(path)) from None
    return parse_policy(text, source=str(path))


def parse_policy(text: str, *, source: str = "<policy>") -> Policy:
    """Validate and compile a policy from YAML text; ``source`` names it in errors."""
    root, data = compose(text, source)
    if not isinstance(data, dict):
        raise PolicyError(
            "a policy file must be a YAML mapping", file=source, line=1, column=1, hint="start with 'version: 1'"
        )
    try:
        spec = PolicyFile.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, root, source) from None
    except (TypeError, ValueError, RecursionError) as exc:
        raise PolicyError(f"invalid policy: {exc}", file=source, line=1, column=1) from None
    where = Locator(root, source, text)
    try:
        if spec.questions:
            parse_questions(spec.questions)
    except RequestError as exc:
        path = ["questions", exc.question or "", *(exc.field or "").split(".")]
        raise where.error(str(exc).split(": ", 1)[-1], path) from None
    for qid, screen in spec.screens.items():
        if not isinstance(spec.questions.get(qid), Noul):
            raise where.error(f"screens names {qid!r}, which is not a noul question of this policy", ["screens", qid],
                              hint="a screen answers a yes/no (noul) question the policy defines")
        if screen not in SCREENS:
            raise where.error(f"no screen named {screen!r}", ["screens", qid], hint=f"known screens: {sorted(SCREENS)}")
        if spec.applies_to.phase != "after_tool" or not spec.state.tool_result:
            raise where.error("a screen reads the tool result: the policy needs applies_to.phase: after_tool and "
                              "state.tool_result: true", ["screens", qid])
    facts, fact_programs = _facts(spec, where)
    applies_program = None
    if spec.applies_to.when is not None:
        if found := re.search(r"\b(answers|thresholds)\b", spec.applies_to.when):
            raise where.error(
                f"applies_to.when names {found.group(1)!r}, which it cannot read",
                ["applies_to", "when"],
                hint="it decides whether the engine is asked at all, so it reads tool and context only; "
                "test answers in a rule",
                snippet=found.group(0),
            )
        applies_program = _compile(_expand(spec.applies_to.when, facts, ["applies_to", "when"], where), ["applies_to", "when"], where, spec)
    rules = tuple(
        CompiledRule(
            rule.id, rule.then, rule.message, rule.when,
            _compile(_expand(rule.when, facts, ["rules", i, "when"], where), ["rules", i, "when"], where, spec),
            answers_read(rule.when, spec.questions),
            cel.compile(rule.when) if _FACT.search(rule.when) else None,
        )
        for i, rule in enumerate(spec.rules)
    )
    labels = tuple(_compile_label(label, i, where, spec, facts) for i, label in enumerate(spec.labels))
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
        mode=spec.mode,
        labels=labels,
        screens=dict(spec.screens),
        _applies_program=applies_program,
        _fact_programs=tuple(fact_programs.items()) if any(rule.with_facts is not None for rule in rules) else (),
    )


def _compile_label(label: LabelRule, index: int, where: Locator, spec: PolicyFile, facts: Mapping[str, str]) -> CompiledLabel:
    path: list[Any] = ["labels", index]
    reads_answers = bool(label.when and re.search(r"\banswers\b", label.when))
    if reads_answers and spec.applies_to.phase != "after_tool":
        raise where.error(
            "a label rule names 'answers', which only an after_tool policy has for a result",
            [*path, "when"],
            hint="set applies_to.phase: after_tool, or test the result with tool.result.matches(...)",
        )
    program = None
    if label.when is not None:
        program = _compile(_expand(label.when, facts, [*path, "when"], where), [*path, "when"], where, spec)
    pattern = None
    if label.pattern is not None:
        _check_regex(json.dumps(label.pattern), [*path, "pattern"], where)
        try:
            pattern = regex.compile(label.pattern)
        except regex.error as exc:
            raise where.error(f"invalid regular expression: {exc}", [*path, "pattern"]) from None
    return CompiledLabel(label.label, tuple(label.tools), reads_answers, program, pattern)


_FACT = re.compile(r"\bfacts\s*\.\s*([A-Za-z_]\w*)")


def _facts(spec: PolicyFile, where: Locator) -> tuple[dict[str, str], dict[str, Any]]:
    """Each fact's CEL, with the facts it names written out, and its program (compiled and dry-run on its own)."""
    facts: dict[str, str] = {}
    programs: dict[str, Any] = {}
    for name, expression in spec.facts.items():
        path = ["facts", name]
        if found := re.search(r"\b(answers|thresholds)\b", expression):
            raise where.error(
                f"fact {name!r} names {found.group(1)!r}, which a fact cannot read",
                path,
                hint="a fact reads tool, context, history and labels (so applies_to.when can use it); test answers in a rule",
                snippet=found.group(0),
            )
        facts[name] = _expand(expression, facts, path, where)
        programs[name] = _compile(facts[name], path, where, spec)
    return facts, programs


def _expand(expression: str, facts: Mapping[str, str], path: list[Any], where: Locator) -> str:
    """``expression`` with each ``facts.<name>`` replaced by that fact's CEL, in parentheses."""

    def written_out(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in facts:
            close = difflib.get_close_matches(name, sorted(facts), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"defined before this point: {sorted(facts) or 'none'}"
            raise where.error(f"names fact {name!r}, which this policy does not define", path, hint=hint, snippet=match.group(0))
        return f"({facts[name]})"

    return _FACT.sub(written_out, expression)


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


def answers_read(expression: str, questions: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The questions ``expression`` reads by name, in ``questions``' order; ``None`` when it reads
    ``answers`` in any other way (so a missing answer could change its value, not just fail it)."""
    named = {m.start(): m.group(2) or m.group(3) for m in _REFERENCE.finditer(expression) if m.group(1) == "answers"}
    for use in re.finditer(r"\banswers\b", expression):
        if use.start() not in named or re.search(r"\bhas\s*\(\s*$", expression[: use.start()]):
            return None
    return tuple(qid for qid in questions if qid in named.values())


def _compile(expression: str, path: list[Any], where: Locator, spec: PolicyFile) -> Any:
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
        _check_regex(match.group(1), path, where)
    _dry_run(program, expression, path, where, spec)
    return program


def _check_regex(literal: str, path: list[Any], where: Locator) -> None:
    """Raise when the CEL string ``literal`` is not an RE2 regular expression."""
    try:
        cel.evaluate(f'"".matches({literal})')
    except (RuntimeError, ValueError) as exc:
        raise where.error(
            f"invalid regular expression: {str(exc).splitlines()[-1].strip()}",
            path,
            hint="CEL uses RE2: no look-ahead, look-behind or back-references",
            snippet=literal,
        ) from None


def _dry_run(program: Any, expression: str, path: list[Any], where: Locator, spec: PolicyFile) -> None:
    """Evaluate once on uniform answers to catch type errors and non-boolean results."""
    context = {
        "answers": probe_answers(spec.questions),
        "thresholds": dict(spec.thresholds),
        "tool": {
            "name": "", "args": {}, "args_json": "{}", "id": "", "result": "", "labels": [], "from_user": [],
            "annotations": dict.fromkeys(HINTS), "metadata": {}, "tags": [],
        },
        "context": {},
        "history": [{"id": "", "name": "", "args": {}, "verdict": "allow", "labels": [], "turns_ago": 1}],
        "labels": [],
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


def _resolve(path: str | Path) -> Path:
    """``path`` itself, or the built-in policy's file when ``path`` is a bare name that is no file here."""
    if isinstance(path, str) and _BUILTIN_NAME.fullmatch(path) and not Path(path).exists():
        builtin = files(BUILTIN_PACKAGE) / f"{path}.yaml"
        if not builtin.is_file():
            raise PolicyError(
                f"no such file, and no built-in policy {path!r}",
                file=path,
                hint=f"built-in policies: {', '.join(builtin_policies())}",
            )
        return Path(str(builtin))
    return Path(path)
