"""The public datasets as decision examples: splits, labels and sampling (files only, no model)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

from clef_guard.engine.state import to_json
from clef_guard.errors import ClefGuardError
from clef_guard.training.datasets import (
    DATASETS_ENV,
    SPLITS,
    TASKS,
    datasets_dir,
    load_task,
    sample_options,
    task_splits,
)
from clef_guard.training.examples import Example

try:
    ROOT = datasets_dir()
except ClefGuardError:
    pytest.skip("the public datasets folder is not on this machine", allow_module_level=True)


def _options(example: Example) -> set[str]:
    question = example.question
    if question.type == "score":
        return {str(level) for level in range(len(question.criteria))}
    return set(question.criteria) if question.type == "choice" else {"yes", "no"}


@pytest.mark.parametrize("task", TASKS)
def test_every_split_loads_with_labels_among_the_question_options(task: str) -> None:
    for split in task_splits(task):
        examples = load_task(task, split, limit=20)
        assert len(examples) == 20
        assert len({example.id for example in examples}) == 20
        for example in examples:
            assert example.state
            assert example.label in _options(example), (task, split, example.id)


def test_intent_sets_have_every_intent_as_an_option() -> None:
    (banking,) = load_task("banking77", "test", limit=1)
    (clinc,) = load_task("clinc150", "test", limit=1)
    (hwu,) = load_task("hwu64", "test", limit=1)
    assert len(banking.question.criteria) == 77
    assert len(hwu.question.criteria) == 64
    assert banking.question.criteria["card_arrival"] is None  # the label is its own description
    assert len(clinc.question.criteria) == 151
    assert "oos" in clinc.question.criteria


def test_home_assistant_keeps_each_group_of_paraphrases_in_one_split() -> None:
    groups = {split: {e.id.rsplit(":", 1)[0] for e in load_task("home-assistant", split)} for split in SPLITS}
    assert not groups["train"] & groups["test"] and not groups["dev"] & groups["test"] and not groups["train"] & groups["dev"]
    (row,) = load_task("home-assistant", "test", limit=1)
    assert len(row.question.criteria) == 33 and all(row.question.criteria.values())  # every intent described in words


@pytest.mark.parametrize(("task", "asks"), [("snips-asks", None), ("home-assistant-asks", "home-assistant")])
def test_asks_tasks_ask_each_request_of_its_own_intent_or_another(task: str, asks: str | None) -> None:
    rows = load_task(task, "test")
    assert 0.4 < sum(row.label == "yes" for row in rows) / len(rows) < 0.6
    assert len({row.question.instructions for row in rows}) > 5 and all(row.question.instructions.startswith("Is the user asking to ") for row in rows)
    assert [(r.question, r.label) for r in rows] == [(r.question, r.label) for r in load_task(task, "test")]  # seeded per row
    if asks:  # the same sentences, in the same splits, as the choice task
        intents = load_task(asks, "test")
        assert [(r.id, r.state) for r in rows] == [(r.id, r.state) for r in intents]
        described = {row.label: row.question.criteria[row.label] for row in intents}
        assert all((row.label == "yes") == (row.question.instructions == f"Is the user asking to {described[i.label]}?") for row, i in zip(rows, intents, strict=True))


def test_banking77_oos_holds_out_intents_and_domains_as_out_of_scope() -> None:
    splits = {split: load_task("banking77-oos", split) for split in SPLITS}
    options = set(splits["train"][0].question.criteria)
    assert len(options) == 51 and "oos" in options
    for split, rows in splits.items():
        kinds = {row.id.split(":")[0].split("/")[0] for row in rows if row.label == "oos"}
        assert kinds == ({"id-oos"} if split == "train" else {"id-oos", "ood-oos"}), split
        assert all(row.label == "oos" for row in rows if "oos/" in row.id)
    in_scope = {row.label for row in splits["test"] if row.label != "oos"}
    assert len(in_scope) == 50 and in_scope | {"oos"} == options


def test_sampled_options_keep_the_answer_and_are_reproducible() -> None:
    rows = load_task("clinc150", "train", limit=30, seed=1) + load_task("metatool", "train", limit=3)
    sampled = sample_options(rows, 5)
    for row, cut in zip(rows, sampled, strict=True):
        assert cut.id == row.id and cut.label == row.label and cut.state == row.state
        if row.question.type == "noul":
            assert cut.question is row.question
        else:
            assert len(cut.question.criteria) == 5 and cut.label in cut.question.criteria
            assert set(cut.question.criteria) <= set(row.question.criteria)
            assert cut.question.instructions == row.question.instructions
    assert [r.question for r in sample_options(rows, 5)] == [r.question for r in sampled]
    assert [r.question for r in sample_options(rows, 5, seed=1)] != [r.question for r in sampled]
    assert len({tuple(r.question.criteria) for r in sampled[:30]}) > 20  # drawn per example
    with pytest.raises(ClefGuardError, match="at least 2"):
        sample_options(rows, 1)


@pytest.mark.parametrize("task", ["banking77", "metatool", "injecguard", "home-assistant"])
def test_splits_made_here_are_disjoint(task: str) -> None:
    splits = {split: load_task(task, split) for split in SPLITS}
    ids = {split: {example.id for example in examples} for split, examples in splits.items()}
    texts = {split: {json.dumps(example.state) for example in examples} for split, examples in splits.items()}
    for one, other in [("train", "dev"), ("train", "test"), ("dev", "test")]:
        assert not ids[one] & ids[other], (one, other)
        assert not texts[one] & texts[other], (one, other)
    assert all(splits.values())


def test_limit_sampling_is_reproducible_and_keeps_file_order() -> None:
    full = [example.id for example in load_task("clinc150", "dev")]
    first = [example.id for example in load_task("clinc150", "dev", limit=20, seed=3)]
    assert first == [example.id for example in load_task("clinc150", "dev", limit=20, seed=3)]
    assert first != [example.id for example in load_task("clinc150", "dev", limit=20, seed=4)]
    assert first == sorted(first, key=full.index)
    assert len(load_task("rjudge", "test", limit=10_000)) == len(load_task("rjudge", "test"))


@pytest.mark.parametrize(("task", "key"), [("assebench", "assebench_security"), ("rjudge", "rjudge")])
def test_safety_splits_are_the_ids_in_splits_json(task: str, key: str) -> None:
    fixed = json.loads((ROOT / "splits.json").read_text(encoding="utf-8"))[key]
    for split in SPLITS:
        ids = [example.id for example in load_task(task, split)]
        assert sorted(ids) == sorted(str(id_) for id_ in fixed[split])


def test_states_carry_turns_and_tools() -> None:
    trajectory = load_task("rjudge", "test")[0].state
    assert isinstance(trajectory, list)
    assert all(set(turn) == {"role", "content"} for turn in trajectory)
    assert any(turn["role"] == "agent" and "Action: " in turn["content"] for turn in trajectory)
    request = load_task("when2call", "test")[0].state
    assert isinstance(request, dict)
    assert request["messages"][0]["role"] == "user"
    assert all("name" in tool and "description" in tool for tool in request["tools"])


def test_tool_use_rows_follow_when2call_and_split_by_tool() -> None:
    """A generated row lists its request's tool exactly when it should be called or asked about."""
    (reference,) = load_task("when2call", "test", limit=1)
    tools_by_split = {}
    for split in SPLITS:
        rows = load_task("tool-use", split)
        assert {row.label for row in rows} == set(reference.question.criteria)
        assert all(row.question == reference.question for row in rows)
        listed_anywhere = set()
        for row in rows:
            own = row.id.split(":")[1]
            listed = [tool["name"] for tool in row.state["tools"]]
            listed_anywhere.update(listed)
            assert (own in listed) == (row.label != "cannot_answer"), row.id
            assert all(set(tool["parameters"]) == {"type", "required", "properties"} for tool in row.state["tools"])
        tools_by_split[split] = listed_anywhere
    assert not tools_by_split["train"] & tools_by_split["test"]
    assert not tools_by_split["train"] & tools_by_split["dev"]
    assert [row.state for row in load_task("tool-use", "dev")] == [row.state for row in load_task("tool-use", "dev")]


def test_policy_split_keeps_a_states_questions_together_and_ignores_other_rows() -> None:
    """A row's split is a function of its state alone: a state's questions share it, and rows added or
    changed elsewhere in the generators move no other row (heads from different rows stay comparable)."""
    from clef_guard.training.rows.policies import split_of

    split_of_state: dict[str, set[str]] = {}
    for split in SPLITS:
        for row in load_task("policies", split):
            assert split_of(row.state) == split, row.id
            split_of_state.setdefault(to_json(row.state), set()).add(split)
    assert all(len(splits) == 1 for splits in split_of_state.values())
    counts = {split: sum(splits == {split} for splits in split_of_state.values()) for split in SPLITS}
    assert counts["train"] > 3 * counts["dev"] and counts["dev"] > 0 and counts["test"] > 0, counts


def test_held_out_tool_families_are_new_ground_for_every_training_row() -> None:
    """``policies-new-tools`` holds every row of the held-out tools, in their split only, and no
    ``policies`` row holds their tool, its argument names or the targets only they touch."""
    from clef_guard.engine.state import state_segments
    from clef_guard.training.rows.policies import BRANCHES, HELD_OUT_TOOLS, MEETINGS, NAMESPACES

    with pytest.raises(ClefGuardError, match="held out of training"):
        load_task("policies-new-tools", "train")
    rows = {split: load_task("policies-new-tools", split) for split in ("dev", "test")}
    for tool, split in HELD_OUT_TOOLS.items():
        held = [row for row in rows[split] if row.state["tool"]["name"] == tool]
        assert len(held) > 100 and {row.label for row in held if "/requested/" in row.id} == {"yes", "no"}, tool
    assert {row.state["tool"]["name"] for split in rows for row in rows[split]} == set(HELD_OUT_TOOLS)
    assert not {row.state["tool"]["name"] for row in rows["dev"]} & {row.state["tool"]["name"] for row in rows["test"]}
    seen = "\n".join("\n".join(state_segments(row.state)) for split in SPLITS for row in load_task("policies", split))
    words = ["subcommand", "message_body", "to_address", "kubectl", "gmail_send", "outlook_send", *BRANCHES, *NAMESPACES, *MEETINGS]
    assert [word for word in words if word in seen] == []


def test_policy_rows_label_recipients_by_the_organisation_or_the_users_words() -> None:
    """"External" follows the system turn's domain, or, with no organisation named, how the user names the recipient
    (with its address, or alone: then the agent found the address)."""
    from clef_guard.training.rows.policies import ORGANISATIONS, PRIVATE, RELATIONS, ROUTINE, SECRETS

    rows = [row for split in SPLITS for row in load_task("policies", split)
            if row.id.startswith("outbound-communication/external/")]
    unnamed = 0
    for row in rows:
        to, turns = next(iter(row.state["tool"]["args"].values())), row.state["messages"]  # the recipient comes first
        system = [turn.content for turn in turns if turn.type == "system"]
        (user,) = [turn.content for turn in turns if turn.type == "human"]
        assert turns[-1].tool_calls[0]["args"] == row.state["tool"]["args"], "the AI turn that proposes the call comes last"
        if system:
            (domain,) = [domain for _, domain in ORGANISATIONS if domain in system[0]]
            assert (row.label == "yes") == (not to.startswith("#") and not to.endswith("@" + domain)), row.id
        else:
            unnamed += 1
            who = functools.reduce(lambda text, body: text.replace(body, ""), [*PRIVATE, *ROUTINE, *SECRETS], user)  # "the customer's card"
            named = {external for external, relations in RELATIONS.items() for relation in relations if relation in who}
            assert named == {row.label == "yes"}, row.id  # "our supplier (jo@...)", or the relation alone
    assert 0 < unnamed < len(rows) / 2


def test_scope_rows_reach_every_level_with_earlier_changes_in_history() -> None:
    """The scope rubric is taught every level, and on histories that hold changes broader than the call."""
    from clef_guard.training.rows.policies import CHANGES

    rows = [row for row in load_task("policies", "train") if row.id.startswith("destructive-actions/scope/")]
    assert {row.label for row in rows} == {"0", "1", "2", "3"}
    changes = {to_json(args) for _, args, _ in CHANGES}
    after_changes = [
        row for row in rows
        if any(to_json(call["args"]) in changes for turn in row.state["messages"][:-1] for call in getattr(turn, "tool_calls", []))
    ]
    assert {row.label for row in after_changes} >= {"0", "1"}


def test_destructive_rows_do_not_tell_the_answer_by_the_tool_or_the_request() -> None:
    """SQL and shell calls are destructive in some rows and not in others, and every kind of request
    (asked, unrelated, only to look, another target) meets calls that destroy: the head must read the arguments."""
    from clef_guard.training.rows.policies import DESTROYS, KEEPS, LOOKS

    rows = [row for row in load_task("policies", "train") if row.id.startswith("destructive-actions/destructive/")]
    for tool in ("run_sql", "shell"):
        assert {row.label for row in rows if row.state["tool"]["name"] == tool} == {"yes", "no"}, tool
    only_looks = [re.compile(("(?<![a-z] )" if look.endswith("?") else "") + re.sub(r"\\\{\w+\\\}", r"\\S+", re.escape(look)), re.IGNORECASE)
                  for looks in LOOKS.values() for look in looks if all(look not in asks for _, _, asks, _ in DESTROYS + KEEPS)]
    looks = [row for row in rows if any(
        look.search(turn.content) for look in only_looks for turn in row.state["messages"] if turn.type == "human"
    )]
    assert looks and {row.label for row in looks} == {"yes"}, "a request only to look meets changes alone"


def test_when2call_is_test_only() -> None:
    with pytest.raises(ClefGuardError, match="test-only"):
        load_task("when2call", "train")


def test_unknown_task_or_split_names_the_valid_ones() -> None:
    with pytest.raises(ClefGuardError) as error:
        load_task("imdb", "test")
    assert all(task in str(error.value) for task in TASKS)
    with pytest.raises(ClefGuardError, match="train, dev, test"):
        load_task("banking77", "valid")


def test_datasets_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(DATASETS_ENV, str(tmp_path))
    assert datasets_dir() == tmp_path
    monkeypatch.setenv(DATASETS_ENV, str(tmp_path / "missing"))
    with pytest.raises(ClefGuardError, match=DATASETS_ENV):
        datasets_dir()


def test_tool_output_rows_hold_out_result_kinds_and_attack_styles() -> None:
    from clef_guard.training.rows.tool_outputs import tool_outputs

    rows = tool_outputs()
    benign = [row for row in rows if row.style is None]
    assert len(benign) >= 1000 and len({row.kind for row in benign}) >= 12
    kinds = {split: {row.kind for row in benign if row.split == split} for split in SPLITS}
    styles = {split: {row.style for row in rows if row.split == split and row.style} for split in SPLITS}
    for one, other in [("train", "dev"), ("train", "test"), ("dev", "test")]:
        assert not styles[one] & styles[other] and not kinds[one] & kinds[other], (one, other)
    assert {row.kind for row in rows if row.split == "train"} == kinds["train"]  # a held-out kind's results never train
    texts = {row.text for row in benign}
    for row in rows:
        if row.style is not None:  # an injected twin keeps every line of a benign result and adds one attack
            assert row.text not in texts
            assert any(all(line in row.text for line in twin.text.split("\n")) for twin in benign if twin.args == row.args)
    test = load_task("tool-output", "test")
    assert {example.label for example in test} == {"yes", "no"}
    assert all(example.state["tool_result"] for example in test)  # the result, as the shipped policy shows it


def test_attacked_twins_keep_their_answer_and_change_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each twin is its policies row with one attack added where an attacker writes; only the checked result's answer moves."""
    from pathlib import Path

    from clef_guard.engine.state import state_segments
    from clef_guard.training.rows.policies import policy_examples

    for split in SPLITS:
        source = {example.id: example for example in policy_examples(split)}
        twins = load_task("policies-attacked", split)
        assert len(twins) == sum(not key.startswith("support-routing/") for key in source)
        for twin in twins:
            _, place, key = twin.id.split("/", 2)
            row = source[key]  # a twin keeps its row's split
            assert twin.question == row.question
            assert twin.label == ("yes" if place == "checked-result" else row.label)
            assert state_segments(twin.state) != state_segments(row.state)
            assert twin.state["tool"]["name"] == row.state["tool"]["name"]
            proposing = twin.state["messages"][-1].tool_calls
            assert [c["args"] for c in proposing if c["name"] == twin.state["tool"]["name"]] == [twin.state["tool"]["args"]]
            if place != "argument":
                assert twin.state["tool"] == row.state["tool"]
    # the red team's own attacks stay out of training, so it measures attacks the head never saw
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import redteam
    text = "\n".join("\n".join(state_segments(t.state)) for t in load_task("policies-attacked", "train"))
    for attack in redteam.ATTACKS.values():
        marker = attack(0).strip().splitlines()[0][:24]
        assert marker not in text, marker
    assert "<|im_start|>" not in text and "SYSTEM:" not in text


def test_asked_bench_uses_tools_and_requests_no_policy_row_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/asked.py measures held-out tools: none of its tools or requests is in the policy rows, and its
    two sets share no tool."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import asked

    rows = [row for split in ("train", "dev", "test") for row in load_task("policies", split)]
    tools = {row.state["tool"]["name"] for row in rows if isinstance(row.state, dict) and "tool" in row.state}
    text = "\n".join(to_json(row.state) for row in rows)
    pairs = [*asked.PAIRS, *asked.DEV_PAIRS]
    for pair in pairs:
        assert pair.call["name"] not in tools, pair.call["name"]
        assert pair.asked not in text and pair.other not in text
    assert len({pair.call["name"] for pair in pairs}) == len(pairs)  # every pair a tool of its own, none in both sets
