"""What the gate decides: one :class:`PolicyDecision` per policy, combined into a :class:`Verdict`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class PolicyDecision:
    """What one policy decided, and from what."""

    policy: str
    action: str
    rule: str | None
    """The rule that held; ``None`` for the policy's default or its ``on_error``."""
    message: str
    answers: dict[str, Any]
    """This policy's answers (``langchain_core.decisions`` answers), by question id."""
    thresholds: dict[str, float]
    calibrated: bool
    error: str | None = None
    escalated: bool = False
    """Whether these answers came from the escalation engine."""
    enforced: bool = True
    """``False`` for a policy (or a guard) in shadow mode: recorded, never acted on."""
    span: tuple[int, int] | None = None
    """The characters of the tool result its answers read, when the policy reads results in
    windows (``state.result_window``): the window that made it strictest."""
    trusted_reading: bool = False
    """Whether this decision came from the reading without what the user and the system did
    not write (``state.check_without_results``, ``state.check_without_prose``), because that
    reading was the stricter one."""


@dataclass(frozen=True)
class Verdict:
    """The gate's decision for one tool call (or route)."""

    action: str
    """``allow``, ``confirm``, ``escalate`` (to a human reviewer) or ``deny``."""
    policy: str | None
    rule: str | None
    message: str
    decisions: tuple[PolicyDecision, ...]
    tool_call: dict[str, Any]
    latency_ms: float
    engine: str | None
    escalation_engine: str | None = None
    error: str | None = None
    phase: str = "before_tool"
    """``before_tool`` (a proposed call), ``after_tool`` (its result) or ``route``."""
    input_tokens: int = 0
    """Tokens the engines read for this decision, ``cached_tokens`` included."""
    shadowed: PolicyDecision | None = None
    """The strictest decision of a policy in shadow mode, when it is stricter than ``action``:
    what the guard would have done had it been enforced."""
    labels: tuple[str, ...] = ()
    """Labels the policies attached to the tool's result (``after_tool``)."""
    marks: tuple[str, ...] = ()
    """Provenance marks of the labeled text: hashes, never the text (:mod:`clef_guard.gate.trail`)."""
    thread_labels: tuple[str, ...] = ()
    """Every label the thread carried when the check ran."""
    cached_tokens: int = 0
    """Of ``input_tokens``, those an engine served from its prefix cache instead of computing."""
    familiarity: dict[str, dict[str, float]] = field(default_factory=dict)
    """By policy then question: how close the question came to one the engine's head was trained
    on (1: trained on verbatim; lower answers were moved towards even odds, see
    :mod:`clef_guard.engine.novelty`). Only questions an engine reported it for."""

    @property
    def enforced(self) -> bool:
        """Whether ``action`` is all the guard decided (no stricter shadow decision was set aside)."""
        return self.shadowed is None

    @property
    def allowed(self) -> bool:
        """Whether the tool may run without anyone's approval."""
        return self.action == "allow"

    @property
    def answers(self) -> dict[str, dict[str, Any]]:
        """Every answer, by policy then question id."""
        return {d.policy: d.answers for d in self.decisions}

    @property
    def thresholds(self) -> dict[str, dict[str, float]]:
        """The thresholds each policy used, after calibration."""
        return {d.policy: d.thresholds for d in self.decisions}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view (answers as plain dicts)."""
        data = asdict(self)
        data["decisions"] = [_plain(d) for d in self.decisions]
        data["shadowed"] = _plain(self.shadowed) if self.shadowed is not None else None
        return data


def _plain(decision: PolicyDecision) -> dict[str, Any]:
    return {**asdict(decision), "answers": {k: a.model_dump() for k, a in decision.answers.items()}}
