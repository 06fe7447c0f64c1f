"""Every failure inside a check is a verdict: the policy's on_error, with its span and listener call."""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from langchain_core.decisions import (
    ChoiceAnswer,
    ClassifierResponse,
    Question,
    State,
)
from model import BareDecisionModel, ScriptedDecisionModel
from opentelemetry.trace import StatusCode
from test_audit import Recorder
from test_gate import DESTRUCTIVE, OUTBOUND

from clef_guard import (
    DecisionHead,
    EngineError,
    Guard,
    LocalDecisionModel,
    PolicyError,
    load_policy,
    parse_policy,
)

DELETE = {"name": "delete_file", "args": {"path": "/srv/backups/customers.db"}, "id": "c1"}
CHOOSY = textwrap.dedent(
    """\
    version: 1
    name: choosy
    questions:
      kind: {type: choice, instructions: 'Which kind of call is it?', criteria: {read: null, write: null}}
    rules:
      - {id: writes, when: 'answers.kind.choice == "write"', then: confirm}
    """
)


def test_a_nan_head_is_an_engine_error_and_the_shipped_policy_fails_closed(engine: LocalDecisionModel, tmp_path: Path) -> None:
    """A NaN head (fp16 overflow, a corrupt file) once read as P(yes) = 0 and allowed the delete."""
    head = DecisionHead(engine.backbone.hidden_size)
    with torch.no_grad():
        head.proj.weight.fill_(float("nan"))
    head.save(tmp_path / "nan.safetensors")
    broken = LocalDecisionModel(head=str(tmp_path / "nan.safetensors"))
    with pytest.raises(EngineError, match="not finite"):
        broken.invoke({"state": "rm -rf /srv/backups", "questions": {"d": parse_policy(DESTRUCTIVE).questions["destructive"]}})
    recorder = Recorder()
    verdict = Guard([load_policy("destructive-actions")], engine=broken, telemetry=recorder.telemetry).check(DELETE)
    assert verdict.action == "deny"
    assert verdict.error is not None and "not finite" in verdict.error
    (span,) = recorder.spans.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR


class _NanChoices(BareDecisionModel):
    """Any engine (hosted or local) can hand back NaN: the gate checks every answer itself."""

    model: str = "nan"

    def _classify(self, state: State, questions: dict[str, Question]) -> ClassifierResponse:
        nan = float("nan")
        answers = {qid: ChoiceAnswer(type="choice", choice="read", probabilities={"read": nan, "write": nan}, confidence=0.0) for qid in questions}
        return ClassifierResponse(model=self.model, answers=answers)


def test_non_finite_answers_from_any_engine_take_on_error() -> None:
    verdict = Guard([parse_policy(CHOOSY)], engine=_NanChoices()).check({"name": "anything", "args": {}})
    assert (verdict.action, verdict.rule) == ("deny", None)
    assert "not a probability" in (verdict.error or "")


def test_a_failing_lazy_engine_load_is_a_verdict_with_a_span_and_a_listener_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("CLEF_GUARD_CACHE", str(blocker / "cache"))  # the embedded model cannot be converted there
    seen: list[Any] = []
    recorder = Recorder()
    guard = Guard([parse_policy(DESTRUCTIVE)], telemetry=recorder.telemetry, on_verdict=[seen.append])
    verdict = guard.check({"name": "delete_file", "args": {"path": "/tmp/a"}})
    assert verdict.action == "deny" and verdict.error
    assert seen == [verdict]
    (span,) = recorder.spans.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR


def test_a_condition_that_fails_at_run_time_fails_closed_with_its_span() -> None:
    """run_sql(query=42) made the shipped policy's applies_to.when raise out of Guard.check."""
    recorder = Recorder()
    engine = ScriptedDecisionModel()
    guard = Guard([load_policy("destructive-actions")], engine=engine, telemetry=recorder.telemetry)
    verdict = guard.check({"name": "run_sql", "args": {"query": 42}})
    assert (verdict.action, verdict.policy) == ("deny", "destructive-actions")
    assert "applies_to.when could not be evaluated" in (verdict.error or "")
    assert engine.calls == []
    assert len(recorder.spans.get_finished_spans()) == 1


@pytest.mark.parametrize("name", ["answers", "thresholds"])
def test_a_condition_on_answers_is_refused_when_the_policy_loads(name: str) -> None:
    text = DESTRUCTIVE.replace("applies_to: {tools: [delete_*, drop_*]}", f"applies_to: {{tools: [delete_*], when: '{name}.destructive > 0.5'}}")
    with pytest.raises(PolicyError, match=f"names '{name}'") as info:
        parse_policy(text, source="p.yaml")
    assert (info.value.line, info.value.field) == (3, "applies_to.when")


def test_two_policies_with_one_name_are_refused() -> None:
    """Their answers mixed: a deny became an allow."""
    other = OUTBOUND.replace("name: outbound", "name: destructive")
    with pytest.raises(PolicyError, match="two policies are named 'destructive'"):
        Guard([parse_policy(DESTRUCTIVE), parse_policy(other)], engine=ScriptedDecisionModel())


HOSTILE = {
    "alias loop": "version: 1\nname: x\nx: &r [*r]\n",
    "billion laughs": "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi")),
    "deep nesting": "version: 1\nname: x\nx: " + "[" * 10_000 + "]" * 10_000 + "\n",
    "huge": "version: 1\nname: x\ndescription: '" + "x" * 300_000 + "'\n",
    "two documents": "version: 1\n---\nversion: 1\n",
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_policy_files_are_refused_quickly(kind: str) -> None:
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            parse_policy(HOSTILE[kind], source="evil.yaml")
        except BaseException as exc:  # noqa: BLE001 - the test inspects whatever came out
            outcome.append(exc)

    worker = threading.Thread(target=load, daemon=True)  # a daemon: a regression that hangs fails, not stalls
    worker.start()
    worker.join(timeout=5)
    assert not worker.is_alive(), "loading the file did not finish in 5 s"
    (error,) = outcome
    assert isinstance(error, PolicyError) and "evil.yaml" in str(error)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ("thresholds: {destructive: true, unsure: 0.4}", "thresholds.destructive"),
        ("thresholds: {destructive: no, unsure: 0.4}", "thresholds.destructive"),
        ("thresholds: {destructive: off, unsure: 0.4}", "thresholds.destructive"),
        ("thresholds: {destructive: '0.7', unsure: 0.4}", "thresholds.destructive"),
    ],
)
def test_wrong_types_are_errors_not_coerced(edit: str, field: str) -> None:
    """YAML's no/off once became 0, which turned a 'requested < threshold' rule off."""
    text = DESTRUCTIVE.replace("thresholds: {destructive: 0.8, unsure: 0.4}", edit)
    with pytest.raises(PolicyError) as info:
        parse_policy(text, source="p.yaml")
    assert info.value.field == field and info.value.line == 10


def test_a_boolean_message_count_is_an_error() -> None:
    text = DESTRUCTIVE.replace("questions:", "state: {messages: true}\nquestions:", 1)
    with pytest.raises(PolicyError, match="integer") as info:
        parse_policy(text, source="p.yaml")
    assert info.value.field == "state.messages"


def test_lint_reports_every_file_even_after_a_hostile_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from clef_guard.cli import main

    (tmp_path / "a-evil.yaml").write_text(HOSTILE["deep nesting"])
    (tmp_path / "b-good.yaml").write_text(DESTRUCTIVE)
    assert main(["lint", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "a-evil.yaml" in out and "nested deeper than 32 levels" in out
    assert "b-good.yaml" in out and "destructive (2 questions, 4 rules)" in out


def test_a_hung_engine_stalls_its_own_guard_only() -> None:
    """All Guards shared one 8-worker pool: 8 hung checks made every Guard deny."""
    hung = Guard([parse_policy(DESTRUCTIVE)], engine=ScriptedDecisionModel(delay_s=1.5), timeout_s=0.05)
    threads = [threading.Thread(target=hung.check, args=({"name": "delete_x", "args": {}},)) for _ in range(10)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    healthy = Guard([parse_policy(DESTRUCTIVE)], engine=ScriptedDecisionModel(script={"delete": 0.0}), timeout_s=1.0)
    verdict = healthy.check({"name": "delete_file", "args": {"path": "/tmp/a"}})
    assert (verdict.action, verdict.error) == ("allow", None)
    for thread in threads:
        thread.join()
