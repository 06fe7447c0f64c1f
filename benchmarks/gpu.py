"""The engine on a GPU, beside the float32 CPU engine, in one run (``benchmarks/gpu.sh`` runs it there).

    python benchmarks/gpu.py --json

For each dtype (float16, bfloat16; float32 too with ``--float32``):

- gate_{n}q_{dtype}_p50_ms / _p95_ms: a cold gate (no prefix cache) with 1, 4 and 16
  questions on a 512-token state;
- batch_{dtype}_per_s: requests answered per second when 64 arrive together (``batch``:
  packed passes);
- {dtype}_max_delta_vs_cpu: the largest change of any probability against the float32
  engine on the CPU, over 12 states and 4 questions;
- {dtype}_max_delta_cached: the same between a cached and an uncached read of one state
  (each state extends the last, as an agent's does);
- {dtype}_non_finite: probabilities that are not finite numbers (the engine must raise
  rather than answer with one, so anything but 0 is a bug);
- agent_{mode}_*: ``benchmarks/engine.py``'s agent loop (12 turns, the shipped destructive and
  outbound policies) on the device in its default dtype: per-gate p50/p95 after the first turn
  and tokens computed per gate, cache off against on against read-ahead.

On a machine without CUDA it measures the CPU instead and says so (``device``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from langchain_core.decisions import Noul
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from engine import (  # noqa: E402
    QUESTIONS,
    agent_loop_figures,
    conversation,
    max_delta,
    p50_p95_ms,
    probabilities,
    state_of_tokens,
    timed,
)

from clef_guard import LocalDecisionModel  # noqa: E402

SIXTEEN = {
    **QUESTIONS,
    **{f"{qid}_again": Noul(instructions=f"Answer carefully: {q.instructions}") for qid, q in QUESTIONS.items() if q.type == "noul"},
    "undo": Noul(instructions="Would anyone need a backup to undo the proposed call?"),
    "urgent": Noul(instructions="Does the user say the task is urgent?"),
    "money": Noul(instructions="Does the proposed call move money?"),
    "secret": Noul(instructions="Does the proposed call read a password, key or token?"),
}


def figures(dtypes: list[str], repeats: int) -> dict[str, Any]:
    """Every figure the module docstring lists, for ``dtypes``."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (no CUDA here)"}
    four = dict(list(QUESTIONS.items())[:4])
    cpu = LocalDecisionModel(device="cpu", dtype="float32", prefix_cache_size=0)
    states = [conversation(turn) for turn in range(1, 13)]
    expected = [probabilities(cpu.invoke({"state": s, "questions": four})) for s in states]
    state512 = state_of_tokens(cpu, 512)
    del cpu
    for dtype in dtypes:
        cold = LocalDecisionModel(device=device, dtype=dtype, prefix_cache_size=0)
        warm = LocalDecisionModel(device=device, dtype=dtype)
        for n, questions in ((1, dict(list(QUESTIONS.items())[:1])), (4, four), (16, SIXTEEN)):
            times = timed(lambda q=questions: cold.invoke({"state": state512, "questions": q}), repeats)
            results[f"gate_{n}q_{dtype}_p50_ms"], results[f"gate_{n}q_{dtype}_p95_ms"] = p50_p95_ms(times)
        requests = [{"state": states[i % len(states)], "questions": four} for i in range(64)]
        times = timed(lambda: cold.batch(requests), max(3, repeats // 5))
        results[f"batch_{dtype}_per_s"] = len(requests) / statistics.median(times)
        fresh = [probabilities(cold.invoke({"state": s, "questions": four})) for s in states]
        served = [probabilities(warm.invoke({"state": s, "questions": four})) for s in states]
        results[f"{dtype}_max_delta_vs_cpu"] = max(max_delta(a, b) for a, b in zip(expected, fresh, strict=True))
        results[f"{dtype}_max_delta_cached"] = max(max_delta(a, b) for a, b in zip(fresh, served, strict=True))
        results[f"{dtype}_non_finite"] = sum(not math.isfinite(p) for answers in fresh + served for p in answers.values())
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per gate figure")
    parser.add_argument("--float32", action="store_true", help="measure float32 on the device too")
    args = parser.parse_args(argv)
    dtypes = ["float16", "bfloat16", *(["float32"] if args.float32 else [])]
    if not torch.cuda.is_available():
        dtypes = ["bfloat16", "float32"]  # a CPU has no fast float16
    results = figures(dtypes, args.repeats) | agent_loop_figures(max(1, args.repeats // 7))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    table = Table(title=f"clef-guard engine on {results['device']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in results.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
