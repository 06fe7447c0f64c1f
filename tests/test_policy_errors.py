"""Policy loading: every fault is a PolicyError naming file, line, column and field."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from clef_guard import PolicyError, load_policies, load_policy, parse_policy

GOOD = textwrap.dedent(
    """\
    version: 1
    name: demo
    applies_to:
      tools: [delete_*]
    questions:
      destructive:
        type: noul
        instructions: Does this delete data?
      team:
        type: choice
        instructions: Which team owns it?
        criteria: {ops: null, dev: null}
    thresholds:
      destructive: 0.8
    rules:
      - id: block
        when: answers.destructive >= thresholds.destructive
        then: deny
        message: Deleting needs a person.
    """
)


def _broken(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


@pytest.mark.parametrize(
    ("text", "line", "field", "phrase", "hint"),
    [
        (_broken("  tools: [delete_*]", "  tools: [delete_*\n  x: 1"), 5, None, "malformed YAML", "indentation"),
        (_broken("name: demo", "name: demo\nnmae: x"), 3, "nmae", "unknown field 'nmae'", "did you mean 'name'"),
        (_broken("    then: deny", "    then: deny\n    thne: allow"), 19, "rules[0].thne", "unknown field", "then"),
        (_broken("answers.destructive >=", "answers.destructiv >="), 17, "rules[0].when", "question 'destructiv'", "did you mean 'destructive'"),
        (_broken(">= thresholds.destructive", ">= thresholds.high"), 17, "rules[0].when", "threshold 'high'", "destructive"),
        (_broken(">= thresholds.destructive", ">= (("), 17, "rules[0].when", "invalid CEL", "CEL reads like"),
        (_broken("destructive: 0.8", "destructive: 1.8"), 14, "thresholds.destructive", "less than or equal to 1", "from 0 to 1"),
        (_broken("criteria: {ops: null, dev: null}", "criteria: {}"), 12, "questions.team.criteria", "at least 1", "not be empty"),
        (_broken("    then: deny", "    then: block"), 18, "rules[0].then", "'allow', 'confirm', 'escalate' or 'deny'", None),
        (_broken("type: noul", "type: box"), 7, "questions.destructive", "does not match any of the expected tags", "noul, choice, score"),
        (_broken("version: 1\n", ""), 1, "version", "required", "add 'version:'"),
        (_broken("when: answers.destructive >= thresholds.destructive", "when: answers.destructive"), 17, "rules[0].when", "true or false", "compare"),
        (_broken("when: answers.destructive >= thresholds.destructive", "when: answers.team > 0.5"), 17, "rules[0].when", "CEL type error", None),
        (_broken("name: demo", "name: demo\nname: other"), 3, None, "appears twice", "keep one"),
        (_broken("answers.destructive >= thresholds.destructive", 'tool.name.matches("(?=rm)")'), 17, "rules[0].when", "invalid regular expression", "RE2"),
        (_broken("criteria: {ops: null, dev: null}", "criteria: {ops: null, OPS: null}"), 12, "questions.team.criteria.OPS", "same label", None),
        (_broken("name: demo\n", "name: demo\nfacts:\n  big: tool.args_json.size() > 99\n").replace("when: answers", "when: facts.bigg && answers"),
         19, "rules[0].when", "fact 'bigg'", "did you mean 'big'"),
        (_broken("name: demo\n", "name: demo\nfacts:\n  big: answers.destructive > 0.5\n"), 4, "facts.big", "names 'answers'", "test answers in a rule"),
        (_broken("name: demo\n", "name: demo\nfacts:\n  big: tool.name\n"), 4, "facts.big", "true or false", None),
        (_broken("name: demo\n", "name: demo\nfacts:\n  big: facts.huge\n  huge: tool.name == 'x'\n"), 4, "facts.big", "fact 'huge'", "defined before this point"),
        (_broken("name: demo\n", "name: demo\nfacts:\n  big-one: tool.name == 'x'\n"), 4, "facts", "must be an identifier", None),
    ],
)
def test_errors_point_at_the_fault(text: str, line: int, field: str | None, phrase: str, hint: str | None) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, source="demo.yaml")
    error = info.value
    assert error.file == "demo.yaml"
    assert error.line == line, str(error)
    assert error.column is not None and error.column >= 1
    if field is not None:
        assert error.field == field, str(error)
    assert phrase in str(error)
    if hint is not None:
        assert error.hint is not None and hint in error.hint
    assert str(error).startswith(f"demo.yaml:{line}:")


def test_yaml_booleans_in_text_fields_get_a_quoting_hint() -> None:
    with pytest.raises(PolicyError, match="quote it") as info:
        parse_policy(GOOD.replace("message: Deleting needs a person.", "message: no"))
    assert info.value.field == "rules[0].message" and info.value.line == 19


def test_the_good_policy_compiles() -> None:
    policy = parse_policy(GOOD)
    assert policy.name == "demo" and [r.id for r in policy.rules] == ["block"]
    assert policy.matches("delete_file", phase="before_tool", step=None, context={}, tool={"name": "delete_file", "args": {}})
    assert not policy.matches("read_file", phase="before_tool", step=None, context={}, tool={"name": "read_file", "args": {}})


def test_facts_are_written_once_and_read_where_a_condition_is() -> None:
    text = _broken("applies_to:\n  tools: [delete_*]", "facts:\n  on_prod: has(tool.args.env) && tool.args.env == 'prod'\n"
                   "  prod_root: facts.on_prod && tool.args.path == '/'\napplies_to:\n  tools: [delete_*]\n  when: facts.on_prod")
    policy = parse_policy(text.replace("when: answers.destructive", "when: facts.prod_root || answers.destructive"))

    def verdict(args: dict, destructive: float) -> str | None:
        call = {"name": "delete_file", "args": args}
        if not policy.matches("delete_file", phase="before_tool", step=None, context={}, tool=call):
            return None
        variables = {"answers": {"destructive": destructive}, "thresholds": policy.thresholds, "tool": call, "context": {}}
        return next((rule.then for rule in policy.rules if rule.program.execute(variables) is True), policy.default)

    assert verdict({"env": "dev", "path": "/"}, 0.0) is None, "applies_to.when reads the fact"
    assert verdict({"env": "prod", "path": "/"}, 0.0) == "deny", "a fact naming an earlier fact decides the rule"
    assert verdict({"env": "prod", "path": "/tmp/x"}, 0.0) == "allow"
    assert verdict({"env": "prod", "path": "/tmp/x"}, 0.9) == "deny"


_DESTRUCTIVE = load_policy(Path(__file__).parent.parent / "policies" / "destructive-actions.yaml")
_COMMANDS = ["rm -rf /srv/cache", "git push --force origin main", "ls -la logs/", "kubectl delete ns staging", "sudo rm /etc/x", 42, None]
_QUERIES = ["DELETE FROM orders WHERE id = 3", "DROP TABLE users", "SELECT 1", "UPDATE t SET a = 1", 7]


@settings(max_examples=120, deadline=None)
@example(name="shell", command=42, query="SELECT 1", args_line="status", hint=None, destructive=0.71, requested=0.0, scope=0)
@given(
    name=st.sampled_from(["shell", "git", "run_sql", "delete_file", "kubectl", "remove_dir", "write_file"]),
    command=st.sampled_from(_COMMANDS), query=st.sampled_from(_QUERIES), args_line=st.sampled_from(["push --force", "status", 3]),
    hint=st.sampled_from([None, True, False]),
    destructive=st.sampled_from([0.0, 0.3, 0.69, 0.7, 0.71, 1.0]), requested=st.sampled_from([0.0, 0.5, 0.69, 0.7, 1.0]),
    scope=st.integers(0, 3),
)
def test_rules_read_a_calls_facts_worked_out_once_as_they_read_them_written_out(
    name: str, command: object, query: object, args_line: object, hint: bool | None, destructive: float, requested: float, scope: int
) -> None:
    """The shipped destructive policy's rules, reading its facts' values worked out once per call, decide
    (or fail) on every call as they do with the facts written out inside them, including calls where a
    fact cannot be evaluated (an argument of the wrong type): the rules then work them out as written."""
    from clef_guard.engine.answers import build_answer
    from clef_guard.engine.requests import parse_questions
    from clef_guard.gate.rules import cel_variables, first_deciding

    policy = _DESTRUCTIVE
    args = {key: value for key, value in {"command": command, "query": query, "args": args_line}.items() if value is not None}
    hints = {"destructiveHint": hint, "readOnlyHint": None, "openWorldHint": None, "idempotentHint": None}
    call = {"name": name, "args": args, "annotations": hints, "metadata": {}, "tags": []}
    probabilities = {"destructive": [1 - destructive, destructive], "requested": [1 - requested, requested],
                     "scope": [float(level == scope) for level in range(4)]}
    answers = {qid: build_answer(q, probabilities[qid])
               for qid, q in zip(policy.questions, parse_questions(policy.questions), strict=True)}
    bound = cel_variables(policy, answers, call, {})
    written_out = {key: value for key, value in bound.items() if key != "facts"}
    if all(isinstance(v, str) for k, v in args.items() if k in ("command", "query")):
        assert "facts" in bound
    if (name, command, query, hint) == ("shell", 42, "SELECT 1", None):  # no side of known_destructive holds: it fails
        assert "facts" not in bound
    (index, failure), (expected, expected_failure) = first_deciding(policy, bound), first_deciding(policy, written_out)
    assert index == expected and (failure is None) == (expected_failure is None)


def test_files_and_folders_load_and_names_must_be_unique(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(GOOD)
    (tmp_path / "b.yaml").write_text(GOOD)
    with pytest.raises(PolicyError, match="already used") as info:
        load_policies(tmp_path)
    assert info.value.file is not None and info.value.file.endswith("b.yaml")
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "missing.yaml")


def test_shipped_policies_all_load() -> None:
    policies = load_policies(Path(__file__).parent.parent / "policies")
    assert len(policies) >= 7
    assert {p.applies_to.phase for p in policies} == {"before_tool", "after_tool", "route"}


_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=12))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
_KEYS = ["version", "name", "applies_to", "state", "questions", "thresholds", "rules", "default", "on_error", "extra"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.just(yaml.safe_load(GOOD)), drop=st.sets(st.sampled_from(_KEYS)), replace=st.dictionaries(st.sampled_from(_KEYS), _values, max_size=3))
def test_malformed_policies_only_raise_policy_error(base: dict, drop: set[str], replace: dict) -> None:
    data = {k: v for k, v in base.items() if k not in drop}
    data.update(replace)
    try:
        parse_policy(yaml.safe_dump(data))
    except PolicyError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_only_raises_policy_error(text: str) -> None:
    try:
        parse_policy(text)
    except PolicyError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_arbitrary_rule_conditions_only_raise_policy_error(condition: str) -> None:
    try:
        parse_policy(GOOD.replace("answers.destructive >= thresholds.destructive", condition.replace("\n", " ")))
    except PolicyError:
        pass


def test_a_rule_that_divides_by_zero_is_refused_with_its_line() -> None:
    with pytest.raises(PolicyError, match="arithmetic error") as caught:
        parse_policy(GOOD.replace("answers.destructive >= thresholds.destructive", "1 / 0 > 0"))
    assert caught.value.line is not None


def test_a_state_change_is_validated_like_the_file() -> None:
    policy = load_policy("destructive-actions")
    assert policy.with_state(check_without_results=False).state.check_without_results is False
    assert policy.state.check_without_results is True  # a copy: the loaded policy is unchanged
    assert policy.state.checks_trusted and not policy.without_trusted_reading().state.checks_trusted
    with pytest.raises(PolicyError, match="destructive-actions") as raised:
        policy.with_state(messages=-1)
    assert raised.value.field == "state"
    with pytest.raises(PolicyError, match="no_such_field"):
        policy.with_state(no_such_field=True)
