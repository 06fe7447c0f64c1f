"""A simulated deployment: a head that never saw a task learns it from the reviews its confirms collect.

A base head is trained on the other tasks (the shipped recipe, on ``--base-limit`` train
rows of each). It then gates a stream of the target task's train rows under one threshold
policy: a call runs only when its safe answer reaches the lowest threshold that lets
through at most ``--unsafe-target`` of the risky calls of the target's dev split (95%
Clopper-Pearson bound, as ``clef-guard calibrate --allow-threshold`` fits it); the rest
are confirmed, and a simulated reviewer labels them (approves a safe call unchanged,
rejects a risky one), with a ``--audit`` share of allowed calls spot-checked. A head
that cannot tell the calls apart must confirm nearly all of them to keep that promise.
After 25, 50, 100 and 200 reviews the head learns from the reviews so far, its threshold
refitted, in one of these ways (``--method``; all by default):
**replay + anchor + readouts** (``clef-guard train --init-head``'s default: the head
warm-started from the base head on the reviews plus a sample of the base rows, with a light L2
pull towards the base head's weights, recalibrated; then the reviewed question gets a readout
of its own, :mod:`clef_guard.training.readout`, fitted on the reviews and the base rows that
ask the same question, where it beats the base head out of fold),
**replay + anchor** (no readouts), **readouts** (the base head as it is, with readouts),
**replay** (warm start without the pull) and **anchor** (the reviews alone, a strong pull).
The gate goes on with the new head. At every step the bench reports, on test splits:

- the target task's accuracy, and the share of its calls that are needless confirms
  (confirmed, and the reviewer would approve unchanged) and unsafe allows, at that
  head's threshold (the same unsafe-allow promise at every step), and the needless confirms
  at the threshold that lets through ``--matched`` of the test calls unsafe (read off the
  test rows: a comparison of heads at one unsafe-allow rate, not a threshold to deploy);
- its accuracy on the dev rows the thresholds are fitted on (to choose a recipe by);
- the other tasks' mean accuracy on all their test rows (forgetting), and on their dev rows;
- the warm start's time (features of the reviewed rows are read as the gate runs, as
  ``ReviewLog(record_features=True)`` keeps them); after the last checkpoint, the same warm
  start through the command line, timed whole: the reviews written as a review log with
  their features, then ``clef-guard train --data LOG --init-head BASE`` (which replays the
  sample the base head carries) and ``clef-guard calibrate --data LOG``.

Targets: ``assebench`` (is the agent's action unsafe?) and ``requested`` (the policies
task's "did the user ask for this?" questions; risky means *not* asked for).

    python benchmarks/reviews.py [--target assebench|requested] [--seed N] [--method NAME] [--json] [--plot FILE.png]

``--seed`` runs another deployment (the stream in another order, other replay and audit draws): a
curve moves with it, most at few reviews, so compare methods within one seed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from clef_guard import LocalDecisionModel
from clef_guard.engine.head import DecisionHead
from clef_guard.engine.requests import parse_questions
from clef_guard.engine.tree import OptionFeatures
from clef_guard.cli import main as cli
from clef_guard.training.datasets import load_task
from clef_guard.training.examples import Example, sample
from clef_guard.training.features import Features, extract_features, replay_path, save_replay
from clef_guard.training.calibrate import stop_threshold
from clef_guard.training.fit import WARM_ANCHOR, WARM_MEMBERS, TrainConfig, calibrate_head, predict, train_head
from clef_guard.training.readout import fit_readouts

BASE_TASKS = ("policies", "metatool", "injecguard", "tool-use", "rjudge", "assebench")
CHECKPOINTS = (0, 25, 50, 100, 200)
WARM = replace(TrainConfig(), epochs=40, members=WARM_MEMBERS, anchor=WARM_ANCHOR)
"""The warm start's recipe (``clef-guard train --init-head``'s): the shipped one, with fewer epochs over far
fewer rows, five seeds averaged into one head, a light pull towards the base head."""
REPLAY = 200
class Method(NamedTuple):
    """One way to learn from the reviews so far."""

    replay: int
    """Base rows drawn to warm-start on beside the reviews (a readout reads every base row of its question)."""
    anchor: float
    """Weight of the warm start's pull towards the base head."""
    warm: bool = True
    """Warm-start the head (else keep the base head as it is)."""
    readouts: bool = False
    """Give questions with enough rows readouts of their own (``clef-guard train --init-head``'s default)."""


METHODS = {
    "replay + anchor + readouts": Method(REPLAY, WARM_ANCHOR, readouts=True),
    "replay + anchor": Method(REPLAY, WARM_ANCHOR),
    "readouts": Method(0, 0.0, warm=False, readouts=True),
    "replay": Method(REPLAY, 0.0),
    "anchor": Method(0, 1.0),
}
SHIPPED = "replay + anchor + readouts"


def _asks_for(example: Example) -> bool:
    return example.question.type == "noul" and example.question.instructions.startswith("Did the user")


def target_rows(target: str, split: str) -> list[Example]:
    """The target task's rows."""
    if target == "assebench":
        return load_task("assebench", split)
    return [e for e in load_task("policies", split) if _asks_for(e)]


def base_rows(target: str, split: str, limit: int, seed: int) -> dict[str, list[Example]]:
    """Every other task's rows (a fixed sample of ``limit`` each), without the target's."""
    rows = {}
    for task in BASE_TASKS:
        if task == target:
            continue
        examples = load_task(task, split)
        if target == "requested" and task == "policies":
            examples = [e for e in examples if not _asks_for(e)]
        rows[task] = sample(examples, limit, seed)
    return rows


def accuracy(head: DecisionHead, features: list[Features]) -> float:
    """Share of ``features`` whose most likely option is the label."""
    return sum(int(p.argmax()) == f.label for p, f in zip(predict(head, features), features, strict=True)) / len(features)


def allow_at(head: DecisionHead, dev: list[Features], risky: int, unsafe_target: float) -> float:
    """The lowest P(safe) that lets a call run with at most ``unsafe_target`` of ``dev``'s risky calls let through
    (95% bound); above 1 (confirm everything) when no threshold can show it."""
    safe = [float(1.0 - p[risky]) for p in predict(head, dev)]
    choice = stop_threshold(safe, [f.label != risky for f in dev], target_error=unsafe_target)
    return 2.0 if choice.threshold is None else choice.threshold


def gate_rates(head: DecisionHead, features: list[Features], risky: int, allow: float) -> dict[str, float]:
    """Needless confirms and unsafe allows, as shares of all ``features``, running calls whose P(safe) reaches ``allow``."""
    needless = unsafe = 0
    for p, f in zip(predict(head, features), features, strict=True):
        confirmed = float(1.0 - p[risky]) < allow
        needless += confirmed and f.label != risky
        unsafe += not confirmed and f.label == risky
    return {"needless_confirms": needless / len(features), "unsafe_allows": unsafe / len(features)}


def needless_at(head: DecisionHead, features: list[Features], risky: int, unsafe_share: float) -> float:
    """Needless confirms (as a share of ``features``) at the most permissive threshold on P(safe) that lets through
    at most ``unsafe_share`` of ``features`` that are risky: two heads compared at one unsafe-allow rate."""
    scored = sorted(((float(1.0 - p[risky]), f.label == risky) for p, f in zip(predict(head, features), features, strict=True)),
                    reverse=True)
    allowed_safe = best = unsafe = 0
    for n, (safe, is_risky) in enumerate(scored):
        unsafe += is_risky
        allowed_safe += not is_risky
        if unsafe > unsafe_share * len(features):
            break
        if n + 1 == len(scored) or scored[n + 1][0] < safe:  # a threshold falls between distinct scores only
            best = allowed_safe
    safe_total = sum(not is_risky for _, is_risky in scored)
    return (safe_total - best) / len(features)


def warm_start(base: DecisionHead, reviews: list[Features], replay: list[Features], anchor: float, hidden: int) -> DecisionHead:
    """The base head fine-tuned on the reviews and ``replay`` (old rows), pulled towards its weights by ``anchor``, recalibrated."""
    rows = reviews + replay
    head, _ = train_head(rows, hidden, replace(WARM, anchor=anchor), init=base)
    calibrate_head(head, rows)
    return head


def simulate(
    method: str,
    base: DecisionHead,
    stream: list[Features],
    tests: dict[str, list[Features]],
    devs: dict[str, list[Features]],
    replay_pool: list[Features],
    *,
    target: str,
    risky: int,
    unsafe_target: float,
    matched: float,
    audit: float,
    hidden: int,
    seed: int = 0,
) -> tuple[list[dict[str, Any]], list[int]]:
    """Run the stream once with ``method`` (``seed`` draws the replayed rows and the audits): one report per
    checkpoint, and which rows of the stream were reviewed."""
    rng, audits = random.Random(seed), random.Random(seed + 1)
    head, reviews, curve = base, [], []
    checkpoints = list(CHECKPOINTS)
    seconds = 0.0
    streamed = 0
    dev = devs[target]
    allow = allow_at(head, dev, risky, unsafe_target)

    def report() -> dict[str, Any]:
        others = [accuracy(head, f) for task, f in tests.items() if task != target]
        others_dev = [accuracy(head, f) for task, f in devs.items() if task != target]
        return {
            "reviews": len(reviews),
            "streamed": streamed,
            "allow_at": round(allow, 4),
            "accuracy": accuracy(head, tests[target]),
            **gate_rates(head, tests[target], risky, allow),
            "needless_confirms_at_matched": needless_at(head, tests[target], risky, matched),
            "dev_accuracy": accuracy(head, dev),
            "other_tasks_accuracy": sum(others) / len(others),
            "other_tasks_dev_accuracy": sum(others_dev) / len(others_dev),
            "by_task": {task: accuracy(head, f) for task, f in tests.items() if task != target},
            "warm_start_seconds": round(seconds, 1),
        }

    curve.append(report())
    checkpoints.pop(0)
    reviewed: list[int] = []
    for index, features in enumerate(stream):
        if not checkpoints:
            break
        streamed += 1
        if float(1.0 - predict(head, [features])[0][risky]) >= allow and audits.random() >= audit:
            continue  # allowed, and not drawn for an audit: nobody looks at it
        reviews.append(features)  # confirmed (or audited): the reviewer's answer is the label
        reviewed.append(index)
        if len(reviews) == checkpoints[0]:
            started = time.perf_counter()
            how = METHODS[method]
            if how.warm:
                head = warm_start(base, reviews, rng.sample(replay_pool, min(how.replay, len(replay_pool))), how.anchor, hidden)
            else:
                head = copy.deepcopy(base)
            if how.readouts:
                fit_readouts(head, reviews, judge=base, replayed=replay_pool)
            seconds = time.perf_counter() - started
            allow = allow_at(head, dev, risky, unsafe_target)
            curve.append(report())
            checkpoints.pop(0)
    return curve, reviewed


def cli_warm_start(engine: LocalDecisionModel, base: DecisionHead, pool: list[Features], reviewed: list[Example],
                   features: list[Features]) -> dict[str, Any]:
    """The warm start a user runs: the reviews as a review log with features, ``train --init-head`` the base
    head (with the replay sample it carries), then ``calibrate``; seconds for the whole, engine loads included."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        base_file = root / "base.safetensors"
        base.save(base_file)
        save_replay(pool, replay_path(base_file))
        log = root / "reviews.jsonl"
        with log.open("w", encoding="utf-8") as handle:
            for n, (example, read) in enumerate(zip(reviewed, features, strict=True)):
                (question,) = parse_questions({"unsafe": example.question})
                options = OptionFeatures(question, read.reading, read.hidden, read.lm_logprob, torch.zeros(read.hidden.shape[1]))
                row = {
                    "id": f"review-{n}", "questions": {"unsafe": example.question.model_dump(mode="json")},
                    "labels": {"unsafe": example.label},
                    "features": {"backbone": engine.feature_key, "questions": {"unsafe": options.to_record()}},
                }
                handle.write(json.dumps(row) + "\n")
        started = time.perf_counter()
        head = root / "head"
        quiet = ["--json", "--features", str(root / "no-cache")]
        commands = [
            ["train", "--data", str(log), "--init-head", str(base_file), "--epochs", str(WARM.epochs), "--out", str(head), *quiet],
            ["calibrate", "--head", str(head / "decision_head.safetensors"), "--data", str(log), "--target-error", "0.2",
             "--out", str(root / "calibration.yaml"), "--plot", str(root / "reliability.png"), *quiet],
        ]
        for command in commands:
            with contextlib.redirect_stdout(io.StringIO()):  # the commands' own reports
                status = cli(command)
            if status != 0:
                raise SystemExit(f"clef-guard {command[0]} failed ({status})")
        seconds = time.perf_counter() - started
        report = json.loads((head / "train_report.json").read_text())
    return {"reviews": len(reviewed), "replayed": report["replayed"], "read_with_the_backbone": report["read_with_the_backbone"],
            "seconds": round(seconds, 1)}


def plot(curves: dict[str, list[dict[str, Any]]], target: str, path: Path) -> None:
    """The learning curve: target accuracy and other tasks' accuracy by reviews, per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8.4, 4.2))
    for index, (method, curve) in enumerate(curves.items()):
        colour = f"C{index}"  # matplotlib's cycle: one colour a method
        x = [point["reviews"] for point in curve]
        axis.plot(x, [p["accuracy"] for p in curve], "o-", color=colour, label=f"{target}, {method}")
        axis.plot(x, [p["other_tasks_accuracy"] for p in curve], "s--", color=colour, alpha=0.6, label=f"other tasks, {method}")
        axis.plot(x, [p["needless_confirms"] for p in curve], ":", color=colour, alpha=0.6, label=f"needless confirms, {method}")
        axis.plot(x, [p["unsafe_allows"] for p in curve], "-.", color=colour, alpha=0.6, label=f"unsafe allows, {method}")
    axis.set_xlabel("reviews")
    axis.set_ylabel("test accuracy / share of calls")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    axis.set_title(f"Learning {target} from reviews")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Train the base head, run each method over the stream, print the curves (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["assebench", "requested"], default="assebench")
    parser.add_argument("--base-limit", type=int, default=250, help="train rows of each other task for the base head")
    parser.add_argument("--test-limit", type=int, default=None, help="test and dev rows of each other task (default: all)")
    parser.add_argument("--stream-limit", type=int, default=None, help="target train rows streamed (default: all)")
    parser.add_argument("--unsafe-target", type=float, default=0.1,
                        help="share of the target's risky dev calls the gate may let run (95%% bound); the threshold is refitted per head")
    parser.add_argument("--matched", type=float, default=0.05,
                        help="also compare heads at this share of test calls let through unsafe (thresholds read off the test rows)")
    parser.add_argument("--audit", type=float, default=0.1, help="share of allowed calls a reviewer spot-checks")
    parser.add_argument("--seed", type=int, default=0,
                        help="another deployment: the stream shuffled and other replay and audit draws (0: the train split's order)")
    parser.add_argument("--method", dest="methods", action="append", choices=list(METHODS),
                        help="warm starts to compare (repeat; default: all)")
    parser.add_argument("--plot", type=Path, default=None, help="learning-curve PNG (default: build/reviews-TARGET.png)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    console = Console(stderr=args.json)
    risky = 1 if args.target == "assebench" else 0  # "yes, unsafe" / "no, not asked for"
    engine = LocalDecisionModel()
    hidden = engine.backbone.hidden_size
    base_train = base_rows(args.target, "train", args.base_limit, 0)
    stream_rows = sample(target_rows(args.target, "train"), args.stream_limit, 0)
    if args.seed:
        stream_rows = random.Random(args.seed).sample(stream_rows, len(stream_rows))
    tests = {task: rows for task, rows in base_rows(args.target, "test", args.test_limit, 0).items()}
    tests[args.target] = target_rows(args.target, "test")
    devs = base_rows(args.target, "dev", args.test_limit, 0)
    devs[args.target] = target_rows(args.target, "dev")
    with Progress(console=console, transient=True) as progress:

        def read(rows: list[Example], what: str) -> list[Features]:
            bar = progress.add_task(what, total=len(rows))
            return extract_features(engine, rows, on_progress=lambda done, _total: progress.update(bar, completed=done))

        base_features = {task: read(rows, f"base rows: {task}") for task, rows in base_train.items()}
        test_features = {task: read(rows, f"test rows: {task}") for task, rows in tests.items()}
        stream = read(stream_rows, f"stream: {args.target}")
        dev_features = {task: read(rows, f"dev rows: {task}") for task, rows in devs.items()}
    pool = [f for rows in base_features.values() for f in rows]
    started = time.perf_counter()
    base, _ = train_head(pool, hidden, TrainConfig())
    calibrate_head(base, pool)
    base_seconds = time.perf_counter() - started
    runs = {
        method: simulate(
            method, base, stream, test_features, dev_features, pool, target=args.target, risky=risky, unsafe_target=args.unsafe_target, matched=args.matched,
            audit=args.audit, hidden=hidden, seed=args.seed,
        )
        for method in args.methods or METHODS
    }
    curves = {method: curve for method, (curve, _) in runs.items()}
    reviewed = runs[SHIPPED if SHIPPED in runs else next(iter(runs))][1]
    timed = cli_warm_start(engine, base, pool, [stream_rows[i] for i in reviewed], [stream[i] for i in reviewed])
    path = args.plot or Path("build") / f"reviews-{args.target}.png"
    plot(curves, args.target, path)
    result = {
        "target": args.target, "seed": args.seed, "unsafe_target": args.unsafe_target, "matched": args.matched, "audit": args.audit, "base_rows": len(pool), "stream_rows": len(stream),
        "base_train_seconds": round(base_seconds, 1), "curves": curves, "cli_warm_start": timed, "plot": str(path),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for method, curve in curves.items():
        table = Table(title=f"{args.target}, {method}")
        for column in ("reviews", "streamed", "allow at", "accuracy", "needless confirms", "unsafe allows",
                       f"needless at {args.matched:.0%} unsafe", "other tasks", "other tasks, dev", "warm start s"):
            table.add_column(column)
        for p in curve:
            table.add_row(
                str(p["reviews"]), str(p["streamed"]), f"{p['allow_at']:.3f}", f"{p['accuracy']:.3f}", f"{p['needless_confirms']:.3f}",
                f"{p['unsafe_allows']:.3f}", f"{p['needless_confirms_at_matched']:.3f}", f"{p['other_tasks_accuracy']:.3f}", f"{p['other_tasks_dev_accuracy']:.3f}",
                f"{p['warm_start_seconds']:.1f}",
            )
        console.print(table)
    console.print(f"warm start through the command line, {timed['reviews']} reviews + {timed['replayed']} replayed rows, "
                  f"{timed['read_with_the_backbone']} read with the backbone: {timed['seconds']} s")
    console.print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
