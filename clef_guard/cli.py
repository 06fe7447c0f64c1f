"""The ``clef-guard`` command line.

    clef-guard lint PATH...                       check policy files (exit 1 on errors)
    clef-guard explain --policy FILE --tool-call JSON [--state FILE] [--json]
                                                  ask the engine, show answers, rules, verdict
    clef-guard audit summarize FILE... [--json]   decisions per policy and verdict
    clef-guard train --task NAME... --out DIR     fit a decision head on cached backbone features
    clef-guard calibrate --head FILE --task NAME  temperature, ECE/Brier, reliability PNG, thresholds
    clef-guard fit-readouts --task NAME --out DIR [--question POLICY:QUESTION] [--weigh POLICY:QUESTION:OPTION=W]
                                                  give questions of a head readouts of their own
    clef-guard eval --task NAME --split test      accuracy, macro-F1, ECE, Brier, p50 latency (or --data FILE.jsonl)
    clef-guard suggest-examples --policy FILE --texts FILE
                                                  draft a choice's examples from unlabeled requests (YAML to review)
    clef-guard serve [--host H] [--port P] [--api-key-env NAME]
                                                  serve the engine over HTTP (System One API)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clef_guard.engine.novelty import familiarity_scale
from clef_guard.engine.prompt import render_question
from clef_guard.engine.requests import parse_questions
from clef_guard.errors import ClefGuardError, PolicyError
from clef_guard.gate.guard import Guard, situation
from clef_guard.gate.rules import rule_trace
from clef_guard.gate.trail import label_sources
from clef_guard.gate.verdict import PolicyDecision, Verdict
from clef_guard.policy.load import Policy, load_policy
from clef_guard.telemetry.audit import read_records, shadow_summary, summarize
from clef_guard.training import cli as training_cli

if TYPE_CHECKING:
    from clef_guard.engine.local import LocalDecisionModel


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="clef-guard", description="Calibrated guardrails for agents.")
    commands = parser.add_subparsers(dest="command", required=True)
    lint = commands.add_parser("lint", help="check policy files")
    lint.add_argument("paths", nargs="+", type=Path, help="policy files or folders")
    explain = commands.add_parser("explain", help="show how a policy decides one tool call")
    explain.add_argument("--policy", required=True, help="a policy file, or a built-in policy by name")
    explain.add_argument("--tool-call", required=True, help='JSON: {"name": ..., "args": {...}}')
    explain.add_argument("--state", type=Path, help="a JSON file with the state (messages, fields)")
    explain.add_argument("--phase", default=None, help="before_tool, after_tool or route (default: the policy's)")
    explain.add_argument("--step", default=None, help="graph step or route name")
    explain.add_argument("--model", default=None, help="engine backbone (default: the embedded model)")
    explain.add_argument("--adapter", default=None, help="peft adapter folder for the engine")
    explain.add_argument("--json", action="store_true", help="print one JSON object")
    audit = commands.add_parser("audit", help="read audit logs").add_subparsers(dest="audit_command", required=True)
    summary = audit.add_parser("summarize", help="decisions per policy and verdict")
    summary.add_argument("files", nargs="+", type=Path, help="JSON-lines audit files")
    summary.add_argument("--json", action="store_true", help="print one JSON object")
    training_cli.add_commands(commands)
    serve = commands.add_parser("serve", help="serve the engine over HTTP (System One API)")
    serve.add_argument("--model", default=None, help="engine backbone (default: the embedded model)")
    serve.add_argument("--adapter", default=None, help="peft adapter folder for the engine")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key-env", metavar="NAME", help="require Authorization: Bearer with the key in this variable")
    serve.add_argument("--batch-window-ms", type=float, default=None, help="how long a request waits for others to batch with")
    serve.add_argument("--max-batch", type=int, default=None, help="most requests in one engine batch (1: one at a time)")
    serve.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get 413")
    serve.add_argument("--request-timeout-s", type=float, default=None, help="requests not answered by then get 504")
    args = parser.parse_args(argv)
    console = Console(emoji=False)  # ":name:" in a message, a question key or a state is text, not an emoji
    if args.command in training_cli.COMMANDS:
        try:
            return training_cli.run(args, console)
        except ClefGuardError as exc:
            Console(stderr=True, emoji=False).print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
            return 2
    if args.command == "lint":
        return _lint(args.paths, console)
    if args.command == "audit":
        return _summarize(args.files, args.json, console)
    try:
        return _serve(args, console) if args.command == "serve" else _explain(args, console)
    except ClefGuardError as exc:
        Console(stderr=True, emoji=False).print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        return 2


def _lint(paths: list[Path], console: Console) -> int:
    files = [f for p in paths for f in (sorted(p.glob("*.y*ml")) if p.is_dir() else [p])]
    errors = 0
    for file in files:
        try:
            policy = load_policy(file)
        except PolicyError as exc:
            errors += 1
            console.print(f"[red]✗[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        except Exception as exc:  # one unreadable file must not stop the others from being linted
            errors += 1
            console.print(f"[red]✗[/red] {file}: cannot be read: {type(exc).__name__}: {escape(str(exc))}", highlight=False, soft_wrap=True)
        else:
            console.print(f"[green]✓[/green] {file}: {policy.name} ({len(policy.questions)} questions, {len(policy.rules)} rules)", highlight=False)
    if not files:
        console.print("[red]✗[/red] no policy files found")
        return 1
    return 1 if errors else 0


def _summarize(files: list[Path], as_json: bool, console: Console) -> int:
    try:
        records = read_records(files)
    except (OSError, ValueError) as exc:
        Console(stderr=True, emoji=False).print(f"[red]error:[/red] cannot read the audit log: {escape(str(exc))}", highlight=False)
        return 2
    rows, shadow = summarize(records), shadow_summary(records)
    if as_json:
        print(json.dumps({"policies": rows, "shadow": shadow}, indent=2))
        return 0
    table = Table(title="clef-guard decisions per policy")
    table.add_column("policy", overflow="fold")
    for column in ("n", "allow", "conf", "esc", "deny", "conf%", "deny%", "p50ms", "p95ms"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        counts = row["verdicts"]
        table.add_row(
            row["policy"],
            str(row["decisions"]),
            *(str(counts.get(v, 0)) for v in ("allow", "confirm", "escalate", "deny")),
            f"{row['confirm_rate']:.0%}",
            f"{row['deny_rate']:.0%}",
            f"{row['p50_ms']:.1f}",
            f"{row['p95_ms']:.1f}",
        )
    console.print(table)
    if shadow:
        would = Table(title="Policies in shadow mode: what they would have decided")
        for column in ("policy", "rule", "n", "allow", "conf", "esc", "deny"):
            would.add_column(column, overflow="fold")
        for row in shadow:
            counts = row["would"]
            would.add_row(row["policy"], row["rule"], str(row["decisions"]), *(str(counts.get(v, 0)) for v in ("allow", "confirm", "escalate", "deny")))
        console.print(would)
    return 0


def _explain(args: argparse.Namespace, console: Console) -> int:
    policy = load_policy(args.policy)
    try:
        tool_call = json.loads(args.tool_call)
        state = json.loads(args.state.read_text(encoding="utf-8")) if args.state else None
    except (json.JSONDecodeError, OSError) as exc:
        raise PolicyError(f"cannot read the tool call or state: {exc}", field="--tool-call/--state") from None
    if not isinstance(tool_call, dict):
        raise PolicyError("the tool call must be a JSON object", field="--tool-call")
    engine = _load_engine(args, console) if policy.questions else None  # a rules-only policy never needs one
    guard = Guard([policy], engine=engine, human_review=True, every_question=True)  # every answer, for the trace
    phase = args.phase or policy.applies_to.phase
    verdict = guard.check(tool_call, state, phase=phase, step=args.step)
    decision = verdict.decisions[0] if verdict.decisions else None
    _, flow = situation(tool_call, state, {"phase": phase})
    usable = decision is not None and decision.error is None
    trace = rule_trace(policy, decision.answers, verdict.tool_call, {}, flow) if usable else []
    used = _flow_used(policy, verdict, flow, state)
    if args.json:
        report = {"verdict": verdict.to_dict(), "rule_trace": [{"rule": r, "result": v} for r, v in trace], "flow": used}
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_explanation(console, policy, verdict, trace)
        _print_flow(console, used)
    return 0


def _flow_used(policy: Policy, verdict: Verdict, flow: dict[str, Any], state: Any) -> dict[str, Any]:
    """What of the thread's trail the policy's rules read: its labels (and where they came from) and its history."""
    reading = [r.id for r in policy.rules if re.search(r"\b(history|labels)\b", r.source)]
    return {
        "rules": reading,
        "labels": flow["labels"],
        "call_labels": verdict.tool_call.get("labels", []),
        "result_labels": list(verdict.labels),
        "sources": label_sources(state),
        "history": [{k: h[k] for k in ("id", "name", "verdict", "labels", "turns_ago")} for h in flow["history"]] if reading else [],
    }


def _print_flow(console: Console, used: dict[str, Any]) -> None:
    if not (used["rules"] or used["labels"] or used["result_labels"]):
        return
    console.print(f"rules reading the thread: {', '.join(used['rules']) or '-'}")
    console.print(f"thread labels: {used['labels'] or '-'}   carried by this call's arguments: {used['call_labels'] or '-'}")
    for source in used["sources"]:
        console.print(escape(f"  {', '.join(source['labels'])} from {source['tool']} (call {source['id']}, {source['turns_ago']} turns ago)"))
    for entry in used["history"]:
        console.print(escape(f"  history: {entry['name']} -> {entry['verdict']} {entry['labels'] or ''} ({entry['turns_ago']} turns ago)"))
    if used["result_labels"]:
        console.print(f"labels attached to this result: {used['result_labels']}")


def _serve(args: argparse.Namespace, console: Console) -> int:
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    if args.api_key_env and not api_key:
        raise ClefGuardError(f"--api-key-env: ${args.api_key_env} is not set or empty; export the key or drop the flag")
    try:
        import uvicorn

        from clef_guard.server.app import create_app
    except ModuleNotFoundError as exc:
        raise ClefGuardError(f"serving needs {exc.name}: pip install 'clef-guard[serve]'") from None
    limits = {
        "batch_window_ms": args.batch_window_ms, "max_batch": args.max_batch, "max_body_bytes": args.max_body_bytes,
        "request_timeout_s": args.request_timeout_s,
    }
    try:
        app = create_app(_load_engine(args, console), api_key=api_key, **{k: v for k, v in limits.items() if v is not None})
    except ValueError as exc:
        raise ClefGuardError(f"serve: {exc} (see --max-batch, --batch-window-ms, --max-body-bytes, --request-timeout-s)") from None
    console.print(f"System One on http://{args.host}:{args.port}/v1/systemone" + (" (key required)" if api_key else ""))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def _load_engine(args: argparse.Namespace, console: Console) -> LocalDecisionModel:
    from clef_guard.engine.local import LocalDecisionModel

    with console.status("Loading the engine..."):
        return LocalDecisionModel(**{k: v for k, v in {"model": args.model, "adapter": args.adapter}.items() if v})


def _print_explanation(console: Console, policy: Policy, verdict: Verdict, trace: list[tuple[str, bool | str]]) -> None:
    console.rule(f"{policy.name} on {verdict.tool_call['name']}")
    if not verdict.decisions:
        console.print("The policy does not apply to this call: [green]allow[/green].")
        return
    decision = verdict.decisions[0]
    if policy.questions:
        _print_answers(console, policy, decision, verdict.familiarity.get(policy.name, {}))
    rules = Table(title="Rules, in order")
    rules.add_column("rule")
    rules.add_column("when")
    rules.add_column("then")
    rules.add_column("holds")
    outcomes = dict(trace)
    for rule in policy.rules:
        outcome = outcomes.get(rule.id, "not evaluated")
        mark = "[green]yes[/green]" if outcome is True else ("no" if outcome is False else f"[red]{outcome}[/red]")
        rules.add_row(rule.id, rule.source, rule.then, mark)
    console.print(rules)
    console.print(f"thresholds: {decision.thresholds}  calibrated: {decision.calibrated}")
    colour = {"allow": "green", "confirm": "yellow", "escalate": "magenta", "deny": "red"}[verdict.action]
    by = f"rule {verdict.rule}" if verdict.rule else "the policy's default"
    console.print(f"verdict: [bold {colour}]{verdict.action}[/bold {colour}] by {by}: {verdict.message or '-'}  ({verdict.latency_ms:.0f} ms)")
    if verdict.error:
        console.print(f"[red]error:[/red] {escape(verdict.error)}")


def _print_answers(console: Console, policy: Policy, decision: PolicyDecision, familiar: dict[str, float]) -> None:
    questions = Table(title="Questions and answers", show_lines=True)
    questions.add_column("question")
    questions.add_column("asked")
    questions.add_column("answer")
    if familiar:
        questions.add_column("familiar to the head")
    for parsed in parse_questions(policy.questions):
        answer = decision.answers.get(parsed.id)
        row = [parsed.id, render_question(parsed), _format_answer(answer) if answer else "[red]no answer[/red]"]
        if familiar:
            row.append(_format_familiarity(familiar.get(parsed.id)))
        questions.add_row(*row)
    console.print(questions)


def _format_familiarity(cosine: float | None) -> str:
    """A question's cosine to the nearest question the head trained on, and what it means for its answer."""
    if cosine is None:
        return "-"
    if cosine > 0.98:
        return f"{cosine:.2f}: trained on it"
    return f"{cosine:.2f}: unlike the questions it trained on, so its logits are scaled by {familiarity_scale(cosine):.2f} (0: even odds)"


def _format_answer(answer: Any) -> str:
    if answer.type == "noul":
        return f"P(yes) = {answer.noul:.3f}"
    probabilities = "\n".join(f"{k}: {v:.3f}" for k, v in answer.probabilities.items())
    head = f"{answer.choice}" if answer.type == "choice" else f"score {answer.score:.2f}"
    return f"{head} (confidence {answer.confidence:.2f})\n{probabilities}"


if __name__ == "__main__":
    sys.exit(main())
