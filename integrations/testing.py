"""Testing helpers: a scripted chat model that proposes tool calls.

Tests and offline demos of guarded agents need a model that proposes known tool calls.
``ScriptedChatModel`` replays them, so the tools, graphs, checkpointers, guard and engine
around it run for real.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable


class ScriptedChatModel(BaseChatModel):
    """Replays ``turns``: each a list of ``(tool name, args)`` calls, or a final text.

    The n-th model call answers with turn n (counted from the AI messages already in the
    conversation), so a resumed run replays the same turn; past the script it says ``final``.
    """

    turns: list[Any]
    final: str = "Done."

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, BaseMessage]:
        """Tools are accepted and ignored: the script already names them."""
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None, **kwargs: Any) -> ChatResult:
        turn = sum(isinstance(m, AIMessage) for m in messages)
        script = self.turns[turn] if turn < len(self.turns) else self.final
        if isinstance(script, str):
            return ChatResult(generations=[ChatGeneration(message=AIMessage(script, id=f"ai-{turn}"))])
        calls = [{"name": n, "args": a, "id": f"call-{turn}-{i}", "type": "tool_call"} for i, (n, a) in enumerate(script)]
        return ChatResult(generations=[ChatGeneration(message=AIMessage("", tool_calls=calls, id=f"ai-{turn}"))])


__all__ = ["ScriptedChatModel"]
