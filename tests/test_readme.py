"""Every Python block of README.md runs as written, each in a fresh process, as a user who
pastes it would run it (no TRITON_INTERPRET: CPU tensors take the plain-torch paths); the
quick start also under torchrun with 2 processes (gloo), as README says it runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 1  # the quick start: exchange, layer with DDP and a DCP checkpoint


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", BLOCKS[index]], cwd=tmp_path, env=ENV, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"README block {index}:\n{BLOCKS[index]}\n{result.stderr}"


def test_quick_start_runs_under_torchrun(tmp_path):
    (tmp_path / "quick.py").write_text(BLOCKS[0])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    result = subprocess.run(
        [*torchrun, "--nproc-per-node=2", "quick.py"], cwd=tmp_path, env=ENV,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("'dropped': 0") == 2, result.stdout  # both ranks ran the layer


def test_readme_commands_are_what_ci_runs():
    """The install and quick check of README's shell block, and its full-suite command, are
    lines of .ci/run (so CI runs what a user is told to run)."""
    ci = (README.parent / ".ci" / "run").read_text()
    shell = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    commands = [line.split("#")[0].strip() for block in shell for line in block.splitlines()]
    commands = [c.replace("pip install", "python -m pip install -q") for c in commands if c]
    assert commands and all(c in ci for c in commands), commands
    suite = "python -m pytest -q tests"
    assert f"`{suite}`" in README.read_text() and f"\n{suite}\n" in ci
