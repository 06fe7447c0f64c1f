"""clef-guard: calibrated guardrails for LangGraph and LangChain agents."""

from clef_guard._audit import JsonlSpanExporter as JsonlSpanExporter
from clef_guard._backbone import CACHE_ENV as CACHE_ENV
from clef_guard._backbone import EMBEDDED_MODEL as EMBEDDED_MODEL
from clef_guard._engine import LocalClassifierResponse as LocalClassifierResponse
from clef_guard._engine import LocalDecisionModel as LocalDecisionModel
from clef_guard._errors import ClefGuardError as ClefGuardError
from clef_guard._errors import EngineError as EngineError
from clef_guard._errors import EngineTimeoutError as EngineTimeoutError
from clef_guard._errors import ModelLoadError as ModelLoadError
from clef_guard._errors import PolicyError as PolicyError
from clef_guard._errors import RemoteEngineError as RemoteEngineError
from clef_guard._errors import RequestError as RequestError
from clef_guard._errors import ToolBlockedError as ToolBlockedError
from clef_guard._errors import UnsupportedQuestionError as UnsupportedQuestionError
from clef_guard._gate import CheckOptions as CheckOptions
from clef_guard._gate import Guard as Guard
from clef_guard._gate import PolicyDecision as PolicyDecision
from clef_guard._gate import Verdict as Verdict
from clef_guard._gate import load_calibration as load_calibration
from clef_guard._head import DecisionHead as DecisionHead
from clef_guard._policy import Policy as Policy
from clef_guard._remote import RemoteDecisionModel as RemoteDecisionModel
from clef_guard._telemetry import Telemetry as Telemetry
from clef_guard._policy import load_policies as load_policies
from clef_guard._policy import load_policy as load_policy
from clef_guard._policy import parse_policy as parse_policy

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
    "load_calibration",
    "load_policies",
    "load_policy",
    "parse_policy",
]
