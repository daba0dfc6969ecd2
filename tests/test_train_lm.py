"""examples/train_lm.py (the byte-level MoE language model) and scripts/plot_curves.py, on
CPU: the corpus split, a toy run in one process (the loss falls, the JSON, the last line,
the same curve again for the same seed), a 2-rank torchrun run with the MXFP8 exchange, and
the plot/table of two runs. The runs take the plain-torch MXFP8 casts (no Triton
interpreter: it would make them slow)."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mxfp8_a2a as mx

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "examples" / "train_lm.py"
PLOT = ROOT / "scripts" / "plot_curves.py"
PINNED_HELD_OUT = 43  # of x/0.py .. x/999.py: the split rule as first written
TOY = ("--size", "toy", "--steps", "24", "--eval-every", "8", "--log-every", "8")
# clipped at every step: the replicas stay alike only if every rank clips by the same factor
TWO_RANKS = (*TOY[:4], "--eval-every", "3", "--exchange", "mxfp8", "--clip", "0.05")
BF16 = (*TOY, "--exchange", "bf16")


@functools.cache
def train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


@functools.cache
def _run(json_path: str, *args: str, ranks: int = 1) -> tuple[list[str], dict, str]:
    """(stdout lines, the JSON record, stderr) of one run; ranks > 1: under torchrun."""
    cmd = [sys.executable, str(SCRIPT)]
    if ranks > 1:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd = [*torchrun, f"--nproc-per-node={ranks}", str(SCRIPT)]
    proc = subprocess.run([*cmd, *args, "--json", json_path], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    with open(json_path) as f:
        return lines, json.load(f), proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[str], dict, str]]:
    tmp = tmp_path_factory.mktemp("train_lm")
    return {
        "bf16": _run(str(tmp / "bf16.json"), *BF16),
        "again": _run(str(tmp / "again.json"), *BF16),
        "mxfp8_2": _run(str(tmp / "mxfp8_2.json"), *TWO_RANKS, ranks=2),
        "dir": tmp,
    }


def test_split_is_deterministic_and_disjoint(tmp_path):
    m = train_lm()
    files = m.list_files(m.corpus_roots())
    held = [rel for rel, _ in files if m.is_held_out(rel)]
    assert 0.02 < len(held) / len(files) < 0.10, (len(held), len(files))
    assert held == [rel for rel, _ in files if m.is_held_out(rel)]
    assert not any(rel.startswith("stdlib/site-packages/") for rel, _ in files)
    assert {rel.split("/")[0] for rel, _ in files} == {"stdlib", "torch"}
    # the rule itself, pinned: a change would make runs incomparable with earlier ones
    assert sum(m.is_held_out(f"x/{i}.py") for i in range(1000)) == PINNED_HELD_OUT

    for i in range(60):  # a small corpus: every file in one split, the digest follows content
        (tmp_path / f"f{i}.py").write_bytes(f"print({i})\n".encode())
    (tmp_path / "notes.txt").write_text("not python")
    one = m.load_corpus({"t": str(tmp_path)})
    assert one["info"] == m.load_corpus({"t": str(tmp_path)})["info"]
    names = [f"t/f{i}.py" for i in range(60)]
    expect_held = sum(len(f"print({i})\n") for i, n in enumerate(names) if m.is_held_out(n))
    assert one["info"]["held_out_bytes"] == expect_held
    assert one["info"]["train_bytes"] + expect_held == sum(len(f"print({i})\n") for i in range(60))
    assert one["info"]["train_files"] + one["info"]["held_out_files"] == 60
    (tmp_path / "f0.py").write_bytes(b"print(-0)\n")
    assert m.load_corpus({"t": str(tmp_path)})["info"]["sha256"] != one["info"]["sha256"]


def test_toy_run_learns_and_writes_json(runs):
    lines, record, log = runs["bf16"]
    assert lines[-1].startswith("final held-out bits/byte: "), lines[-5:]
    assert lines[0].startswith("corpus: ") and lines[1].startswith("parameters: ")
    final = float(lines[-1].split(": ")[1])
    assert record["final_bits_per_byte"] == pytest.approx(final, abs=1e-4)
    assert record["eval"]["step"] == [0, 8, 16, 24]
    bpb, loss = record["eval"]["bits_per_byte"], record["train_loss"]
    assert len(loss) == 24 and bpb[0] > 7.5 and bpb[-1] < bpb[0] - 2, bpb
    assert sum(loss[-4:]) < sum(loss[:4]) - 4 * 1.0, loss
    assert record["corpus"]["sha256"] and record["tokens_per_s"] > 0
    assert record["config"]["world"] == 1 and record["dropped_rows"] >= 0
    assert record["config"]["exchange"] == "bf16"
    # the progress bar's (or plain lines') last held-out figure is the final one
    shown = re.findall(r"held-out (\d+\.\d+) bits/byte", log + "\n".join(lines[:-1]))
    assert shown and shown[-1] == f"{final:.4f}", shown[-3:]
    again = runs["again"][1]
    assert again["train_loss"] == loss and again["eval"] == record["eval"]  # one seed, one run


def test_two_ranks_mxfp8_exchange(runs):
    lines, record, _ = runs["mxfp8_2"]
    assert lines[-1].startswith("final held-out bits/byte: "), lines[-5:]
    assert record["config"]["world"] == 2 and record["config"]["exchange"] == "mxfp8"
    assert record["eval"]["step"] == [0, 3, 6, 9, 12, 15, 18, 21, 24]
    bpb = record["eval"]["bits_per_byte"]
    # the same held-out windows whatever the world size: the untrained model scores alike (up
    # to the MXFP8 exchange's rounding, 0.1% here)
    assert bpb[0] == pytest.approx(runs["bf16"][1]["eval"]["bits_per_byte"][0], rel=5e-3)
    assert bpb[-1] < bpb[0] - 2, bpb


def test_plot_curves_table(runs):
    paths = [str(runs["dir"] / "bf16.json"), str(runs["dir"] / "mxfp8_2.json")]
    proc = subprocess.run([sys.executable, str(PLOT), *paths, "--no-plot"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode != 0 and "differ in world size" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, str(PLOT), *paths, "--no-plot", "--compare-anyway"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[1:]}
    bf16, mxfp8 = runs["bf16"][1]["final_bits_per_byte"], runs["mxfp8_2"][1]["final_bits_per_byte"]
    assert rows["bf16/bf16/0"][2] == "+0.00%"
    assert rows["mxfp8/bf16/0"][2] == f"{100 * (mxfp8 / bf16 - 1):+.2f}%"
    assert rows["mxfp8/bf16"][1:] == ["mean", f"{100 * (mxfp8 / bf16 - 1):+.2f}%", "(1", "seeds)"]


def test_plot_curves_png(runs):
    pytest.importorskip("matplotlib")
    out = runs["dir"] / "curves.png"
    paths = [str(runs["dir"] / "bf16.json"), str(runs["dir"] / "mxfp8_2.json")]
    args = [*paths, "--out", str(out), "--compare-anyway"]
    proc = subprocess.run([sys.executable, str(PLOT), *args], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "0"], "--batch must be >= 1"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--d-model", "60"], "--d-model (60) must be a multiple of 2 * --heads (4)"),
        (["--precision", "fp8_rowwise_gw_hp", "--dtype", "float32"], "--dtype bfloat16"),
    ],
)
def test_bad_arguments_named(args, message, capsys):
    with pytest.raises(SystemExit):
        train_lm().parse_args(args)
    assert message in capsys.readouterr().err


def test_exchange_defaults_to_the_layers_default():
    layer_default = inspect.signature(mx.ExpertParallelMoE).parameters["exchange"].default
    assert train_lm().parse_args([]).exchange == layer_default == "mxfp8"


def test_gpu_size():
    """The H200 configuration: 50-150M parameters, >= 32 experts, top-4..8, >= 32k tokens."""
    a = train_lm().parse_args(["--size", "gpu"])
    assert a.experts >= 32 and 4 <= a.top_k <= 8 and a.seq_len in (512, 1024)
    assert a.batch * a.seq_len >= 32768
    expert = 2 * a.d_model * a.ffn * a.layers
    dense = a.layers * 4 * a.d_model**2 + 2 * 256 * a.d_model  # attention, embedding, head
    assert 50e6 <= dense + expert * a.experts <= 150e6


def test_torchtitan_log_to_curves(tmp_path):
    """scripts/torchtitan_log.py reads the trainer's coloured metric lines into the record
    plot_curves.py compares (gaps to torchtitan's own dispatcher with --baseline)."""
    lines = "\x1b[31mstep: {s:2}  \x1b[32mloss: {l:8.5f}  grad_norm: 1.0  tps: {t:,}  mfu: 1%\n"
    for wire, shift in (("torchtitan", 0.0), ("mxfp8", 0.05)):
        log = tmp_path / f"{wire}.txt"
        log.write_text("".join(lines.format(s=s, l=8 - s / 10 + shift, t=1000 + s)
                               for s in range(1, 21)))  # fmt: skip
        subprocess.run([sys.executable, str(ROOT / "scripts" / "torchtitan_log.py"), str(log),
                        "--wire", wire, "--seed", "0", "--ep", "2", "--json",
                        str(tmp_path / f"{wire}.json")], check=True, env=_env())  # fmt: skip
    rec = json.loads((tmp_path / "mxfp8.json").read_text())
    assert rec["eval"]["step"] == list(range(1, 21)) and rec["tokens_per_s_per_gpu"] == 1013
    assert abs(rec["final_bits_per_byte"] - (8 - 1.55 + 0.05)) < 1e-9
    out = subprocess.run([sys.executable, str(PLOT), *map(str, tmp_path.glob("*.json")),
                          "--baseline", "bf16/torchtitan", "--no-plot"],
                         capture_output=True, text=True, check=True, env=_env())  # fmt: skip
    assert "mxfp8/bf16/0" in out.stdout and "+0.78%" in out.stdout, out.stdout
