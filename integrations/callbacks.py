"""Callbacks: record (and optionally stop) tool calls in chains that have no middleware.

.. code-block:: python

    handler = GuardCallbackHandler(guard)      # fails closed: a stop raises
    chain.invoke(inputs, config={"callbacks": [handler]})
    handler.verdicts        # every tool start, as a gate decision

Where callbacks cannot gate safely (use ``GuardMiddleware`` or the LangGraph
integrations there):

- a handler can only *raise*: there is no way to ask a person (confirm and escalate
  are treated as stops), to edit a call, or to answer in the tool's place;
- a handler stops a tool by raising with ``raise_error=True`` (the default, so it fails
  closed); ``raise_error=False`` only records (LangChain then swallows the error), and
  every tool runs;
- a tool invoked without the callbacks (called directly, or in code that does not
  pass ``config`` on) is never seen;
- an async handler on a *sync* tool cannot stop it: langchain-core runs the handler on
  a side loop and logs its error instead of raising it; pair sync tools with
  ``GuardCallbackHandler`` and async tools with ``AsyncGuardCallbackHandler``;
- an executor that catches tool exceptions (``handle_tool_errors``) turns the stop into
  an error message for the model, which may try again; each try is gated again;
- the state the guard sees is only the tool's input, not the conversation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler

from clef_guard import Guard, ToolBlockedError, Verdict

_STOPPING = ("deny", "escalate", "confirm")


class _Recorder:
    """What both handler flavours share: turning a tool start into a call and a verdict into a stop."""

    guard: Guard
    verdicts: list[Verdict]
    stop_on: tuple[str, ...]
    raise_error: bool

    def __init__(self, guard: Guard, *, raise_error: bool = True, stop_on: Sequence[str] = _STOPPING) -> None:
        self.guard, self.raise_error, self.stop_on = guard, raise_error, tuple(stop_on)
        self.verdicts = []

    @staticmethod
    def _call(serialized: dict[str, Any] | None, input_str: str, event: dict[str, Any]) -> dict[str, Any]:
        args, run_id = event.get("inputs"), event.get("run_id")
        if args is None:
            try:
                parsed = json.loads(input_str)
                args = parsed if isinstance(parsed, dict) else {"input": parsed}
            except json.JSONDecodeError:
                args = {"input": input_str}
        return {"name": (serialized or {}).get("name") or "unknown_tool", "args": args, "id": str(run_id)}

    def _record(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        if self.raise_error and verdict.action in self.stop_on:
            raise ToolBlockedError(
                verdict,
                f"clef-guard stopped tool {verdict.tool_call['name']!r}: {verdict.action} by policy "
                f"{verdict.policy!r} (rule {verdict.rule!r}): {verdict.message}",
            )


class GuardCallbackHandler(_Recorder, BaseCallbackHandler):
    """Gate every tool start and raise :class:`ToolBlockedError` to stop it (``raise_error=False``: record only)."""

    run_inline = True

    def on_tool_start(self, serialized: dict[str, Any], input_str: str, **event: Any) -> None:
        """Check the tool call before the tool runs."""
        self._record(self.guard.check(self._call(serialized, input_str, event)))


class AsyncGuardCallbackHandler(_Recorder, AsyncCallbackHandler):
    """Async twin of :class:`GuardCallbackHandler`, for ``ainvoke`` and async tools."""

    run_inline = True

    async def on_tool_start(self, serialized: dict[str, Any], input_str: str, **event: Any) -> None:
        """Check the tool call before the tool runs."""
        self._record(await self.guard.acheck(self._call(serialized, input_str, event)))


__all__ = ["AsyncGuardCallbackHandler", "GuardCallbackHandler"]
