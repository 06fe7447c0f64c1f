"""``clef-guard train`` (head, then LoRA), ``calibrate`` and their reports, on a JSONL data file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from clef_guard import LocalDecisionModel
from clef_guard.cli import main
from clef_guard.errors import ModelLoadError

COLOURS = {"red": None, "green": None, "blue": None, "yellow": None}
ROWS = [
    ("The fire engine is parked outside.", "red"),
    ("Fresh grass covers the hill.", "green"),
    ("The clear sky at noon.", "blue"),
    ("A ripe banana on the table.", "yellow"),
    ("Strawberries and tomatoes in a bowl.", "red"),
    ("A frog sat on a lily pad.", "green"),
]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    lines = []
    for text, colour in ROWS:
        questions = {
            "colour": {"type": "choice", "instructions": "Which colour is the thing described?", "criteria": COLOURS},
            "food": {"type": "noul", "instructions": "Is something edible mentioned?"},
        }
        labels = {"colour": colour, "food": text.startswith(("A ripe", "Strawberries"))}
        lines.append(json.dumps({"state": text, "questions": questions, "labels": labels}))
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines))
    return path


def test_train_then_lora_writes_an_adapter_folder_that_loads(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, features = tmp_path / "adapter", tmp_path / "features"
    argv = ["train", "--data", str(data), "--options", "2", "--epochs", "3", "--lora-layers", "1", "--lora-epochs", "1",
            "--features", str(features), "--out", str(out), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 12 and report["options"] == 2
    assert report["lora"]["config"]["layers"] == 1 and len(report["lora"]["epoch_losses"]) == 1
    assert len(report["lora"]["epoch_seconds"]) == 1 and report["lora"]["seconds"] > 0
    assert {"adapter_config.json", "adapter_model.safetensors", "decision_head.safetensors"} <= {p.name for p in out.iterdir()}
    assert list(features.glob("*.pt"))  # the feature cache went where it was told
    head = LocalDecisionModel(adapter=str(out)).decision_head
    assert head is not None and ("noul", "Is something edible mentioned?") in head.questions  # what it learned, remembered, with its kind
    assert {(q.kind, q.text.split("?")[0]) for q in head.questions} == {("noul", "Is something edible mentioned"), ("choice", "Which colour is the thing described")}

    calibration = tmp_path / "calibration.yaml"
    argv = ["calibrate", "--adapter", str(out), "--head", str(out / "decision_head.safetensors"), "--data", str(data),
            "--features", str(features), "--target-error", "0.5", "--out", str(calibration), "--plot", str(tmp_path / "reliability.png"), "--json"]
    assert main([*argv, "--stop-threshold", "prompt-injection:nope"]) == 2
    assert "naming a yes/no question of the policy" in capsys.readouterr().err.replace("\n", " ")
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 12 and set(report["before"]) == {"accuracy", "ece", "ece_noise", "brier"}
    assert report["question_temperatures"] == []  # 12 rows: too few for a question's own temperature
    written = yaml.safe_load(calibration.read_text())
    assert written["version"] == 1 and written["report"]["n"] == 12
    assert (tmp_path / "reliability.png").stat().st_size > 0

    argv = ["eval", "--adapter", str(out), "--head", str(out / "decision_head.safetensors"), "--data", str(data), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["task"] == "rows.jsonl" and report["n"] == 12 and report["split"] is None
    by_question = {q["question"]: q for q in report["questions"]}
    assert set(by_question) == {"Which colour is the thing described?", "Is something edible mentioned?"}
    assert [q["n"] for q in by_question.values()] == [6, 6]
    assert report["accuracy"] == pytest.approx(sum(q["accuracy"] for q in by_question.values()) / 2)


def test_eval_reads_one_source_and_samples_labeled_rows(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--task", "metatool", "--data", str(data)]) == 2
    assert "not both" in " ".join(capsys.readouterr().err.split())
    assert main(["eval"]) == 2
    assert main(["eval", "--task", "metatool", "--task", "rjudge"]) == 2  # not a silent "rjudge only"
    assert "one task at a time" in " ".join(capsys.readouterr().err.split())
    assert main(["eval", "--data", str(data), "--limit", "5", "--engine", "zeroshot", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 5 and sum(q["n"] for q in report.get("questions", [report])) == 5
    assert main(["eval", "--data", str(data), "--engine", "zeroshot"]) == 0
    printed = capsys.readouterr().out
    assert "rows.jsonl (labeled rows, n=12)" in printed and "per question" in printed and "Is something edible" in printed


def test_lora_on_top_of_an_adapter_is_refused(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--data", str(data), "--adapter", str(tmp_path), "--lora-layers", "1", "--out", str(tmp_path / "b")]
    assert main(argv) == 2
    assert "leave out --adapter" in " ".join(capsys.readouterr().err.split())  # rich wraps lines


def test_a_task_can_name_its_own_option_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--task", "clinc150:8", "--task", "clinc150", "--limit", "2", "--epochs", "2",
            "--features", str(tmp_path / "features"), "--out", str(tmp_path / "head"), "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 4  # the same two rows, listed with 8 options and read wide
    reseeded = [*argv[:-2], str(tmp_path / "reseeded"), "--json", "--train-seed", "1"]
    assert main(reseeded) == 0
    assert json.loads(capsys.readouterr().out)["config"]["seed"] == 1
    head = "decision_head.safetensors"
    assert (tmp_path / "head" / head).read_bytes() != (tmp_path / "reseeded" / head).read_bytes()
    assert main(["train", "--task", "clinc150:many", "--out", str(tmp_path / "bad")]) != 0
    assert "NAME[:K][@N]" in capsys.readouterr().err


def test_an_allow_threshold_bounds_the_unrequested_calls_it_lets_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``requested >= threshold`` lets a call run: the fit bounds the 'no' rows at or above it, as a stop bounds false alarms."""
    from clef_guard import load_policies
    from clef_guard.engine.local import DEFAULT_HEAD

    (policy,) = load_policies("destructive-actions")
    question = policy.questions["requested"].model_dump(mode="json")
    asks = {"delete notes/a.txt": "yes", "summarise the week": "no", "rm notes/a.txt please": "yes", "list the notes": "no"}
    rows = [
        {"state": {"messages": [{"role": "user", "content": f"{ask} ({n})"}], "tool": {"name": "delete_file", "args": {"path": "notes/a.txt"}}},
         "questions": {"requested": question}, "labels": {"requested": label}}
        for n in range(5) for ask, label in asks.items()
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    calibration = tmp_path / "calibration.yaml"
    argv = ["calibrate", "--head", str(tmp_path / "head.safetensors"), "--data", str(data), "--keep-temperatures",
            "--features", str(tmp_path / "features"), "--out", str(calibration), "--plot", str(tmp_path / "r.png"), "--json"]
    (tmp_path / "head.safetensors").write_bytes(DEFAULT_HEAD.read_bytes())  # --keep-temperatures: only thresholds are fitted
    assert main([*argv, "--allow-threshold", "destructive-actions:requested@0.4"]) == 0
    report = json.loads(capsys.readouterr().out)
    fitted = report["allow_thresholds"]["destructive-actions:requested@0.4"]
    assert fitted["negatives"] == 10 and fitted["false_alarm_bound"] <= 0.4
    written = yaml.safe_load(calibration.read_text())
    assert written["policies"]["destructive-actions"]["thresholds"]["requested"] == pytest.approx(fitted["threshold"], abs=1e-6)


@pytest.mark.parametrize(
    ("line", "says"),
    [("{not json", "rows.jsonl:2: not JSON"), ('["a", "list"]', "rows.jsonl:2:"), ('{"state": "x", "questions": {}}', "rows.jsonl:2:")],
    ids=["not JSON", "not an object", "no labels"],
)
def test_a_bad_row_of_labeled_data_is_named_by_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, says: str) -> None:
    good = {"state": "a ripe banana", "questions": {"q": {"type": "noul", "instructions": "Is something edible mentioned?"}}, "labels": {"q": "yes"}}
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(good) + "\n" + line + "\n")
    assert main(["eval", "--data", str(data), "--engine", "zeroshot"]) == 2
    assert says in " ".join(capsys.readouterr().err.split())


def test_a_head_trained_on_the_first_layers_is_served_at_that_depth(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--layers`` reads features from the first layers only; the head records its depth, so the engine that
    loads it and a warm start from it run those layers without being told, and another depth is refused."""
    shallow, warm, features = tmp_path / "shallow", tmp_path / "warm", tmp_path / "features"
    common = ["--data", str(data), "--options", "2", "--epochs", "3", "--features", str(features), "--json"]
    assert main(["train", *common, "--layers", "6", "--out", str(shallow)]) == 0
    capsys.readouterr()
    engine = LocalDecisionModel(head=str(shallow / "decision_head.safetensors"), encoder=None)
    assert (engine.backbone.layers, engine.decision_head.layers) == (6, 6)
    assert len({path.name for path in features.iterdir() if path.suffix == ".pt"}) == 1
    assert main(["train", *common, "--init-head", str(shallow / "decision_head.safetensors"), "--out", str(warm)]) == 0
    assert LocalDecisionModel(head=str(warm / "decision_head.safetensors"), encoder=None).backbone.layers == 6
    assert len({path.name for path in features.iterdir() if path.suffix == ".pt"}) == 1  # the warm start read at depth 6
    with pytest.raises(ModelLoadError, match=r"reads the first 6 of the backbone's 30 decoder layers, not 30"):
        LocalDecisionModel(head=str(shallow / "decision_head.safetensors"), layers=30, encoder=None)
    with pytest.raises(ModelLoadError, match=r"reads the first 30 of the backbone's 30 decoder layers, not 6"):
        LocalDecisionModel(layers=6, encoder=None)  # the shipped head reads all 30
