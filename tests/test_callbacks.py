"""The callback handler records every tool start and, when asked, stops denied tools."""

from __future__ import annotations

from pathlib import Path

import pytest
from clef_guard.integrations.callbacks import (
    AsyncGuardCallbackHandler,
    GuardCallbackHandler,
)
from langchain_core.tools import tool
from model import ScriptedDecisionModel
from test_langchain_middleware import POLICY

from clef_guard import Guard, ToolBlockedError, parse_policy


def _write_tool(folder: Path):  # noqa: ANN202
    @tool
    def write_note(name: str, text: str) -> str:
        """Write a note file."""
        (folder / name).write_text(text)
        return "ok"

    return write_note


def _guard() -> Guard:
    return Guard([parse_policy(POLICY)], engine=ScriptedDecisionModel())


def test_stops_by_default_and_only_records_when_told(tmp_path: Path) -> None:
    """Fail closed: LangChain swallows a handler's error unless it raises, so raising is the default."""
    write = _write_tool(tmp_path)
    with pytest.raises(ToolBlockedError, match="rule 'protected'"):
        write.invoke({"name": "keep.txt", "text": "x"}, config={"callbacks": [GuardCallbackHandler(_guard())]})
    assert not (tmp_path / "keep.txt").exists()
    recorder = GuardCallbackHandler(_guard(), raise_error=False)
    write.invoke({"name": "keep.txt", "text": "x"}, config={"callbacks": [recorder]})
    assert (tmp_path / "keep.txt").exists()  # recorded only
    (verdict,) = recorder.verdicts
    assert verdict.action == "deny" and verdict.rule == "protected"


def test_raise_error_stops_a_denied_tool_and_lets_others_run(tmp_path: Path) -> None:
    handler = GuardCallbackHandler(_guard(), raise_error=True)
    write = _write_tool(tmp_path)
    with pytest.raises(ToolBlockedError, match="rule 'protected'") as info:
        write.invoke({"name": "keep.txt", "text": "x"}, config={"callbacks": [handler]})
    assert not (tmp_path / "keep.txt").exists()
    assert info.value.verdict.action == "deny"
    write.invoke({"name": "free.txt", "text": "y"}, config={"callbacks": [handler]})
    assert (tmp_path / "free.txt").read_text() == "y"
    assert [v.action for v in handler.verdicts] == ["deny", "allow"]


async def test_async_handler_stops_an_async_tool_on_confirm(tmp_path: Path) -> None:
    @tool("write_note")
    async def awrite_note(name: str, text: str) -> str:
        """Write a note file."""
        (tmp_path / name).write_text(text)
        return "ok"

    handler = AsyncGuardCallbackHandler(_guard(), raise_error=True)
    with pytest.raises(ToolBlockedError, match="confirm"):
        await awrite_note.ainvoke({"name": "ask.txt", "text": "x"}, config={"callbacks": [handler]})
    assert not (tmp_path / "ask.txt").exists()


async def test_an_async_handler_cannot_stop_a_sync_tool(tmp_path: Path) -> None:
    """langchain-core runs async handlers of sync tools on a side loop and swallows their
    errors: the documented reason to pair sync tools with the sync handler."""
    handler = AsyncGuardCallbackHandler(_guard(), raise_error=True)
    await _write_tool(tmp_path).ainvoke({"name": "ask.txt", "text": "x"}, config={"callbacks": [handler]})
    assert (tmp_path / "ask.txt").exists() and handler.verdicts[0].action == "confirm"
