"""clef-guard: calibrated guardrails for LangGraph and LangChain agents."""

from clef_guard._backbone import CACHE_ENV as CACHE_ENV
from clef_guard._backbone import EMBEDDED_MODEL as EMBEDDED_MODEL
from clef_guard._engine import LocalClassifierResponse as LocalClassifierResponse
from clef_guard._engine import LocalDecisionModel as LocalDecisionModel
from clef_guard._errors import ClefGuardError as ClefGuardError
from clef_guard._errors import EngineError as EngineError
from clef_guard._errors import EngineTimeoutError as EngineTimeoutError
from clef_guard._errors import ModelLoadError as ModelLoadError
from clef_guard._errors import RequestError as RequestError
from clef_guard._errors import UnsupportedQuestionError as UnsupportedQuestionError
from clef_guard._head import DecisionHead as DecisionHead

__all__ = [
    "CACHE_ENV",
    "EMBEDDED_MODEL",
    "ClefGuardError",
    "DecisionHead",
    "EngineError",
    "EngineTimeoutError",
    "LocalClassifierResponse",
    "LocalDecisionModel",
    "ModelLoadError",
    "RequestError",
    "UnsupportedQuestionError",
]
