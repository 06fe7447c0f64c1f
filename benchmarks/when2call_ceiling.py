"""How much of When2Call's answer the frozen backbone's features hold: a diagnostic, never a score.

    python benchmarks/when2call_ceiling.py [--folds 2] [--json]

When2Call is a test set only, so the shipped head learns its question from generated
``tool-use`` rows and is scored on When2Call (``quality.py tool-use``). This script asks a
different question: if a head could learn from When2Call itself, how far would the same
frozen features take it? It trains heads (``clef-guard train``'s code and default settings,
the shipped head's) on all folds but one of When2Call's 300 rows, with and without the tool-use
train rows, and scores the held-out fold. Heads trained here see test rows, so they are
never shipped and their accuracy is not a When2Call result: it bounds what better generated
rows can reach without changing the features (LoRA, another layer, a stronger backbone).
"""

from __future__ import annotations

import argparse
import json
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from clef_guard import LocalDecisionModel
from clef_guard.training.datasets import load_task
from clef_guard.training.features import Features, extract_features
from clef_guard.training.fit import predict, train_head


def _accuracy(train: list[Features], test: list[Features], hidden_size: int) -> list[bool]:
    head, _ = train_head(train, hidden_size)
    return [int(p.argmax()) == f.label for p, f in zip(predict(head, test), test, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    engine = LocalDecisionModel(default_head=False)
    rows = extract_features(engine, load_task("when2call", "test"))
    generated = extract_features(engine, load_task("tool-use", "train"))
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    results = {}
    for name, extra in (("when2call folds", []), ("when2call folds + tool-use train", generated)):
        right: list[bool] = []
        for fold in range(args.folds):
            held = set(order[fold :: args.folds])
            train = [f for i, f in enumerate(rows) if i not in held] + extra
            right += _accuracy(train, [rows[i] for i in sorted(held)], engine.backbone.hidden_size)
        results[name] = sum(right) / len(right)
    if args.json:
        print(json.dumps({"folds": args.folds, "n": len(rows), "accuracy": results}, indent=2))
        return
    for name, accuracy in results.items():
        print(f"{name:34} held-out accuracy {accuracy:.3f} ({args.folds} folds, {len(rows)} rows)")


if __name__ == "__main__":
    main()
