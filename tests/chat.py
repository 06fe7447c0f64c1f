"""A scripted chat model that proposes tool calls, for real agents and graphs in tests.

No LLM is reachable offline, so the agent's model replays a fixed list of turns; the
tools, graphs, checkpointers, guard and engine around it are real.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable


class ScriptedChatModel(BaseChatModel):
    """Replays ``turns``: each a list of ``(tool name, args)`` calls, or a final text.

    The n-th model call answers with turn n (by counting AI messages already in the
    conversation), so a resumed run replays the same turn.
    """

    turns: list[Any]

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, BaseMessage]:
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        turn = sum(isinstance(m, AIMessage) for m in messages)
        script = self.turns[turn] if turn < len(self.turns) else "done"
        if isinstance(script, str):
            message = AIMessage(content=script, id=f"ai-{turn}")
        else:
            calls = [{"name": name, "args": args, "id": f"call-{turn}-{i}", "type": "tool_call"} for i, (name, args) in enumerate(script)]
            message = AIMessage(content="", tool_calls=calls, id=f"ai-{turn}")
        return ChatResult(generations=[ChatGeneration(message=message)])
