"""What the examples share: a printer for verdicts, and the scripted chat model.

No LLM is reachable offline, so each agent's model is scripted
(``clef_guard.integrations.testing.ScriptedChatModel``): it proposes a fixed sequence of
tool calls. Everything around it (tools, graphs, checkpointer, guard, engine) is real.
"""

from __future__ import annotations

from clef_guard.integrations.testing import ScriptedChatModel as ScriptedChatModel
from rich.console import Console

from clef_guard import Verdict

console = Console()
_COLOURS = {"allow": "green", "confirm": "yellow", "escalate": "magenta", "deny": "red"}


def print_verdict(verdict: Verdict) -> None:
    """One line per decision, then the probabilities that decided it."""
    if verdict.phase == "after_tool" and not verdict.decisions:
        if verdict.labels:  # no policy screens this result, but label rules marked it
            console.print(f"  result of [bold]{verdict.tool_call['name']}[/bold] labeled {', '.join(verdict.labels)}", highlight=False)
        return
    colour = _COLOURS[verdict.action]
    call = verdict.tool_call
    who = f"{verdict.policy}/{verdict.rule or 'default'}" if verdict.policy else "no enforced policy" if verdict.decisions else "no policy"
    if verdict.shadowed is not None:  # a policy in shadow mode decided stricter: audited, not enforced
        shadow = verdict.shadowed
        who += f" (shadow: {shadow.policy}/{shadow.rule or 'default'} would {shadow.action})"
    console.print(
        ("  result of " if verdict.phase == "after_tool" else "")
        + f"[bold]{call['name']}[/bold]({', '.join(f'{k}={v!r}' for k, v in call['args'].items())})\n"
        f"  verdict [{colour}]{verdict.action}[/{colour}] by {who} in {verdict.latency_ms:.0f} ms"
        + (f": {verdict.message}" if verdict.message else "")
        + (f" (its arguments carry: {', '.join(call['labels'])})" if call.get("labels") else ""),
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
                level = max(answer.probabilities, key=answer.probabilities.__getitem__)  # rules read the expected level
                shown.append(f"{qid}={answer.score:.3f} (most likely {level}, {answer.probabilities[level]:.2f})")
        console.print(f"    {decision.policy}: {decision.action}; " + ", ".join(shown), style="dim", highlight=False)
