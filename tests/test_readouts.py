"""Readouts: a question people answered often enough gets a scorer of its own, and nothing else moves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_training import ANIMALS, OBJECTS, QUESTION, _toy

from clef_guard import DecisionHead, LocalDecisionModel
from clef_guard.cli import main
from clef_guard.engine.head import HEAD_FILE
from clef_guard.engine.local import DEFAULT_HEAD
from clef_guard.engine.requests import parse_questions
from clef_guard.engine.tree import OptionFeatures
from clef_guard.policy.load import load_policies
from clef_guard.training.examples import Example
from clef_guard.training.features import Features, extract_features
from clef_guard.training.fit import predict
from clef_guard.training.readout import MIN_READOUT_ROWS, fit_readouts, held_out

WIDTH = 16


def _rows(n: int, question: str, *, seed: int, head_right: bool) -> list[Features]:
    """Yes when the 'yes' option's first feature is positive; the backbone's log-probabilities say the
    opposite (a head that reads them is wrong), or say it sharply (``head_right``: nothing left to learn)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        hidden = torch.randn(2, WIDTH, generator=generator)
        label = int(hidden[1, 0] > 0)  # options are ["no", "yes"]
        said = label if head_right else 1 - label
        rows.append(Features("noul", hidden, torch.tensor([0.0, 6.0]) if said else torch.tensor([6.0, 0.0]), label, question=question))
    return rows


def _kept_apart(rows: list[Features], deciding: int) -> list[Features]:
    """``rows`` decided by feature ``deciding`` of the 'yes' option, the other deciding feature (0 or 2) zeroed."""
    out = []
    for row in rows:
        hidden = row.hidden.clone()
        hidden[1, deciding] = row.hidden[1, 0]
        hidden[:, 2 - deciding] = 0.0
        out.append(Features("noul", hidden, row.lm_logprob, row.label, question=row.question))
    return out


def _accuracy(probabilities: list[torch.Tensor], rows: list[Features]) -> float:
    return sum(int(p.argmax()) == f.label for p, f in zip(probabilities, rows, strict=True)) / len(rows)


def test_a_question_the_head_reads_wrong_gets_a_readout_and_the_others_read_the_head_as_before(tmp_path: Path) -> None:
    head = DecisionHead(WIDTH)
    learned, fresh = _rows(80, "new", seed=0, head_right=False), _rows(200, "new", seed=1, head_right=False)
    few = _rows(MIN_READOUT_ROWS - 1, "other", seed=2, head_right=False)  # too few answers: no readout
    other = _rows(50, "other", seed=3, head_right=False)
    before = predict(head, other)
    (fit,) = fit_readouts(head, learned + few)
    assert (fit.question, fit.rows, fit.adopted) == ("new", 80, True) and fit.log_loss < fit.head_log_loss
    assert head.readout("new") is not None and head.readout("other") is None
    assert _accuracy(predict(head, fresh), fresh) >= 0.9
    assert _accuracy(predict(head, fresh, readouts=False), fresh) <= 0.1  # the head alone is still wrong
    assert all(torch.equal(a, b) for a, b in zip(predict(head, other), before, strict=True))

    head.save(tmp_path / HEAD_FILE)
    loaded = DecisionHead.load(tmp_path / HEAD_FILE, WIDTH)
    assert all(torch.equal(a, b) for a, b in zip(predict(loaded, fresh), predict(head, fresh), strict=True))
    assert torch.equal(loaded.readout("new").held_out, head.readout("new").held_out)  # type: ignore[union-attr]


def test_a_readout_learns_the_old_rows_of_its_question_beside_the_new_ones() -> None:
    """The new answers are decided by one feature, the head's old rows of the same question by another: with
    them replayed, the readout reads both; fitted on the new answers alone, it forgets what the old rows asked."""
    new, old = _kept_apart(_rows(60, "q", seed=0, head_right=False), 0), _kept_apart(_rows(60, "q", seed=1, head_right=True), 2)
    fresh_old = _kept_apart(_rows(100, "q", seed=2, head_right=True), 2)
    unrelated = _rows(30, "another", seed=3, head_right=False)  # replayed rows of a question no answer asks
    with_old, alone = DecisionHead(WIDTH), DecisionHead(WIDTH)
    (fit,) = fit_readouts(with_old, new, replayed=old + unrelated)
    assert (fit.rows, fit.replayed, fit.adopted) == (60, 60, True) and with_old.readout("another") is None
    fit_readouts(alone, new)
    assert _accuracy(predict(with_old, fresh_old), fresh_old) >= 0.8  # 0.88 here
    assert _accuracy(predict(alone, fresh_old), fresh_old) <= 0.6  # 0.42


def test_a_fit_reports_how_its_readout_reads_tools_it_was_not_fitted_on() -> None:
    """Each of four tools' rows is decided by a feature of its own (a template the readout can fit but that
    says nothing about another tool); the head is mildly right everywhere. Out of fold by row the readout
    beats the head and is adopted; with each tool held out it reads worse than even odds, and the fit says so."""
    generator = torch.Generator().manual_seed(0)
    rows, tools = [], []
    for n in range(160):
        tool = n % 4
        hidden = torch.randn(2, WIDTH, generator=generator)
        hidden[:, 3:7] = 0.0  # a tool's own feature is set on its rows only
        hidden[1, 3 + tool] = value = torch.randn(1, generator=generator).item()
        label = int(value > 0)
        said = torch.tensor([0.0, 0.8]) if label else torch.tensor([0.8, 0.0])
        rows.append(Features("noul", hidden, said, label, question="q"))
        tools.append(f"tool_{tool}")
    (plain,) = fit_readouts(DecisionHead(WIDTH), rows)
    head = DecisionHead(WIDTH)
    (fit,) = fit_readouts(head, rows, tools=tools)
    assert fit.adopted and fit.log_loss < fit.head_log_loss - 0.1 and head.readout("q") is not None
    assert fit.tools == 4 and fit.unseen_log_loss is not None and fit.unseen_log_loss > fit.head_log_loss + 0.2
    assert fit.worse_than_even_odds_on_new_tools  # worse than answering 50/50
    assert (plain.tools, plain.unseen_log_loss, plain.worse_than_even_odds_on_new_tools) == (0, None, False)
    assert (plain.strength, plain.temperature, plain.log_loss) == (fit.strength, fit.temperature, fit.log_loss)  # nothing else moves
    (one,) = fit_readouts(DecisionHead(WIDTH), rows, tools=["tool_0"] * len(rows))
    assert (one.tools, one.unseen_log_loss) == (1, None)


def _noisy(n: int, *, seed: int) -> list[Features]:
    """Yes mostly where the 'yes' option's first feature is positive: a quarter of the rows' answers say otherwise."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        hidden = torch.randn(2, WIDTH, generator=generator)
        label = int(hidden[1, 0] + torch.randn(1, generator=generator).item() > 0)
        rows.append(Features("noul", hidden, torch.zeros(2), label, question="q"))
    return rows


def test_a_readout_whose_yes_rows_count_three_times_misses_fewer_yes_answers_on_new_rows() -> None:
    """Where reading a "yes" as "no" costs more (a destroying call let run), its rows count more: on fresh
    rows the weighted readout reads fewer "yes" rows as "no" than the plain one, at the cost of more "no"
    rows read as "yes"; and the weights are checked and reported."""
    rows, fresh = _noisy(300, seed=0), _noisy(2000, seed=1)
    plain, weighed = DecisionHead(WIDTH), DecisionHead(WIDTH)
    (as_is,) = fit_readouts(plain, rows)
    as_read = plain.readout("q")
    assert as_read is not None
    (fit,) = fit_readouts(weighed, rows, option_weights={"q": [1.0, 3.0]})
    assert as_is.adopted and fit.adopted and (as_is.option_weights, fit.option_weights) == (None, (1.0, 3.0))

    def misses(head: DecisionHead, label: int) -> int:
        return sum(int(p.argmax()) != label for p, f in zip(predict(head, fresh), fresh, strict=True) if f.label == label)

    assert misses(weighed, 1) < 0.6 * misses(plain, 1) and misses(weighed, 0) > misses(plain, 0)
    with pytest.raises(ValueError, match="'q' has 2 options, 3 option weights"):
        fit_readouts(plain, rows, option_weights={"q": [1.0, 1.0, 2.0]})
    with pytest.raises(ValueError, match="must be positive and finite"):
        fit_readouts(plain, rows, option_weights={"q": [1.0, 0.0]})
    with pytest.raises(ValueError, match="must be positive and finite"):
        fit_readouts(plain, rows, option_weights={"q": [1.0, math.inf]})
    assert plain.readout("q") is as_read  # refused before any readout was set: the head is as it was


def test_thresholds_read_the_rows_a_readout_learned_from_as_it_read_them_out_of_fold() -> None:
    head = DecisionHead(WIDTH)
    learned, fresh = _rows(60, "new", seed=0, head_right=False), _rows(40, "new", seed=1, head_right=False)
    fit_readouts(head, learned)
    readout = head.readout("new")
    assert readout is not None
    in_sample = predict(head, learned)
    read = held_out(head, learned, in_sample)
    assert torch.allclose(torch.stack(read), readout.held_out)  # in the order they were learned
    assert not torch.allclose(torch.stack(read), torch.stack(in_sample), atol=1e-3)  # in sample reads them far surer
    assert torch.equal(torch.stack(held_out(head, fresh, predict(head, fresh))), torch.stack(predict(head, fresh)))  # new rows: the readout


def test_a_readout_that_no_longer_beats_the_head_gives_the_question_back() -> None:
    head = DecisionHead(WIDTH)
    fit_readouts(head, _rows(60, "new", seed=0, head_right=False))
    assert head.readout("new") is not None
    (fit,) = fit_readouts(head, _rows(60, "new", seed=4, head_right=True))  # the head is sure and right: nothing to add
    assert not fit.adopted and fit.head_log_loss <= fit.log_loss
    assert head.readout("new") is None


def test_the_engine_serves_a_readout_from_the_head_file_and_calls_its_question_familiar(
    engine: LocalDecisionModel, tmp_path: Path
) -> None:
    """Real backbone features of 24 messages (animal or not): the readout fitted on them answers through the engine."""
    rows = _toy(ANIMALS, "yes", 0) + _toy(OBJECTS, "no", 0)
    features = extract_features(engine, rows, cache=tmp_path / "cache")
    head = DecisionHead.load(DEFAULT_HEAD, engine.backbone.hidden_size)
    (fit,) = fit_readouts(head, features)
    if not fit.adopted:
        pytest.fail(f"the shipped head read these rows better than a readout out of fold: {fit}")
    head.save(tmp_path / HEAD_FILE)
    served = LocalDecisionModel(head=str(tmp_path / HEAD_FILE))
    response = served.invoke({"state": rows[3].state, "questions": {"animal": QUESTION}})
    expected = predict(head, [features[3]])[0]
    assert response.nouls["animal"].noul == pytest.approx(float(expected[1]), abs=0.02)  # features cached in float16
    assert response.familiarity == {"animal": 1.0}


def _review_log(engine: LocalDecisionModel, tmp_path: Path) -> tuple[list[Example], list[Features], Path]:
    """A review log of the animal question's toy rows (24 answers, with the features the engine read), its rows and features."""
    rows = _toy(ANIMALS, "yes", 0) + _toy(OBJECTS, "no", 0)
    features = extract_features(engine, rows, cache=tmp_path / "cache")
    (question,) = parse_questions({"animal": QUESTION})
    log = tmp_path / "reviews.jsonl"
    with log.open("w") as handle:
        for n, (row, read) in enumerate(zip(rows, features, strict=True)):
            record = OptionFeatures(question, read.reading, read.hidden, read.lm_logprob, torch.zeros(read.hidden.shape[1])).to_record()
            handle.write(json.dumps({
                "id": f"r{n}", "questions": {"animal": QUESTION.model_dump(mode="json")}, "labels": {"animal": row.label},
                "features": {"backbone": engine.feature_key, "questions": {"animal": record}},
            }) + "\n")
    return rows, features, log


def test_a_warm_start_from_a_review_log_fits_readouts_and_calibrate_reads_their_rows_out_of_fold(
    engine: LocalDecisionModel, tmp_path: Path
) -> None:
    rows, features, log = _review_log(engine, tmp_path)
    (question,) = parse_questions({"animal": QUESTION})
    out = tmp_path / "head"
    assert main(["train", "--data", str(log), "--init-head", "default", "--out", str(out), "--epochs", "2", "--json",
                 "--features", str(tmp_path / "cache")]) == 0
    (fit,) = json.loads((out / "train_report.json").read_text())["readouts"]
    assert fit["question"] == question.key and fit["rows"] == len(rows)
    trained = DecisionHead.load(out / HEAD_FILE, engine.backbone.hidden_size)
    assert (trained.readout(question.key) is not None) == fit["adopted"]
    assert main(["train", "--data", str(log), "--init-head", "default", "--out", str(tmp_path / "plain"), "--epochs", "2",
                 "--json", "--no-readouts", "--features", str(tmp_path / "cache")]) == 0
    assert json.loads((tmp_path / "plain" / "train_report.json").read_text())["readouts"] == []

    calibration = tmp_path / "calibration.yaml"
    assert main(["calibrate", "--head", str(out / HEAD_FILE), "--data", str(log), "--keep-temperatures", "--out", str(calibration),
                 "--plot", str(tmp_path / "r.png"), "--json", "--features", str(tmp_path / "cache")]) == 0
    reported = yaml.safe_load(calibration.read_text())["report"]["after"]["accuracy"]
    assert reported == pytest.approx(_accuracy(held_out(trained, features, predict(trained, features)), features))


def test_fit_readouts_adds_readouts_to_a_head_and_changes_nothing_else(
    engine: LocalDecisionModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows, _, log = _review_log(engine, tmp_path)
    (question,) = parse_questions({"animal": QUESTION})
    out = tmp_path / "head"
    common = ["--data", str(log), "--json", "--features", str(tmp_path / "cache")]
    assert main(["fit-readouts", *common, "--out", str(out)]) == 0
    (fit,) = json.loads((out / "readouts_report.json").read_text())["readouts"]
    assert fit["key"] == question.key and fit["rows"] == len(rows) and fit["replayed"] == 0
    fitted = DecisionHead.load(out / HEAD_FILE, engine.backbone.hidden_size)
    assert (fitted.readout(question.key) is not None) == fit["adopted"]
    written = load_file(out / HEAD_FILE)
    assert all(torch.equal(written[name], value) for name, value in load_file(DEFAULT_HEAD).items())  # its readouts too
    capsys.readouterr()
    assert main(["fit-readouts", "--data", str(log), "--features", str(tmp_path / "cache"), "--out", str(tmp_path / "again")]) == 0
    printed = capsys.readouterr().out  # the table fits an 80-column log: every column is there, the row's figures whole
    assert all(column in printed for column in ("by row", "by tool", "head", "kept"))
    row = next(line for line in printed.splitlines() if f"{fit['log_loss']:.3f}" in line)
    assert f"{fit['head_log_loss']:.3f}" in row and row.rstrip(" │").endswith("yes" if fit["adopted"] else "no")

    assert main(["fit-readouts", *common, "--out", str(out), "--question", "destructive-actions:nope"]) == 2
    assert "write POLICY:QUESTION naming a question of the policy" in " ".join(capsys.readouterr().err.split())
    assert main(["fit-readouts", *common, "--out", str(out), "--question", "destructive-actions:requested"]) == 2
    assert "destructive-actions:requested: no row asks it" in " ".join(capsys.readouterr().err.split())
    for spec, said in (("destructive-actions:destructive:maybe=2", "'destructive' has no option 'maybe' (its options: no, yes)"),
                       ("destructive-actions:destructive:yes=0", "the weight after '=' must be a positive number"),
                       ("destructive-actions:destructive:yes=many", "the weight after '=' must be a positive number"),
                       ("destructive-actions:nope:yes=2", "write POLICY:QUESTION:OPTION=W naming a question")):
        assert main(["fit-readouts", *common, "--out", str(out), "--weigh", spec]) == 2
        assert said in " ".join(capsys.readouterr().err.split())


def test_the_shipped_head_reads_its_readouts_questions_keyed_as_the_policies_ask_them() -> None:
    head = DecisionHead.load(DEFAULT_HEAD, 576)
    asked = {
        parse_questions({"q": policy.questions[qid]})[0].key
        for name, qids in (("destructive-actions", ("requested", "scope")), ("outbound-communication", ("sensitive",)))
        for policy in load_policies(name)
        for qid in qids
    }
    assert {name.removeprefix("q") for name in head.readouts} == asked  # a reworded question would lose its readout
