"""How fast ``treetrain train`` validates a data file before its first step (MB/s of JSONL).

The bundled sample (paths format, ~130 kB per line of Qwen token ids) is repeated into a ~25 MB
JSONL; ``guards.validate_data`` (every record parsed, checked and built into a tree) is timed
against ``json.loads`` alone on the same lines, interleaved, best of ``--repeats``.

    python benchmarks/validate_speed.py --note "contended"
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import tempfile
import time
from pathlib import Path

from soak import cpu_name

from treetrain.data import reader as data
from treetrain.train.guards import validate_data

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=25.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    raw = gzip.decompress(Path(data.sample_path("agent-dialogues")).read_bytes())
    path = Path(tempfile.mkdtemp()) / "big.jsonl"
    path.write_bytes(raw * max(1, int(args.mb * 1e6 // len(raw))))
    size = path.stat().st_size / 1e6
    lines = path.read_bytes().splitlines()
    opts = {"format": None, "vocab_size": 151936, "capacity": 8192, "skip_oversized": False}
    opts["tokenizer"] = None
    best_json, best_val = float("inf"), float("inf")
    for _ in range(args.repeats):
        t = time.perf_counter()
        for line in lines:
            json.loads(line)
        best_json = min(best_json, time.perf_counter() - t)
        t = time.perf_counter()
        validate_data(path, opts, progress=False)
        best_val = min(best_val, time.perf_counter() - t)
    text = (
        f"# Data validation speed ({dt.date.today()}, {cpu_name()}, {os.cpu_count()} cores; {args.note})\n\n"
        f"- file: the bundled sample repeated, {size:.1f} MB, {len(lines)} lines\n"
        f"- `json.loads` alone: {size / best_json:.1f} MB/s\n"
        f"- `validate_data` (parse, check, build every tree): {size / best_val:.1f} MB/s\n"
    )
    cpu = "".join(c if c.isalnum() else "-" for c in cpu_name().lower())
    out = ROOT / "benchmarks" / "results" / f"validate_speed_{cpu}-{os.cpu_count()}core_{dt.date.today()}.md"
    out.write_text(text)
    print(text + f"written: {out}")


if __name__ == "__main__":
    main()
