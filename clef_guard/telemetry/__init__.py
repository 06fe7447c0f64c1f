"""Audit: every gate decision as an OpenTelemetry span (:mod:`~clef_guard.telemetry.spans`,
names in :mod:`~clef_guard.telemetry.semconv`), and a JSONL exporter and reader
(:mod:`~clef_guard.telemetry.audit`)."""

from clef_guard.telemetry.audit import JsonlSpanExporter as JsonlSpanExporter
from clef_guard.telemetry.spans import Telemetry as Telemetry

__all__ = ["JsonlSpanExporter", "Telemetry"]
