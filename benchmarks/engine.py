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
- route: a 77-way choice (BANKING77's labels) on BANKING77 test requests, p50/p95 per
  route, read by the sentence encoder (the default for wide choices) with the labels alone
  and with 10 train examples a label, beside the backbone reading it wide (``encoder=None``:
  cached option vectors, one pass) and listing it (``wide_choice_options=255``: every label
  in the prompt and a branch each); ``listed_over_encoder_77`` and
  ``backbone_wide_over_encoder_77`` are the ratios of their p50s.
- gate_p50/p95_ms: latency per gate with 1 and 4 questions on a 512-token state, on
  whatever device the engine picked (run it on a GPU for the GPU figures); beside them a
  one-question gate with only the first half of the decoder layers run (``half_depth``,
  without a head: what the depth lever saves, ``half_depth_speedup``; docs/engine.md#depth).
- agent_loop: an agent's 12 turns through a ``Guard`` with the shipped destructive-actions
  and outbound-communication policies, on a realistic state (a system prompt with the tools'
  docstrings, a request, every call and its result). Per gate after the first turn: p50/p95
  and mean latency and tokens read (``input_tokens - cached_tokens``), with the prefix cache
  off, on, on with ``Guard.read_ahead`` (what the integrations call when tool results arrive,
  run here to completion before the next step, as it would while the agent's model writes),
  all asking at once the questions the call's facts leave a rule a use for (what a ``Guard``
  does by default); ``every_question``: read-ahead asking every question of a policy
  (``Guard(every_question=True)``, what a ``Guard`` did before; ``agent_relevant_speedup`` is
  its mean over the default's: the gates the call's facts lighten are below the median);
  ``lazy``: read-ahead with lazy questions (a policy's questions asked as its rules need them,
  ``Guard(lazy=True)``); and ``one_reading``: read-ahead with one reading of each view
  (``Policy.without_trusted_reading``).
- rules: the agent loop's calls that the destructive-actions policy checks, through its rules
  alone (no engine): the forecast of which questions a call's facts leave a use for, run at every gate,
  with the call's facts worked out once (as a ``Guard`` does) against written out inside
  every rule that reads them (as before); ``rules_facts_once_speedup`` is the ratio.
- bfloat16: the same backbone in bf16 beside float32, a gate on a 512-token state, and how
  far its answers move: from float32's, and between a cached and an uncached read of one
  state (a reduced-precision backbone's answers depend on how its tokens were grouped).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from langchain_core.decisions import Choice, Noul, Score
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from rich.console import Console
from rich.table import Table

from clef_guard import Guard, LocalDecisionModel, load_policies
from clef_guard.engine.state import state_segments
from clef_guard.gate.rules import relevant_questions
from clef_guard.policy.load import HINTS
from clef_guard.training.datasets import load_task, with_examples

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


AGENT_SYSTEM = """You are Ops Assistant for Northwind Labs. You help the infrastructure team keep shared storage,
databases and team channels tidy, and you write the weekly operations report. Work step by step and call
one tool at a time. Never delete anything the user did not ask you to remove; ask when unsure.

Tools:
- list_files(prefix: str) -> str: List the objects under a storage prefix with their sizes and ages.
- read_file(path: str) -> str: Return the text of one file from shared storage.
- delete_file(path: str) -> str: Permanently delete one file from shared storage. Cannot be undone.
- move_file(source: str, target: str) -> str: Move a file to another prefix, replacing any file there.
- write_file(path: str, content: str) -> str: Create or overwrite a text file in shared storage.
- run_sql(query: str) -> str: Run one SQL statement on the operations database and return the rows.
- send_email(to: str, subject: str, body: str) -> str: Send an email from ops@northwind-labs.com.
- post_message(channel: str, text: str) -> str: Post a message to a team chat channel."""
AGENT_REQUEST = (
    "Please clean out last month's build logs under staging/logs/, archive the two incident notes, drop the "
    "expired sessions from the ops database, and then send the weekly report to the infra team and post a "
    "summary in #infra."
)
AGENT_TURNS: list[tuple[str, dict[str, Any], str]] = [
    ("delete_file", {"path": "staging/logs/build-2291.log"}, "Deleted staging/logs/build-2291.log (14.2 MB)."),
    ("delete_file", {"path": "staging/logs/build-2292.log"}, "Deleted staging/logs/build-2292.log (13.8 MB)."),
    ("move_file", {"source": "notes/incident-0412.md", "target": "archive/2026/incident-0412.md"},
     "Moved notes/incident-0412.md to archive/2026/incident-0412.md."),
    ("move_file", {"source": "notes/incident-0419.md", "target": "archive/2026/incident-0419.md"},
     "Moved notes/incident-0419.md to archive/2026/incident-0419.md."),
    ("run_sql", {"query": "DELETE FROM sessions WHERE expires_at < now() - interval '30 days'"},
     "DELETE 18422"),
    ("delete_file", {"path": "staging/logs/build-2293.log"}, "Deleted staging/logs/build-2293.log (15.1 MB)."),
    ("write_file", {"path": "reports/weekly-48.md", "content": "# Week 48\n- 3 build logs removed (43 MB)\n"
                    "- 2 incident notes archived\n- 18,422 expired sessions dropped\n- No open incidents"},
     "Wrote reports/weekly-48.md (142 bytes)."),
    ("send_email", {"to": "infra@northwind-labs.com", "subject": "Weekly ops report, week 48",
                    "body": "Hi all, this week's report is in reports/weekly-48.md: logs cleaned, incidents archived, "
                    "sessions table trimmed. No open incidents."},
     "Sent to infra@northwind-labs.com (message id 7f3a-22c1)."),
    ("post_message", {"channel": "#infra", "text": "Weekly cleanup done: 43 MB of build logs removed, 2 incident "
                      "notes archived, 18k expired sessions dropped. Report: reports/weekly-48.md"},
     "Posted to #infra (ts 1764662400.0032)."),
    ("delete_file", {"path": "staging/tmp/report-draft.md"}, "Deleted staging/tmp/report-draft.md (2 KB)."),
    ("send_email", {"to": "dana.kim@northwind-labs.com", "subject": "Sessions cleanup",
                    "body": "Dana, the sessions table is down by 18,422 rows; the nightly job can go back to its "
                    "usual schedule."},
     "Sent to dana.kim@northwind-labs.com (message id 7f3a-22c9)."),
    ("post_message", {"channel": "#infra", "text": "Dana has been told about the sessions cleanup. That's all for "
                      "this week."},
     "Posted to #infra (ts 1764662460.0041)."),
]
AGENT_TOOLS = {
    line.split("(", 1)[0].removeprefix("- "): line.split(": ", 1)[1]
    for line in AGENT_SYSTEM.splitlines() if line.startswith("- ")
}


def agent_loop(
    engine: LocalDecisionModel, *, read_ahead: bool, lazy: bool, trusted: bool, every_question: bool = False
) -> list[tuple[float, int]]:
    """One pass of the agent's turns: per gate, its seconds and the tokens the engine computed.
    ``trusted``: the policies' second reading, without earlier results and argument prose (as shipped)."""
    policies = [
        p if trusted else p.without_trusted_reading()
        for p in load_policies("destructive-actions", "outbound-communication")
    ]
    guard = Guard(policies, engine=engine, lazy=lazy, every_question=every_question)
    messages: list[Any] = [SystemMessage(AGENT_SYSTEM), HumanMessage(AGENT_REQUEST)]
    gates = []
    for i, (name, args, result) in enumerate(AGENT_TURNS):
        call = {"name": name, "args": args, "id": f"call_{i}"}
        messages.append(AIMessage("", tool_calls=[call]))
        start = time.perf_counter()
        verdict = guard.check(call, {"messages": messages}, tool_description=AGENT_TOOLS[name])
        gates.append((time.perf_counter() - start, verdict.input_tokens - verdict.cached_tokens))
        messages.append(ToolMessage(result, tool_call_id=call["id"], name=name))
        reading = guard.read_ahead({"messages": messages}) if read_ahead else None
        if reading is not None:
            reading.result()
    return gates


def agent_loop_figures(repeats: int) -> dict[str, Any]:
    """Per-gate latency and tokens computed after the first turn: cache off, on, on with read-ahead
    (the questions the call's facts leave a use for, at once: what a Guard does by default), that
    asking every question, that with lazy questions, and that with one reading of each view (no
    trusted reading)."""
    results: dict[str, Any] = {}
    modes = (("no_cache", 0, False, False, True, False), ("cache", 8, False, False, True, False),
             ("read_ahead", 8, True, False, True, False), ("every_question", 8, True, False, True, True),
             ("lazy", 8, True, True, True, False), ("one_reading", 8, True, False, False, False))
    for mode, cache, ahead, lazy, trusted, every in modes:
        engine = LocalDecisionModel(prefix_cache_size=cache)
        later: list[tuple[float, int]] = []
        first: list[float] = []
        loop = {"read_ahead": ahead, "lazy": lazy, "trusted": trusted, "every_question": every}
        agent_loop(engine, **loop)  # warm-up
        for _ in range(repeats):
            engine.clear_prefix_cache()
            gates = agent_loop(engine, **loop)
            first.append(gates[0][0])
            later += gates[1:]
        results[f"agent_{mode}_first_ms"] = 1000 * statistics.median(first)
        results[f"agent_{mode}_p50_ms"], results[f"agent_{mode}_p95_ms"] = p50_p95_ms(seconds for seconds, _ in later)
        results[f"agent_{mode}_mean_ms"] = 1000 * statistics.mean(seconds for seconds, _ in later)
        results[f"agent_{mode}_tokens_per_gate"] = statistics.mean(tokens for _, tokens in later)
    results["agent_read_ahead_speedup"] = results["agent_no_cache_p50_ms"] / results["agent_read_ahead_p50_ms"]
    # means: the calls the facts settle (deletes) are the loop's lighter gates, below its median
    results["agent_relevant_speedup"] = results["agent_every_question_mean_ms"] / results["agent_read_ahead_mean_ms"]
    results["agent_lazy_cost"] = results["agent_lazy_p50_ms"] / results["agent_read_ahead_p50_ms"]
    results["agent_trusted_reading_cost"] = results["agent_read_ahead_p50_ms"] / results["agent_one_reading_p50_ms"]
    return results


def numerics_figures(repeats: int) -> dict[str, Any]:
    """bf16 beside float32: a gate's latency, and how far answers move from float32's and with the cache."""
    four = dict(list(QUESTIONS.items())[:4])
    results: dict[str, Any] = {}
    reference = LocalDecisionModel(prefix_cache_size=0)
    states = [conversation(turn) for turn in range(2, 8)]
    expected = [probabilities(reference.invoke({"state": state, "questions": four})) for state in states]
    state512 = state_of_tokens(reference, 512)
    one = dict(list(QUESTIONS.items())[:1])
    results["gate_1q_float32_p50_ms"] = 1000 * statistics.median(timed(ask(reference, state512, one), repeats))
    del reference
    cached, uncached = LocalDecisionModel(dtype="bfloat16"), LocalDecisionModel(dtype="bfloat16", prefix_cache_size=0)
    results["gate_1q_bfloat16_p50_ms"] = 1000 * statistics.median(timed(ask(uncached, state512, one), repeats))
    fresh = [probabilities(uncached.invoke({"state": state, "questions": four})) for state in states]
    served = [probabilities(cached.invoke({"state": state, "questions": four})) for state in states]  # each turn extends the last
    results["bfloat16_max_delta_vs_float32"] = max(max_delta(a, b) for a, b in zip(expected, fresh, strict=True))
    results["bfloat16_max_delta_cached_vs_uncached"] = max(max_delta(a, b) for a, b in zip(fresh, served, strict=True))
    return results


def probabilities(response: Any) -> dict[str, float]:
    """Every option's probability of every answer, flat."""
    flat = {}
    for qid, answer in response.answers.items():
        dumped = answer.model_dump()
        if dumped.get("noul") is not None:
            flat[qid] = dumped["noul"]
        for label, value in (dumped.get("probabilities") or {}).items():
            flat[f"{qid}.{label}"] = value
    return flat


def max_delta(a: dict[str, float], b: dict[str, float]) -> float:
    """The largest change of any probability between two answers flattened by :func:`probabilities`."""
    return max(abs(a[k] - b[k]) for k in a)


def state_of_tokens(engine: LocalDecisionModel, target: int) -> list[Any]:
    """The shortest conversation whose serialisation reaches ``target`` tokens."""
    tokenizer = engine.backbone.tokenizer
    for turns in range(1, 200):
        state = conversation(turns)
        if len(tokenizer("\n".join(state_segments(state)))["input_ids"]) >= target:
            return state
    raise RuntimeError("could not build a state that long")


def p50_p95_ms(seconds: Iterable[float]) -> tuple[float, float]:
    """Median and 95th percentile of ``seconds``, in milliseconds."""
    times = sorted(seconds)
    return 1000 * statistics.median(times), 1000 * times[min(len(times) - 1, int(0.95 * len(times)))]


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

    state512 = state_of_tokens(engine, 512)
    for n in (1, 4):
        times = timed(ask(uncached, state512, dict(list(QUESTIONS.items())[:n])), max(repeats, 20))
        results[f"gate_{n}q_p50_ms"], results[f"gate_{n}q_p95_ms"] = p50_p95_ms(times)
    half = LocalDecisionModel(prefix_cache_size=0, default_head=False, layers=uncached.backbone.layers // 2)
    times = timed(ask(half, state512, dict(list(QUESTIONS.items())[:1])), max(repeats, 20))
    results["gate_1q_half_depth_p50_ms"], results["gate_1q_half_depth_p95_ms"] = p50_p95_ms(times)
    results["half_depth_speedup"] = results["gate_1q_p50_ms"] / results["gate_1q_half_depth_p50_ms"]
    return results


def route_figures(repeats: int) -> dict[str, Any]:
    """A 77-label route per reader, each timed on the same BANKING77 test requests (option vectors built first)."""
    rows = load_task("banking77", "test", limit=max(20, 3 * repeats))
    labels = rows[0].question
    shots = with_examples(labels, "banking77", 10)
    readers = {
        "encoder": (LocalDecisionModel(prefix_cache_size=0), labels, rows),
        "encoder_10_shot": (LocalDecisionModel(prefix_cache_size=0), shots, rows),
        "backbone_wide": (LocalDecisionModel(prefix_cache_size=0, encoder=None), labels, rows),
        "listed": (LocalDecisionModel(prefix_cache_size=0, wide_choice_options=255), labels, rows[:repeats]),  # seconds a route
    }
    results: dict[str, Any] = {}
    for name, (engine, question, asked) in readers.items():
        ask(engine, asked[0].state, {"c": question})()  # builds and caches the option vectors
        times = [timed(ask(engine, row.state, {"c": question}), 1)[0] for row in asked]
        results[f"route_77_{name}_p50_ms"], results[f"route_77_{name}_p95_ms"] = p50_p95_ms(times)
    for name in ("listed", "backbone_wide"):
        results[f"{name}_over_encoder_77"] = results[f"route_77_{name}_p50_ms"] / results["route_77_encoder_p50_ms"]
    return results


def rules_figures(repeats: int) -> dict[str, Any]:
    """Mean milliseconds a call to forecast the destructive policy's questions, its facts worked out once or in every rule."""
    (policy,) = load_policies("destructive-actions")
    written_out = dataclasses.replace(policy, _fact_programs=())  # no facts to bind: each rule works them out inside
    calls = [{"name": n, "args": a, "annotations": dict.fromkeys(HINTS), "metadata": {}, "tags": []} for n, a, _ in AGENT_TURNS]
    calls = [call for call in calls if policy.matches(call["name"], phase="before_tool", step=None, context={}, tool=call)]
    results: dict[str, Any] = {}
    for name, variant in (("facts_once", policy), ("written_out", written_out)):
        seconds = timed(lambda variant=variant: [relevant_questions(variant, call, {}) for call in calls], repeats * 5)
        results[f"rules_forecast_{name}_ms"] = statistics.median(seconds) * 1000 / len(calls)
    results["rules_facts_once_speedup"] = results["rules_forecast_written_out_ms"] / results["rules_forecast_facts_once_ms"]
    return results


SUITES: dict[str, Callable[[int], dict[str, Any]]] = {
    "core": run, "agent": agent_loop_figures, "numerics": numerics_figures, "route": route_figures, "rules": rules_figures,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per measurement (median taken)")
    parser.add_argument("--only", choices=sorted(SUITES), action="append", help="run these suites only (repeat)")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for name in args.only or SUITES:
        results |= SUITES[name](args.repeats if name != "agent" else max(1, args.repeats // 3))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    goals = {
        "onepass_vs_generate": ">= 5x", "q8_over_q1": "<= 1.5", "prefix_cache_speedup": ">= 5x",
        "gate_1q_p50_ms": "<= 450 (CPU)", "agent_read_ahead_p50_ms": "<= 120 (CPU)", "agent_read_ahead_p95_ms": "<= 250 (CPU)",
        "route_77_encoder_p50_ms": "<= 30 (CPU)",
    }
    table = Table(title=f"clef-guard engine on {results.get('device', 'this machine')} ({results.get('model', LocalDecisionModel.model_fields['model'].default)})")
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
