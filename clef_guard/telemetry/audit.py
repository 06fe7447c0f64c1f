"""The audit log: a span exporter writing one JSON line per decision, and its summary.

.. code-block:: python

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from clef_guard import Guard, JsonlSpanExporter, Telemetry

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter("audit.jsonl")))
    guard = Guard(policies, telemetry=Telemetry(tracer_provider=provider))

``clef-guard audit summarize audit.jsonl`` then prints counts, confirm and deny rates and
latency percentiles per policy and verdict.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from clef_guard.telemetry import semconv as sc


class JsonlSpanExporter(SpanExporter):
    """Append clef-guard decision spans to a JSON-lines file, durably, with size-based rotation.

    Each line is flushed and fsynced before ``export`` returns. When the file would pass
    ``max_bytes`` it is renamed to ``<file>.1`` (older ones shift up to ``backups``) and
    a new file starts. Spans from other instrumentation are ignored.
    """

    def __init__(self, path: str | Path, *, max_bytes: int = 10 * 1024 * 1024, backups: int = 5) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write each decision span as one line."""
        lines = [json.dumps(span_record(s), sort_keys=True, default=str) + "\n" for s in spans if _is_decision(s)]
        try:
            with self._lock:
                for line in lines:
                    self._write(line.encode("utf-8"))
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing to release: every write opens and closes the file."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Writes are already durable when ``export`` returns."""
        return True

    def _write(self, data: bytes) -> None:
        if self.path.exists() and self.path.stat().st_size + len(data) > self.max_bytes:
            self._rotate()
        with open(self.path, "ab") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    def _rotate(self) -> None:
        for index in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{index + 1}"))
        if self.backups > 0:
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink()


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One span as a JSON-ready dict (ids in hex, times in ns)."""
    context = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "start_time_ns": span.start_time,
        "end_time_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in span.events],
    }


def read_records(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Decision records from audit files (blank lines skipped)."""
    records = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            records.extend(json.loads(line) for line in handle if line.strip())
    return records


def summarize(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per policy: decisions, counts by verdict, confirm and deny rates, latency p50/p95 (ms)."""
    latencies: dict[str, list[float]] = defaultdict(list)
    verdicts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for record in records:
        attributes = record.get("attributes", {})
        policy = attributes.get(sc.POLICY_ID) or "(no policy)"
        verdicts[policy][attributes.get(sc.VERDICT_TYPE, "unknown")] += 1
        latencies[policy].append(float(attributes.get(sc.LATENCY_MS, 0.0)))
    rows = []
    for policy in sorted(verdicts):
        counts = dict(verdicts[policy])
        total = sum(counts.values())
        rows.append(
            {
                "policy": policy,
                "decisions": total,
                "verdicts": counts,
                "confirm_rate": counts.get("confirm", 0) / total,
                "deny_rate": counts.get("deny", 0) / total,
                "p50_ms": _percentile(latencies[policy], 0.50),
                "p95_ms": _percentile(latencies[policy], 0.95),
            }
        )
    return rows


def shadow_summary(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per policy and rule in shadow mode: how often it applied, and what it would have decided."""
    would: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for record in records:
        for event in record.get("events", []):
            attributes = event.get("attributes", {})
            if event.get("name") == sc.POLICY_DECISION_EVENT and attributes.get(sc.ENFORCED) is False:
                key = (str(attributes.get(sc.EVALUATION_POLICY)), str(attributes.get(sc.DECISION_RULE, "(default)")))
                would[key][str(attributes.get(sc.DECISION_ACTION))] += 1
    return [
        {"policy": policy, "rule": rule, "decisions": sum(counts.values()), "would": dict(counts)}
        for (policy, rule), counts in sorted(would.items())
    ]


def _percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def _is_decision(span: ReadableSpan) -> bool:
    scope = span.instrumentation_scope
    return scope is not None and scope.name == sc.INSTRUMENTATION
