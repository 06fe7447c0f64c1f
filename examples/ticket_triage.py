"""Ask the embedded engine a ticket-triage request and print every answer.

    make demo            # or: python examples/ticket_triage.py

One request, three typed questions (urgent? which team? how severe?), answered in one
pass over the ticket. The embedded default is untrained for these questions, so read
the probabilities as the zero-shot backbone's, not as decisions.
"""

from __future__ import annotations

import time

from langchain_core.decisions import Choice, Noul, Score
from rich.console import Console
from rich.table import Table

from clef_guard import LocalDecisionModel

TICKETS = [
    "Production database has been down since 3am; no customer can check out. Please help now!",
    "Hi, could you change the billing address on my March invoice? No rush.",
    "Is there a discount for teams of more than 50 seats?",
]
QUESTIONS = {
    "urgent": Noul(
        instructions="Does this ticket need a response within the hour?",
        criteria={"true": "Outage, data loss or blocked customers.", "false": "Anything that can wait."},
    ),
    "team": Choice(
        instructions="Which team should handle this ticket?",
        criteria={
            "billing": "Payments, invoices, refunds.",
            "infrastructure": "Outages, servers, databases.",
            "sales": "Pricing, plans, purchasing.",
        },
    ),
    "severity": Score(
        instructions="How severe is the customer's problem?",
        criteria=["cosmetic or a question", "degraded but working", "blocked", "outage"],
    ),
}


def main() -> None:
    console = Console()
    with console.status("Loading the embedded engine (the first run converts it once)..."):
        engine = LocalDecisionModel()
    for ticket in TICKETS:
        start = time.perf_counter()
        response = engine.invoke({"state": ticket, "questions": QUESTIONS})
        elapsed = 1000 * (time.perf_counter() - start)
        table = Table(title=f"{ticket}\n[dim]{elapsed:.0f} ms, {response.usage['input_tokens']} tokens[/dim]")
        table.add_column("question")
        table.add_column("answer", justify="right")
        table.add_column("probabilities")
        urgent = response.nouls["urgent"]
        table.add_row("urgent", f"{urgent.noul:.2f}", f"yes {urgent.noul:.2f} / no {1 - urgent.noul:.2f}")
        team = response.choices["team"]
        table.add_row(
            "team",
            f"{team.choice} (conf {team.confidence:.2f})",
            "  ".join(f"{k} {v:.2f}" for k, v in team.probabilities.items()),
        )
        severity = response.scores["severity"]
        table.add_row(
            "severity",
            f"{severity.score:.2f} (conf {severity.confidence:.2f})",
            "  ".join(f"{k}:{v:.2f}" for k, v in severity.probabilities.items()),
        )
        console.print(table)


if __name__ == "__main__":
    main()
