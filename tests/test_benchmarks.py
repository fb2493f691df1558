"""`python -m benchmarks --quick --smoke`: every benchmark once at its smallest sizes.

Nothing is timed here; the run checks that no benchmark has rotted (a patched name the code no
longer has, a changed signature): each must finish and produce its rows. Its results go to a
temporary file, never to benchmarks/results.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import BENCHMARKS

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results.md"

# The rows each benchmark reports, by their number in the table (1. rollout ... 8. plan).
ROWS = {
    "rollout": ["1.", "1b.", "1c.", "1d."],
    "update": ["2.", "2b."],
    "memory": ["3.", "3b."],
    "loop": ["4."],
    "arrow": ["5a.", "5b.", "5c."],
    "ocr": ["6."],
    "algorithms": ["7.", "7b."],
    "plan": ["8a.", "8b."],
}


@pytest.mark.slow
def test_every_benchmark_runs_once_at_its_smallest_sizes(tmp_path):
    assert set(ROWS) == set(BENCHMARKS)
    before = RESULTS.read_bytes() if RESULTS.exists() else None
    out = tmp_path / "results.md"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--smoke", "--out", str(out),
         "--workdir", str(tmp_path / "work")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert "FAILED" not in done.stderr
    table = out.read_text()
    first_cells = re.findall(r"^\| (\S+) ", table, flags=re.MULTILINE)
    for name, rows in ROWS.items():
        for row in rows:
            assert row in first_cells, f"benchmark {name}: no row {row}\n{table}"
    assert (RESULTS.read_bytes() if RESULTS.exists() else None) == before
