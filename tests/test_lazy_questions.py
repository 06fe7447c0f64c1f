"""Asking less: a policy asks only the questions its rules can use on the call (all at once, or lazily in
rounds), and decides exactly what all its answers would."""

from __future__ import annotations

import textwrap
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from langchain_core.decisions import Noul
from langchain_core.messages import HumanMessage
from model import ScriptedDecisionModel
from test_gate import DESTRUCTIVE

from clef_guard import Guard, load_policies, parse_policy
from clef_guard.engine.answers import build_answer
from clef_guard.engine.requests import parse_questions
from clef_guard.gate.guard import situation
from clef_guard.gate.rules import cel_value, evaluate_rules, next_questions, relevant_questions
from clef_guard.policy.load import builtin_policies

SHIPPED = [p for p in load_policies(*builtin_policies()) if p.questions]
CALLS = [
    {"name": "delete_file", "args": {"path": "notes/old.log"}},
    {"name": "shell", "args": {"command": "rm -rf / --no-preserve-root"}},
    {"name": "run_sql", "args": {"query": "DELETE FROM orders"}},
    {"name": "run_sql", "args": {"query": "DELETE FROM orders WHERE id = 4"}},
    {"name": "send_email", "args": {"to": "ana@partner.example", "subject": "Q3", "body": "figures attached"}},
    {"name": "transfer_money", "args": {"amount": 1200, "to_account": "DE44 5001 0517 5407 3249 31"}},
    {"name": "share_file", "args": {"path": "crm/customers.csv", "with": "anyone"}},
    {"name": "route", "args": {}},
]


def _answers(policy: Any, draw: st.DrawFn) -> dict[str, Any]:
    answers = {}
    for parsed in parse_questions(policy.questions):
        weights = [draw(st.floats(0.001, 1.0)) for _ in parsed.options]
        answers[parsed.id] = build_answer(parsed, [w / sum(weights) for w in weights])
    return answers


@settings(max_examples=300, deadline=None)
@given(data=st.data(), lazy=st.booleans())
def test_asking_less_decides_what_every_answer_decides(data: st.DataObject, lazy: bool) -> None:
    policy = data.draw(st.sampled_from(SHIPPED), label="policy")
    call, flow = situation(data.draw(st.sampled_from(CALLS), label="call"), None, {})
    every = _answers(policy, data.draw)
    eager = evaluate_rules(policy, every, call, {}, flow=flow)
    relevant = relevant_questions(policy, call, {}, flow)
    asked: dict[str, Any] = {}
    rounds = 0
    while wanted := next_questions(policy, asked, call, {}, flow, at_once=not lazy, relevant=relevant):
        assert not set(wanted) & set(asked), "a question is never asked twice"
        asked.update({qid: every[qid] for qid in wanted})
        rounds += 1
    fewer = evaluate_rules(policy, asked, call, {}, flow=flow)
    assert (fewer.action, fewer.rule, fewer.message, fewer.error) == (eager.action, eager.rule, eager.message, eager.error)
    assert set(asked) <= set(relevant), "the forecast never misses a question a shipped policy's rules need"
    assert rounds <= (2 if lazy else 1)  # lazily: the first question, then what the remaining rules read


def test_a_question_the_calls_facts_settle_is_not_asked() -> None:
    policy = load_policies("destructive-actions")[0]
    for call, relevant in [
        ({"name": "delete_file", "args": {"path": "notes/a.md"}}, ("requested", "scope")),  # destructive by its name
        ({"name": "remove_label", "args": {"issue": 7, "label": "bug"}}, ("requested", "scope")),
        ({"name": "run_sql", "args": {"query": "DELETE FROM t WHERE id = 1"}}, ("requested", "scope")),
        ({"name": "move_file", "args": {"source": "a", "target": "b"}}, ("destructive", "requested", "scope")),
        ({"name": "shell", "args": {"command": "rm -rf /"}}, ()),  # a rule over the call alone denies
    ]:
        checked, flow = situation(call, None, {})
        assert relevant_questions(policy, checked, {}, flow) == relevant, call


TWO_QUESTIONS = textwrap.dedent(
    """\
    version: 1
    name: two-questions
    applies_to: {tools: [delete_*]}
    questions:
      a: {type: noul, instructions: 'Question a?'}
      b: {type: noul, instructions: 'Question b?'}
    rules:
      - {id: one, when: 'WHEN', then: deny, message: m}
    """
)


def _two_questions(when: str) -> Any:
    """A policy asking questions a and b on delete_* calls, with one rule."""
    return parse_policy(TWO_QUESTIONS.replace("WHEN", when))


def test_a_forecast_that_misses_asks_again() -> None:
    policy = _two_questions("answers.a == 0.5 && answers.b > 0.5")  # b matters only where a is exactly 0.5: no corner
    call, flow = situation({"name": "delete_file", "args": {}}, None, {})
    assert relevant_questions(policy, call, {}, flow) == ("a",)
    engine = ScriptedDecisionModel(script={"Question a": 0.5, "Question b": 0.9})
    verdict = Guard([policy], engine=engine).check({"name": "delete_file", "args": {}, "id": "c1"}, {"messages": []})
    assert [[q.instructions for q in c["questions"].values()] for c in engine.calls] == [["Question a?"], ["Question b?"]]
    assert verdict.action == "deny"


def test_a_forecast_past_its_budget_keeps_every_question() -> None:
    # nine yes/no questions: 512 corners, more than the budget; the rule never reads b1 .. b8
    questions = {"a": Noul(instructions="Question a?"), **{f"b{i}": Noul(instructions=f"Question b{i}?") for i in range(1, 9)}}
    small = replace(_two_questions("answers.a > 0.5"), questions=dict(list(questions.items())[:2]))
    large = replace(small, questions=questions)
    call, flow = situation({"name": "delete_file", "args": {}}, None, {})
    assert relevant_questions(small, call, {}, flow) == ("a",)
    assert relevant_questions(large, call, {}, flow) == tuple(questions)


def test_lazy_and_every_question_are_refused_together() -> None:
    with pytest.raises(ValueError, match="pick one"):
        Guard([_two_questions("answers.a > 0.5")], engine=ScriptedDecisionModel(), lazy=True, every_question=True)


def test_a_rule_that_reads_the_answers_map_as_a_whole_asks_every_question_at_once() -> None:
    policy = _two_questions("answers.a > 0.5 || has(answers.b)")
    call, flow = situation({"name": "delete_file", "args": {}}, None, {})
    assert policy.rules[0].reads is None
    assert next_questions(policy, {}, call, {}, flow) == ("a", "b")


@pytest.mark.parametrize(
    ("path", "script", "asked", "action"),
    [
        ("/", {}, [], "deny"),  # a rule over the call alone decides: the engine is never asked
        ("a.txt", {"delete": 0.1}, [["destructive"]], "allow"),
        ("a.txt", {"delete": 0.95, "How much": "0"}, [["destructive"], ["scope"]], "confirm"),
        ("a.txt", {"delete": 0.95, "How much": "2"}, [["destructive"], ["scope"]], "deny"),  # escalate, no reviewer
        ("a.txt", {"delete": 0.6}, [["destructive"]], "deny"),  # unsure: escalate; scope never matters
    ],
)
def test_a_lazy_guard_asks_in_rounds_and_gives_the_eager_verdict(
    path: str, script: dict[str, Any], asked: list[list[str]], action: str
) -> None:
    verdicts = {}
    for lazy in (True, False):
        engine = ScriptedDecisionModel(script=script)
        guard = Guard([parse_policy(DESTRUCTIVE)], engine=engine, lazy=lazy)
        verdicts[lazy] = guard.check({"name": "delete_file", "args": {"path": path}, "id": "c1"}, {"messages": []})
        if lazy:
            names = {q.instructions: qid for qid, q in guard.policies[0].questions.items()}
            assert [[names[q.instructions] for q in call["questions"].values()] for call in engine.calls] == asked
    assert verdicts[True].action == verdicts[False].action == action
    assert verdicts[True].rule == verdicts[False].rule


def test_lazy_rounds_share_one_timeout() -> None:
    engine = ScriptedDecisionModel(script={"delete": 0.9}, delay_s=0.3)
    guard = Guard([parse_policy(DESTRUCTIVE)], engine=engine, lazy=True, timeout_s=0.45)
    verdict = guard.check({"name": "delete_file", "args": {"path": "a.txt"}, "id": "c1"}, {"messages": []})
    assert verdict.action == "deny" and "did not answer" in (verdict.error or "")


def _numbers(answer: Any) -> dict[str, float]:
    value = cel_value(answer)
    return {"yes": value} if isinstance(value, float) else {str(k): float(v) for k, v in value["probabilities"].items()}


def test_the_embedded_engine_asked_less_agrees_with_asking_everything(engine: Any) -> None:
    policies = load_policies("destructive-actions", "outbound-communication")
    state = {"messages": [HumanMessage("Tidy the build folder and tell Ana at the agency the release moved to Friday.")]}
    calls = [
        {"name": "delete_file", "args": {"path": "build/cache/tmp-1.bin"}, "id": "a"},
        {"name": "write_file", "args": {"path": "notes/friday.md", "content": "Release moved to Friday."}, "id": "b"},
        {"name": "send_email", "args": {"to": "ana@agency.example", "body": "The release moved to Friday."}, "id": "c"},
        {"name": "shell", "args": {"command": "rm -rf / "}, "id": "d"},
    ]
    for call in calls:
        engine.clear_prefix_cache()
        every = Guard(policies, engine=engine, every_question=True).check(call, state)
        for lazy in (False, True):
            engine.clear_prefix_cache()
            fewer = Guard(policies, engine=engine, lazy=lazy).check(call, state)
            assert (fewer.action, fewer.policy, fewer.rule) == (every.action, every.policy, every.rule), call["name"]
            for first, second in zip(every.decisions, fewer.decisions, strict=True):
                assert set(second.answers) <= set(first.answers)
                for qid, answer in second.answers.items():
                    assert _numbers(answer) == pytest.approx(_numbers(first.answers[qid]), abs=1e-4), qid
            skipped = sum(map(len, (d.answers for d in fewer.decisions))) < sum(map(len, (d.answers for d in every.decisions)))
            computed = fewer.input_tokens - fewer.cached_tokens, every.input_tokens - every.cached_tokens
            assert computed[0] < computed[1] if skipped else computed[0] <= computed[1] + 8, (call["name"], lazy, computed)
        if call["name"] == "delete_file":  # destructive by its name: `destructive` is never asked
            assert "destructive" in every.decisions[0].answers and "destructive" not in fewer.decisions[0].answers
    assert Guard(policies, engine=engine).check(calls[3], state).input_tokens == 0  # rm -rf /: the rules alone
