"""LocalDecisionModel as the classifier of langchain's own AutoMode and ModelRouter middleware."""

from __future__ import annotations

from pathlib import Path

import pytest
from clef_guard.integrations.testing import ScriptedChatModel
from langchain.agents import create_agent
from langchain.agents.middleware import (
    AutoModeMiddleware,
    ModelChoice,
    ModelRouterMiddleware,
)
from langchain_core.decisions import ChoiceAnswer
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool

from clef_guard import LocalDecisionModel


def test_auto_mode_classifies_with_the_local_engine(engine: LocalDecisionModel, tmp_path: Path) -> None:
    ran: list[str] = []

    @tool
    def delete_file(path: str) -> str:
        """Delete a file."""
        ran.append(path)
        return "deleted"

    agent = create_agent(
        ScriptedChatModel(turns=[[("delete_file", {"path": "/srv/db"})]]),
        [delete_file],
        middleware=[AutoModeMiddleware(tools=[delete_file], classifier=engine)],
    )
    result = agent.invoke({"messages": [("user", "clean up")]})
    (message,) = [m for m in result["messages"] if isinstance(m, ToolMessage)]
    # AutoMode blocks at P(risky) >= 0.5 and runs the tool otherwise: exactly one happened.
    blocked = "was blocked because it was classified as risky" in message.text
    assert blocked != bool(ran)


def test_model_router_routes_with_the_local_engine(engine: LocalDecisionModel) -> None:
    fast = ScriptedChatModel(turns=["fast answer"])
    strong = ScriptedChatModel(turns=["strong answer"])
    router = ModelRouterMiddleware(
        choices={
            "fast": ModelChoice(model=fast, criteria="Short factual questions."),
            "strong": ModelChoice(model=strong, criteria="Long multi-step reasoning tasks."),
        },
        instructions="Which model suits the user's task?",
        classifier=engine,
    )
    agent = create_agent(ScriptedChatModel(turns=["unused"]), [], middleware=[router])
    result = agent.invoke({"messages": [("user", "What is the capital of France?")]})
    route = result["model_route"]
    assert isinstance(route, ChoiceAnswer) and sum(route.probabilities.values()) == pytest.approx(1.0)
    assert result["messages"][-1].text == f"{route.choice} answer"  # the chosen model is the one that answered
    assert abs(sum(route.probabilities.values()) - 1) < 1e-9
    assert result["messages"][-1].text == f"{route.choice} answer"
