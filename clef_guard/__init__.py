"""clef-guard: calibrated guardrails for LangGraph and LangChain agents.

One decision flows policy -> gate -> engine -> telemetry: :mod:`clef_guard.policy`
compiles YAML into typed questions and rules, :mod:`clef_guard.gate` asks an engine and
applies the rules, :mod:`clef_guard.engine` answers (in process or remote) and
:mod:`clef_guard.telemetry` records every verdict as a span. Training lives apart, in
:mod:`clef_guard.training`, and nothing above imports it.
"""

from clef_guard.engine import CACHE_ENV as CACHE_ENV
from clef_guard.engine import EMBEDDED_MODEL as EMBEDDED_MODEL
from clef_guard.engine import DecisionHead as DecisionHead
from clef_guard.engine import LocalClassifierResponse as LocalClassifierResponse
from clef_guard.engine import LocalDecisionModel as LocalDecisionModel
from clef_guard.engine import RemoteDecisionModel as RemoteDecisionModel
from clef_guard.errors import ClefGuardError as ClefGuardError
from clef_guard.errors import EngineError as EngineError
from clef_guard.errors import EngineTimeoutError as EngineTimeoutError
from clef_guard.errors import ModelLoadError as ModelLoadError
from clef_guard.errors import PolicyError as PolicyError
from clef_guard.errors import RemoteEngineError as RemoteEngineError
from clef_guard.errors import RequestError as RequestError
from clef_guard.errors import ToolBlockedError as ToolBlockedError
from clef_guard.errors import UnsupportedQuestionError as UnsupportedQuestionError
from clef_guard.gate import CheckOptions as CheckOptions
from clef_guard.gate import Guard as Guard
from clef_guard.gate import PolicyDecision as PolicyDecision
from clef_guard.gate import Verdict as Verdict
from clef_guard.policy import Policy as Policy
from clef_guard.policy import builtin_policies as builtin_policies
from clef_guard.policy import load_calibration as load_calibration
from clef_guard.policy import load_policies as load_policies
from clef_guard.policy import load_policy as load_policy
from clef_guard.policy import parse_policy as parse_policy
from clef_guard.telemetry import JsonlSpanExporter as JsonlSpanExporter
from clef_guard.telemetry import Telemetry as Telemetry

__all__ = [
    "CACHE_ENV",
    "EMBEDDED_MODEL",
    "CheckOptions",
    "ClefGuardError",
    "DecisionHead",
    "EngineError",
    "EngineTimeoutError",
    "Guard",
    "JsonlSpanExporter",
    "LocalClassifierResponse",
    "LocalDecisionModel",
    "ModelLoadError",
    "Policy",
    "PolicyDecision",
    "PolicyError",
    "RemoteDecisionModel",
    "RemoteEngineError",
    "RequestError",
    "Telemetry",
    "ToolBlockedError",
    "UnsupportedQuestionError",
    "Verdict",
    "builtin_policies",
    "load_calibration",
    "load_policies",
    "load_policy",
    "parse_policy",
]
