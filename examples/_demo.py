"""What the examples share: a scripted chat model and a printer for verdicts.

No LLM is reachable offline, so each agent's model is scripted: it proposes a fixed
sequence of tool calls. Everything around it (tools, graphs, checkpointer, guard,
engine) is real.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from rich.console import Console

from clef_guard import Verdict

console = Console()
_COLOURS = {"allow": "green", "confirm": "yellow", "escalate": "magenta", "deny": "red"}


class ScriptedChatModel(BaseChatModel):
    """Replays ``turns``: a list of ``(tool, args)`` calls per turn, or a final text."""

    turns: list[Any]

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, BaseMessage]:
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None, **kwargs: Any) -> ChatResult:
        turn = sum(isinstance(m, AIMessage) for m in messages)
        script = self.turns[turn] if turn < len(self.turns) else "All done."
        if isinstance(script, str):
            return ChatResult(generations=[ChatGeneration(message=AIMessage(script, id=f"ai-{turn}"))])
        calls = [{"name": n, "args": a, "id": f"call-{turn}-{i}", "type": "tool_call"} for i, (n, a) in enumerate(script)]
        return ChatResult(generations=[ChatGeneration(message=AIMessage("", tool_calls=calls, id=f"ai-{turn}"))])


def print_verdict(verdict: Verdict) -> None:
    """One line per decision, then the probabilities that decided it."""
    if verdict.phase == "after_tool" and not verdict.decisions:
        return  # no policy screens this tool's result
    colour = _COLOURS[verdict.action]
    call = verdict.tool_call
    who = f"{verdict.policy}/{verdict.rule or 'default'}" if verdict.policy else "no policy applies"
    console.print(
        ("  result of " if verdict.phase == "after_tool" else "")
        + f"[bold]{call['name']}[/bold]({', '.join(f'{k}={v!r}' for k, v in call['args'].items())})\n"
        f"  verdict [{colour}]{verdict.action}[/{colour}] by {who} in {verdict.latency_ms:.0f} ms"
        + (f": {verdict.message}" if verdict.message else ""),
        highlight=False,
    )
    for decision in verdict.decisions:
        shown = []
        for qid, answer in decision.answers.items():
            if answer.type == "noul":
                shown.append(f"{qid} P(yes)={answer.noul:.2f}")
            elif answer.type == "choice":
                shown.append(f"{qid}={answer.choice} ({answer.confidence:.2f})")
            else:
                shown.append(f"{qid}={answer.score:.2f}")
        console.print(f"    {decision.policy}: {decision.action}; " + ", ".join(shown), style="dim", highlight=False)
