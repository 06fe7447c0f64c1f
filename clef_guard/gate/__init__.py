"""The gate: policies that apply -> one engine request per state view -> rules -> one verdict.

:mod:`~clef_guard.gate.view` builds what the engine reads, :mod:`~clef_guard.gate.rules`
applies a policy's rules to its answers, :mod:`~clef_guard.gate.verdict` holds the
results and :mod:`~clef_guard.gate.guard` runs a check end to end.
"""

from clef_guard.gate.guard import CheckOptions as CheckOptions
from clef_guard.gate.guard import Guard as Guard
from clef_guard.gate.verdict import PolicyDecision as PolicyDecision
from clef_guard.gate.verdict import Verdict as Verdict

__all__ = ["CheckOptions", "Guard", "PolicyDecision", "Verdict"]
