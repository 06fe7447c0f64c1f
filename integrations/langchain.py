"""LangChain v1 agents: ``GuardMiddleware`` for ``create_agent``.

.. code-block:: python

    from langchain.agents import create_agent
    from langgraph.checkpoint.memory import InMemorySaver
    from clef_guard import Guard, load_policies
    from clef_guard.integrations.langchain import GuardMiddleware

    guard = Guard(load_policies("policies/"), human_review=True)
    agent = create_agent(model, tools, middleware=[GuardMiddleware(guard)], checkpointer=InMemorySaver())

A ``confirm`` or ``escalate`` verdict interrupts the run with a ``tool_approval`` request
(as LangChain's per-call human-in-the-loop does); resume it with
``Command(resume={interrupt.id: {"type": "approve"}})`` (or ``edit``, ``reject``, ``respond``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, NotRequired, Unpack

from clef_guard.integrations._tools import GateOptions, ToolGate
from langchain.agents.middleware import AgentMiddleware, AgentState
from langchain.agents.middleware.types import PrivateStateAttr, ToolCallRequest
from langchain_core.messages import ToolMessage
from langgraph.types import Command

from clef_guard import Guard
from clef_guard.gate.trail import merge_trail


class GuardState(AgentState):
    """The agent state with the thread's trail: gated calls and their results' labels (checkpointed, private)."""

    clef_guard_trail: NotRequired[Annotated[list[dict[str, Any]], PrivateStateAttr, merge_trail]]


class GuardMiddleware(AgentMiddleware):
    """Gate every tool call of a ``create_agent`` agent with a clef-guard :class:`Guard`.

    Parameters
    ----------
    guard
        The guard to ask. Give it ``human_review=True`` so escalations reach a person
        (through an interrupt) instead of being denied. The agent's state gains the
        thread's trail (:class:`GuardState`), which flow rules read as ``history`` and ``labels``.
    **options
        :class:`~clef_guard.integrations._tools.GateOptions`: ``allowed_decisions`` (what a
        reviewer may answer) and ``check_results`` (screen tool results for injection).
    """

    state_schema = GuardState

    def __init__(self, guard: Guard, **options: Unpack[GateOptions]) -> None:
        super().__init__()
        self.gate = ToolGate(guard, **options)

    @property
    def name(self) -> str:
        """Name of this middleware in the agent graph."""
        return "ClefGuardMiddleware"

    def wrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], ToolMessage | Command[Any]]
    ) -> ToolMessage | Command[Any]:
        """Gate the call; run it, stop it, or ask a human first."""
        return self.gate.wrap(request, handler)

    async def awrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]]
    ) -> ToolMessage | Command[Any]:
        """Async twin of :meth:`wrap_tool_call`."""
        return await self.gate.awrap(request, handler)


__all__ = ["GuardMiddleware", "GuardState"]
