"""Decision engines: ``langchain_core.decisions.BaseDecisionModel`` implementations.

One local answer, in order: :mod:`~clef_guard.engine.requests` validates the questions,
:mod:`~clef_guard.engine.state` renders the state, :mod:`~clef_guard.engine.prompt` lays
out the tokens, :mod:`~clef_guard.engine.tree` scores every option in one pass (queued by
:mod:`~clef_guard.engine.batching`, prefixes kept by :mod:`~clef_guard.engine.prefix_cache`),
:mod:`~clef_guard.engine.head` turns features into logits and
:mod:`~clef_guard.engine.answers` into langchain-core answers.
:mod:`~clef_guard.engine.remote` speaks the same API to a server.
"""

from clef_guard.engine.backbone import CACHE_ENV as CACHE_ENV
from clef_guard.engine.backbone import EMBEDDED_MODEL as EMBEDDED_MODEL
from clef_guard.engine.head import DecisionHead as DecisionHead
from clef_guard.engine.local import LocalClassifierResponse as LocalClassifierResponse
from clef_guard.engine.local import LocalDecisionModel as LocalDecisionModel
from clef_guard.engine.remote import RemoteDecisionModel as RemoteDecisionModel

__all__ = [
    "CACHE_ENV",
    "EMBEDDED_MODEL",
    "DecisionHead",
    "LocalClassifierResponse",
    "LocalDecisionModel",
    "RemoteDecisionModel",
]
