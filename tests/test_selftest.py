"""The quick check README offers after install, ``python -m mxfp8_a2a.selftest``: it passes,
says what it checked, and stays well under its 2-minute promise on 2 CPU cores."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def test_selftest_passes_and_names_each_check(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs it
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "mxfp8_a2a.selftest"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("ok")] == [
        "ok  cast", "ok  exchange", "ok  layer"
    ], lines  # fmt: skip
    assert lines[-1].startswith("all passed"), lines
    assert elapsed < 120, f"{elapsed:.0f} s"
