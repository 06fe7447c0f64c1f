"""Shadow mode: policies decide and are audited as usual, and nothing they decide is enforced."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from clef_guard.integrations.langchain import GuardMiddleware
from clef_guard.integrations.testing import ScriptedChatModel
from langchain.agents import create_agent
from langchain_core.messages import ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from model import ScriptedDecisionModel
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from test_audit import Recorder
from test_langchain_middleware import _tools

from clef_guard import Guard, JsonlSpanExporter, PolicyError, parse_policy
from clef_guard.cli import main
from clef_guard.telemetry.audit import read_records, shadow_summary

STRICT = textwrap.dedent(
    """\
    version: 1
    name: strict
    mode: {mode}
    applies_to: {{tools: [delete_note, write_note]}}
    questions:
      destructive: {{type: noul, instructions: 'Would this delete data?'}}
    rules:
      - {{id: deletes, when: 'tool.name == "delete_note"', then: deny, message: No deleting.}}
      - {{id: writes, when: 'answers.destructive >= 0.0', then: confirm, message: Confirm every write.}}
    """
)
TURNS = [[("write_note", {"name": "a.txt", "text": "hi"})], [("delete_note", {"name": "old.txt"})], [("write_note", {"name": "b.txt", "text": "yo"})]]


def _run(folder: Path, middleware: list[Any]) -> list[str]:
    (folder / "old.txt").write_text("old")

    agent = create_agent(ScriptedChatModel(turns=TURNS), _tools(folder), middleware=middleware, checkpointer=InMemorySaver())
    result = agent.invoke({"messages": [("user", "tidy my notes")]}, {"configurable": {"thread_id": "s"}}, version="v2")
    assert not result.interrupts
    return [m.text for m in result.value["messages"] if isinstance(m, ToolMessage)]


@pytest.mark.parametrize("where", ["guard", "policy"])
def test_shadow_mode_never_changes_what_runs_and_audits_what_it_would_have_done(tmp_path: Path, where: str) -> None:
    (tmp_path / "plain").mkdir()
    unguarded = _run(tmp_path / "plain", [])
    recorder = Recorder()
    log = tmp_path / "audit.jsonl"
    recorder.tracer_provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(log)))
    policy = parse_policy(STRICT.format(mode="shadow" if where == "policy" else "enforce"))
    guard = Guard([policy], engine=ScriptedDecisionModel(), telemetry=recorder.telemetry, human_review=True,
                  mode="shadow" if where == "guard" else "enforce")
    (tmp_path / "guarded").mkdir()
    assert _run(tmp_path / "guarded", [GuardMiddleware(guard)]) == unguarded == ["wrote a.txt", "deleted old.txt", "wrote b.txt"]
    spans = [s for s in recorder.spans.get_finished_spans() if s.attributes["gen_ai.security.target.type"] == "tool_call"]
    decided = [(s.attributes["gen_ai.security.verdict.type"], s.attributes["clef_guard.enforced"], s.attributes["clef_guard.enforced.action"]) for s in spans]
    assert decided == [("confirm", False, "allow"), ("deny", False, "allow"), ("confirm", False, "allow")]
    assert all(s.attributes["gen_ai.security.policy.rule.id"] in {"writes", "deletes"} and s.events for s in spans)
    rows = shadow_summary(read_records([log]))
    assert rows == [
        {"policy": "strict", "rule": "deletes", "decisions": 1, "would": {"deny": 1}},
        {"policy": "strict", "rule": "writes", "decisions": 2, "would": {"confirm": 2}},
    ]


def test_a_policy_in_shadow_sits_beside_enforced_ones(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    lenient = STRICT.format(mode="enforce").replace("name: strict", "name: lenient").replace("then: deny", "then: confirm")
    recorder = Recorder()
    log = tmp_path / "audit.jsonl"
    recorder.tracer_provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(log)))
    guard = Guard([parse_policy(lenient), parse_policy(STRICT.format(mode="shadow"))], engine=ScriptedDecisionModel(),
                  telemetry=recorder.telemetry)
    verdict = guard.check({"name": "delete_note", "args": {"name": "x"}})
    assert (verdict.action, verdict.policy, verdict.enforced) == ("confirm", "lenient", False)
    assert verdict.shadowed is not None and (verdict.shadowed.policy, verdict.shadowed.action) == ("strict", "deny")
    assert [(d.policy, d.enforced) for d in verdict.decisions] == [("lenient", True), ("strict", False)]
    assert main(["audit", "summarize", str(log)]) == 0
    out = capsys.readouterr().out
    assert "shadow mode" in out and "deletes" in out


def test_an_engine_failure_in_shadow_is_audited_and_blocks_nothing() -> None:
    recorder = Recorder()
    guard = Guard([parse_policy(STRICT.format(mode="shadow"))], engine=ScriptedDecisionModel(fail=True), telemetry=recorder.telemetry)
    verdict = guard.check({"name": "write_note", "args": {"name": "x", "text": "y"}})
    assert verdict.action == "allow" and verdict.error and verdict.shadowed is not None and verdict.shadowed.action == "deny"
    (span,) = recorder.spans.get_finished_spans()
    assert span.attributes["error.type"] == "RuntimeError" and span.attributes["clef_guard.enforced"] is False


def test_modes_are_checked() -> None:
    with pytest.raises(ValueError, match="'enforce' or 'shadow'"):
        Guard([], engine=ScriptedDecisionModel(), mode="watch")  # type: ignore[arg-type]
    with pytest.raises(PolicyError) as info:
        parse_policy(STRICT.format(mode="watch"), source="p.yaml")
    assert (info.value.field, info.value.line) == ("mode", 3)
