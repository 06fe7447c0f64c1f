"""Serving benchmark: batching under load against one request at a time, in one run on loopback.

    python benchmarks/serve.py            # a table
    python benchmarks/serve.py --json     # one JSON object

Two ``clef-guard serve`` processes on 127.0.0.1, one after the other, with the same engine:
``batched`` gathers concurrent requests for up to ``--batch-window-ms`` (at most
``--max-batch`` per engine batch); ``one-at-a-time`` answers them one by one (window 0,
batch 1). Against each, closed-loop HTTP clients at every ``--concurrency`` send
``--requests-per-client`` requests each: a distinct short state (``--state-words``) and
``--questions`` questions. Throughput is answered requests per second of wall time;
p50/p95 are client-side latencies; ``mean batch`` is what the server's metrics saw.
The goal is >= 3x throughput at 16 clients on a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

QUESTIONS: dict[str, Any] = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
    "team": {"type": "choice", "instructions": "Which team should handle it?",
             "criteria": {"billing": "Payments.", "technical": "Bugs.", "sales": "Plans."}},
    "anger": {"type": "score", "instructions": "How frustrated is the customer?", "criteria": ["calm", "annoyed", "furious"]},
    "urgent": {"type": "noul", "instructions": "Does the customer need an answer today?"},
}
VOCAB = ["invoice", "refund", "charged", "twice", "account", "login", "error", "outage", "plan", "upgrade", "card", "payment", "order", "late"]


def request_body(index: int, questions: int, words: int) -> dict[str, Any]:
    """A distinct short ticket (so no two requests share a cached state) and the first questions."""
    rng = random.Random(index)
    state = f"Ticket {index}: " + " ".join(rng.choice(VOCAB) for _ in range(words))
    return {"model": "jev-latest", "state": state, "questions": dict(list(QUESTIONS.items())[:questions])}


@contextlib.contextmanager
def server(window_ms: float, max_batch: int, engine_args: list[str]) -> Iterator[str]:
    """A ``clef-guard serve`` process on a free loopback port, stopped when the block ends."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "clef_guard.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--batch-window-ms", str(window_ms), "--max-batch", str(max_batch), *engine_args]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, process, log)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: Any) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"clef-guard serve exited with {process.returncode}:\n{log.read().decode(errors='replace')}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(f"clef-guard serve at {url} was not healthy within 300 s")


def batch_totals(url: str) -> tuple[float, float]:
    """(requests, batches) the server's engine has seen so far."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "clef_guard_engine_batch_size":
            values = {sample.name: sample.value for sample in family.samples}
            return values.get("clef_guard_engine_batch_size_sum", 0.0), values.get("clef_guard_engine_batch_size_count", 0.0)
    return 0.0, 0.0


async def load(url: str, concurrency: int, per_client: int, questions: int, words: int, offset: int) -> tuple[list[float], float]:
    """Closed-loop clients; returns every latency (s) and the wall time of the whole level."""
    latencies: list[float] = []

    async def client(http: httpx.AsyncClient, worker: int) -> None:
        for i in range(per_client):
            body = request_body(offset + worker * per_client + i, questions, words)
            started = time.perf_counter()
            response = await http.post(f"{url}/v1/systemone", json=body)
            latencies.append(time.perf_counter() - started)
            response.raise_for_status()

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http, worker) for worker in range(concurrency)))
        return latencies, time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every mode at every concurrency; one engine process per mode."""
    engine_args = [flag for name, value in (("--model", args.model), ("--adapter", args.adapter)) if value for flag in (name, value)]
    modes = {"batched": (args.batch_window_ms, args.max_batch), "one-at-a-time": (0.0, 1)}
    results = []
    for mode, (window_ms, max_batch) in modes.items():
        with server(window_ms, max_batch, engine_args) as url:
            asyncio.run(load(url, 2, 1, args.questions, args.state_words, offset=-10))  # warm-up
            for concurrency in args.concurrency:
                before = batch_totals(url)
                latencies, wall = asyncio.run(
                    load(url, concurrency, args.requests_per_client, args.questions, args.state_words, offset=concurrency * 1000)
                )
                after = batch_totals(url)
                results.append({
                    "mode": mode, "concurrency": concurrency, "requests": len(latencies),
                    "throughput_rps": len(latencies) / wall,
                    "p50_ms": percentile(latencies, 0.50) * 1000, "p95_ms": percentile(latencies, 0.95) * 1000,
                    "mean_batch": (after[0] - before[0]) / max(1.0, after[1] - before[1]),
                })
    rate = {(r["mode"], r["concurrency"]): r["throughput_rps"] for r in results}
    speedup = {str(c): rate[("batched", c)] / rate[("one-at-a-time", c)] for c in args.concurrency}
    return {"device": _device(), "settings": vars(args), "results": results, "batching_speedup": speedup}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 1])."""
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="client counts (default: 1 16)")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--questions", type=int, default=2, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--state-words", type=int, default=20)
    parser.add_argument("--batch-window-ms", type=float, default=5.0)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--model", default=None, help="engine backbone (default: the embedded model)")
    parser.add_argument("--adapter", default=None)
    args = parser.parse_args(argv)
    results = run(args)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    table = Table(title=f"clef-guard serve on {results['device']}, loopback")
    for column in ("mode", "clients", "requests", "req/s", "p50 ms", "p95 ms", "mean batch"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in results["results"]:
        table.add_row(r["mode"], str(r["concurrency"]), str(r["requests"]), f"{r['throughput_rps']:.2f}",
                      f"{r['p50_ms']:.0f}", f"{r['p95_ms']:.0f}", f"{r['mean_batch']:.1f}")
    console = Console()
    console.print(table)
    for clients, factor in results["batching_speedup"].items():
        console.print(f"batched over one-at-a-time at {clients} client(s): {factor:.2f}x throughput (goal >= 3x at 16 on a GPU)")


if __name__ == "__main__":
    sys.exit(main())
