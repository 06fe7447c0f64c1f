"""Engine benchmarks, measured side by side in one run on the same backbone.

    python benchmarks/engine.py            # a table
    python benchmarks/engine.py --json     # one JSON object

- onepass_vs_generate: median latency of asking the same backbone to *write* a JSON
  answer with ``generate`` (then parsing it), divided by our one-pass engine, for 4
  questions on a ~300-token state; with the baseline's parse failures.
- q8_over_q1: 8 questions on a ~400-token state over 1 question on the same state.
- prefix_cache_speedup: a 12-turn conversation gated at every turn; last-turn latency
  without the prefix cache over with it.
- permutation_max_delta: largest change of any option's probability when the options
  of a 10-way choice are shuffled, over 20 states.
- listed_over_wide_77: a 77-way choice (BANKING77's labels) on a short state, listed
  (``wide_choice_options=255``: every label in the prompt and a branch each) over read
  wide (the default for more than 16 options: no listing, cached option vectors).
- gate_p50/p95_ms: latency per gate with 1 and 4 questions on a 512-token state, on
  whatever device the engine picked (run it on a GPU for the GPU figures).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from langchain_core.decisions import Choice, Noul, Score
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from rich.console import Console
from rich.table import Table

from clef_guard import LocalDecisionModel
from clef_guard.engine.state import state_segments
from clef_guard.training.datasets import load_task

QUESTIONS: dict[str, Any] = {
    "destructive": Noul(instructions="Would the proposed tool call delete or overwrite data?"),
    "external": Noul(instructions="Does the proposed tool call send data outside the organisation?"),
    "intent": Choice(
        instructions="What is the agent trying to do?",
        criteria={"cleanup": "Remove files or records.", "report": "Summarise or notify.", "deploy": "Ship code."},
    ),
    "risk": Score(instructions="How risky is the proposed tool call?", criteria=["harmless", "needs care", "dangerous"]),
    "pii": Noul(instructions="Does the state contain personal data?"),
    "approved": Noul(instructions="Did the user explicitly approve this action?"),
    "reversible": Noul(instructions="Can the proposed action be undone?"),
    "scope": Choice(
        instructions="Which system does the call touch?",
        criteria={"storage": None, "database": None, "email": None, "chat": None},
    ),
}
TEN_WAY = {f"route_{name}": None for name in "billing refunds cards loans fraud travel account security mortgage other".split()}


def conversation(turns: int, words_per_turn: int = 40) -> list[Any]:
    """An agent conversation: a request, then ``turns`` tool calls with their results.

    ``conversation(k + 1)`` extends ``conversation(k)``, as an agent's state does.
    """
    vocab = "bucket staging report file archive customer invoice backup folder record".split()
    messages: list[Any] = [HumanMessage("Clean up the staging bucket, then send the weekly report to the team.")]
    for i in range(turns):
        rng = random.Random(i)
        call = {"name": "list_files", "args": {"prefix": f"staging/{i}/"}, "id": f"call_{i}"}
        result = " ".join(rng.choice(vocab) for _ in range(words_per_turn))
        messages += [AIMessage("", tool_calls=[call]), ToolMessage(result, tool_call_id=f"call_{i}", name="list_files")]
    return messages


def state_of_tokens(engine: LocalDecisionModel, target: int) -> list[Any]:
    """The shortest conversation whose serialisation reaches ``target`` tokens."""
    tokenizer = engine.backbone.tokenizer
    for turns in range(1, 200):
        state = conversation(turns)
        if len(tokenizer("\n".join(state_segments(state)))["input_ids"]) >= target:
            return state
    raise RuntimeError("could not build a state that long")


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def generation_baseline(engine: LocalDecisionModel, state: Any, questions: dict[str, Any]) -> Callable[[], bool]:
    """The same backbone asked to write a JSON answer with ``generate``; returns parse success."""
    backbone = engine.backbone
    lines = []
    for qid, q in questions.items():
        if q.type == "noul":
            lines.append(f'- "{qid}" (yes or no): {q.instructions}')
        elif q.type == "choice":
            lines.append(f'- "{qid}" (one of {", ".join(q.criteria)}): {q.instructions}')
        else:
            lines.append(f'- "{qid}" (a level from 0 to {len(q.criteria) - 1}): {q.instructions}')
    prompt = backbone.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Answer every question about the state. Reply with one JSON object "
             "mapping each question id to its answer, and nothing else."},
            {"role": "user", "content": "STATE:\n" + "\n".join(state_segments(state)) + "\n\nQUESTIONS:\n" + "\n".join(lines)},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = backbone.tokenizer(prompt, return_tensors="pt").to(backbone.device)

    def run() -> bool:
        with torch.inference_mode():
            out = backbone.lm.generate(
                **inputs, max_new_tokens=80, do_sample=False, pad_token_id=backbone.tokenizer.eos_token_id
            )
        text = backbone.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        return _parses(text, questions)

    return run


def _parses(text: str, questions: dict[str, Any]) -> bool:
    match = re.search(r"\{.*\}", text, re.DOTALL)
    if not match:
        return False
    try:
        answer = json.loads(match.group(0))
    except json.JSONDecodeError:
        return False
    if not isinstance(answer, dict) or set(answer) != set(questions):
        return False
    for qid, q in questions.items():
        value = str(answer[qid]).strip().lower()
        valid = {"noul": {"yes", "no", "true", "false"}, "choice": set(getattr(q, "criteria", {}))}.get(
            q.type, {str(i) for i in range(len(getattr(q, "criteria", [])))}
        )
        if value not in valid:
            return False
    return True


def ask(engine: LocalDecisionModel, state: Any, questions: dict[str, Any]) -> Callable[[], Any]:
    return lambda: engine.invoke({"state": state, "questions": questions})


def run(repeats: int) -> dict[str, Any]:
    engine = LocalDecisionModel()
    uncached = LocalDecisionModel(prefix_cache_size=0)
    results: dict[str, Any] = {"device": str(engine.backbone.device), "model": engine.model, "repeats": repeats}

    four = dict(list(QUESTIONS.items())[:4])
    state300 = state_of_tokens(engine, 300)
    baseline = generation_baseline(engine, state300, four)
    base_times, failures = [], 0
    baseline()
    for _ in range(repeats):
        start = time.perf_counter()
        failures += not baseline()
        base_times.append(time.perf_counter() - start)
    ours = timed(ask(uncached, state300, four), repeats)
    results["generate_ms"] = 1000 * statistics.median(base_times)
    results["onepass_ms"] = 1000 * statistics.median(ours)
    results["onepass_vs_generate"] = statistics.median(base_times) / statistics.median(ours)
    results["generate_parse_failures"] = f"{failures}/{repeats}"

    state400 = state_of_tokens(engine, 400)
    q1 = timed(ask(uncached, state400, dict(list(QUESTIONS.items())[:1])), repeats)
    q8 = timed(ask(uncached, state400, QUESTIONS), repeats)
    results["q8_over_q1"] = statistics.median(q8) / statistics.median(q1)

    last_turn: dict[str, list[float]] = {"cached": [], "uncached": []}
    for _ in range(repeats):
        engine.clear_prefix_cache()
        for name, eng in (("cached", engine), ("uncached", uncached)):
            for turn in range(1, 13):
                start = time.perf_counter()
                eng.invoke({"state": conversation(turn), "questions": four})
                elapsed = time.perf_counter() - start
            last_turn[name].append(elapsed)
    results["prefix_cache_speedup"] = statistics.median(last_turn["uncached"]) / statistics.median(last_turn["cached"])

    rng = random.Random(0)
    worst = 0.0
    for i in range(20):
        state = conversation(1 + i % 6)
        labels = list(TEN_WAY)
        shuffled = rng.sample(labels, len(labels))
        a = uncached.invoke({"state": state, "questions": {"c": Choice(instructions="Where should this go?", criteria=TEN_WAY)}})
        b = uncached.invoke(
            {"state": state, "questions": {"c": Choice(instructions="Where should this go?", criteria={k: None for k in shuffled})}}
        )
        worst = max(worst, *(abs(a.choices["c"].probabilities[k] - b.choices["c"].probabilities[k]) for k in labels))
    results["permutation_max_delta"] = worst

    banking = load_task("banking77", "test", limit=1)[0]
    listing = LocalDecisionModel(prefix_cache_size=0, wide_choice_options=255)
    wide_times = timed(ask(uncached, banking.state, {"c": banking.question}), repeats)  # timed() warms up once
    listed_times = timed(ask(listing, banking.state, {"c": banking.question}), repeats)
    results["listed_over_wide_77"] = statistics.median(listed_times) / statistics.median(wide_times)

    state512 = state_of_tokens(engine, 512)
    for n in (1, 4):
        times = sorted(timed(ask(uncached, state512, dict(list(QUESTIONS.items())[:n])), max(repeats, 20)))
        results[f"gate_{n}q_p50_ms"] = 1000 * statistics.median(times)
        results[f"gate_{n}q_p95_ms"] = 1000 * times[min(len(times) - 1, int(0.95 * len(times)))]
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per measurement (median taken)")
    args = parser.parse_args(argv)
    results = run(args.repeats)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    goals = {"onepass_vs_generate": ">= 5x", "q8_over_q1": "<= 1.5", "prefix_cache_speedup": ">= 3x"}
    table = Table(title=f"clef-guard engine on {results['device']} ({results['model']})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("goal")
    for key, value in results.items():
        if key in ("device", "model"):
            continue
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value), goals.get(key, ""))
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
