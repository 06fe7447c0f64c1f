"""Calibration files: thresholds per policy, fitted on labeled data by ``clef-guard calibrate``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from clef_guard.errors import PolicyError


def load_calibration(source: str | Path | Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Threshold overrides by policy from a calibration file (YAML or JSON) or mapping.

    The file reads ``{version: 1, policies: {<policy>: {thresholds: {<name>: <0..1>}}}}``;
    ``clef-guard calibrate`` writes it.
    """
    name = str(source) if not isinstance(source, Mapping) else "<calibration>"
    if isinstance(source, Mapping):
        data: Any = source
    else:
        try:
            data = yaml.safe_load(Path(source).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise PolicyError(f"cannot read the calibration file: {exc}", file=name) from None
    if not isinstance(data, Mapping) or data.get("version") != 1 or not isinstance(data.get("policies"), Mapping):
        raise PolicyError("a calibration file is a mapping with 'version: 1' and 'policies:'", file=name)
    overrides: dict[str, dict[str, float]] = {}
    for policy, entry in data["policies"].items():
        thresholds = entry.get("thresholds", {}) if isinstance(entry, Mapping) else None
        if not isinstance(thresholds, Mapping):
            raise PolicyError("must map threshold names to numbers", file=name, field=f"policies.{policy}.thresholds")
        for key, value in thresholds.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise PolicyError(
                    f"threshold {value!r} is not a probability",
                    file=name,
                    field=f"policies.{policy}.thresholds.{key}",
                    hint="write a number from 0 to 1",
                )
        overrides[str(policy)] = {str(k): float(v) for k, v in thresholds.items()}
    return overrides
