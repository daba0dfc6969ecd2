"""examples/train_moe.py on CPU/gloo: 2 ranks, 60 steps, under a minute; the MXFP8 run's
final loss within 2% of the plain-exchange run's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "examples" / "train_moe.py"


def _final_loss(exchange: str) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    start = time.perf_counter()
    proc = subprocess.run(
        [*cmd, str(SCRIPT), "--steps", "60", "--exchange", exchange],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("final loss: "), proc.stdout[-2000:]
    return float(last.removeprefix("final loss: ")), elapsed


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU/gloo run; GPU runs are in BENCHMARKS.md"
)
def test_mxfp8_training_tracks_bf16():
    bf16, t_bf16 = _final_loss("bf16")
    mxfp8, t_mxfp8 = _final_loss("mxfp8")
    assert abs(mxfp8 - bf16) <= 0.02 * bf16, (bf16, mxfp8)
    assert max(t_bf16, t_mxfp8) < 60, (t_bf16, t_mxfp8)
