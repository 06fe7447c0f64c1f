"""The schema of a policy file, as pydantic models (strict: unknown fields are errors)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from langchain_core.decisions import Choice, Noul, Score
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

Action = Literal["allow", "confirm", "escalate", "deny"]
Phase = Literal["before_tool", "after_tool", "route"]
Mode = Literal["enforce", "shadow"]
SEVERITY: dict[str, int] = {"allow": 0, "confirm": 1, "escalate": 2, "deny": 3}
"""Strictness order: when several policies decide, the strictest action wins."""

PolicyQuestion = Annotated[Noul | Choice | Score, Field(discriminator="type")]
_NAME = r"^[a-z0-9][a-z0-9_.-]*$"


class _Strict(BaseModel):
    """No unknown fields and no coercion: YAML's ``no``, ``'0.7'`` or ``true`` is not a number."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class AppliesTo(_Strict):
    """Which situations a policy checks."""

    tools: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    """Tool-name globs (``delete_*``, ``send_?mail``, ``*``)."""
    steps: list[str] | None = None
    """Graph step or route-name globs; ``None`` matches any step."""
    when: str | None = None
    """A CEL condition over ``tool``, ``context``, ``history`` and ``labels`` (e.g. argument checks)."""
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
    agent_text: bool = False
    """Show what the agent's model wrote besides its tool calls. Off by default: the agent's
    own prose is no evidence of what the user asked or what a call does, and whoever steers
    that model (an injected page, a compromised model) writes it."""
    fields: list[str] = Field(default_factory=list)
    """Top-level state keys to include besides the messages."""
    tool_result: bool = False
    result_window: int | None = Field(default=None, ge=200)
    """Read a tool result longer than this many characters in windows of it (overlapping by
    a fifth), each asked on its own: the policy decides on the window that makes it
    strictest, and its decision names that window (``span``). An attack after pages of
    ordinary text is then read beside little else, and a long page is judged a piece at a time."""
    result_lines: bool = False
    """Also read each line of a tool result on its own (consecutive lines grouped evenly into at
    most 4 readings), and decide on the strictest: text an attacker adds on lines of its own
    cannot change how the lines of another group read."""
    argument_lines: bool = False
    """Also read each line of the call's prose arguments on its own (at most 4 runs of lines an
    argument), each in the view without the other prose, and decide on the strictest: a line
    an attacker adds to a message body cannot change how its other lines read."""
    check_without_results: bool = True
    """When the messages shown hold earlier tool results, also decide without them and keep
    the stricter decision. Whoever wrote a page, a mail or a file the agent read writes its
    results: their text can then make the verdict stricter, never more permissive than the
    reading of what the user, the system and the calls themselves say."""
    check_without_prose: bool = True
    """When the call (or an earlier call shown) has arguments in prose, also decide without
    them and keep the stricter decision. The agent's model writes arguments, and whoever
    steers it: a reason, a note or a message body can then make the verdict stricter, never
    more permissive than the reading of the call's paths, ids, addresses and numbers and of
    what the user typed. Shares one second reading with ``check_without_results``."""

    @property
    def checks_trusted(self) -> bool:
        """Whether a second, trusted reading is asked for (either check above)."""
        return self.check_without_results or self.check_without_prose


class Rule(_Strict):
    """``when`` (CEL) holds -> ``then``; the first rule that holds decides."""

    id: str = Field(pattern=_NAME)
    when: str
    then: Action
    message: str = ""
    """Told to the agent (and shown to the user) when this rule decides."""


class LabelRule(_Strict):
    """Attach ``label`` to a tool result: a thread's later calls see it in ``labels`` (and,
    where the result's text reappears in their arguments, in ``tool.labels``)."""

    label: str = Field(pattern=_NAME)
    tools: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    """Tool-name globs whose results this rule reads."""
    when: str | None = None
    """A CEL condition over ``tool`` (with ``result``), ``context``, ``history``, ``labels``
    and, in an ``after_tool`` policy, its ``answers``; ``None`` always holds."""
    pattern: str | None = None
    """A regular expression (RE2 syntax) the result must match; its matches (or their group
    named ``mark``), not the whole result, are what later arguments are compared with."""


class PolicyFile(_Strict):
    """The schema of a policy file."""

    version: Literal[1]
    name: str = Field(pattern=_NAME)
    description: str = ""
    facts: dict[str, str] = Field(default_factory=dict)
    """Named CEL conditions over ``tool``, ``context``, ``history`` and ``labels`` (and the facts
    above them), read as ``facts.<name>`` in ``applies_to.when``, rules and label rules: a
    condition several rules share is written once."""
    applies_to: AppliesTo = Field(default_factory=AppliesTo)
    state: StateView = Field(default_factory=StateView)
    questions: dict[str, PolicyQuestion] = Field(default_factory=dict)
    """No questions: the rules decide alone, and the engine is never asked."""
    screens: dict[str, str] = Field(default_factory=dict)
    """Yes/no questions a screen answers in the gate's process instead of the engine: question id ->
    screen name (:data:`clef_guard.engine.screen.SCREENS`); the screen reads the tool result line by line."""
    thresholds: dict[str, Annotated[float, Field(ge=0.0, le=1.0)]] = Field(default_factory=dict)
    rules: list[Rule] = Field(default_factory=list)
    labels: list[LabelRule] = Field(default_factory=list)
    """Labels this policy attaches to tool results (read on every result, whatever ``applies_to.phase``)."""
    default: Action = "allow"
    """The action when no rule holds."""
    on_error: Action = "deny"
    """The action when the engine fails or times out, or a rule cannot be evaluated."""
    mode: Mode = "enforce"
    """``shadow``: decide and record as usual, but never block (the verdict it would have given is audited)."""

    @model_validator(mode="after")
    def _decides_something(self) -> PolicyFile:
        if not self.rules and not self.labels:
            raise ValueError("a policy needs rules, labels or both")
        return self

    @field_validator("questions", "facts")
    @classmethod
    def _identifiers(cls, named: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        what = "question id" if info.field_name == "questions" else "fact name"
        for name in named:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"{what} {name!r} must be an identifier (letters, digits, _) to be usable in CEL")
        return named
