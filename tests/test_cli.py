"""The command-line tools a user reads (benchmarks/*.py, examples/*.py): every option says what
it is in --help, every --help runs, and bench_nodes labels what it models apart from what it
measures."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p for folder in ("benchmarks", "examples") for p in (ROOT / folder).glob("*.py")
    if "ArgumentParser(" in p.read_text()
)  # fmt: skip
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
    "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
}


def _options_without_help(path: Path) -> list[str]:
    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"
                and not any(k.arg == "help" for k in node.keywords)):  # fmt: skip
            missing.append(ast.unparse(node.args[0]) if node.args else "?")
    return missing


def test_every_script_with_options_is_found():
    names = {p.name for p in SCRIPTS}
    assert {"bench_a2a.py", "bench_nodes.py", "train_lm.py", "train_moe.py"} <= names, names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_option_has_help_text(path):
    assert _options_without_help(path) == []


HELP_ALL = """
import contextlib, io, runpy, sys
for path in sys.argv[1:]:
    sys.path.insert(0, path.rsplit("/", 1)[0])  # (benchmarks/common.py)
    sys.argv, out = [path, "--help"], io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            assert e.code in (0, None), (path, e.code)
    assert "usage:" in out.getvalue(), path
    print("ok", path)
"""


def test_every_help_runs():
    """--help of every script, after its imports (none fails to import): one process, so torch
    is imported once."""
    paths = [str(p) for p in SCRIPTS]
    result = subprocess.run([sys.executable, "-c", HELP_ALL, *paths], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ok ") == len(paths), result.stdout


def test_bench_nodes_labels_modelled_times_and_repeats_no_row(tmp_path):
    out = tmp_path / "nodes.json"
    args = ["--tokens", "64", "--nodes", "2", "4", "8", "--max-nodes", "4", "--json", str(out)]
    script = ROOT / "benchmarks" / "bench_nodes.py"
    result = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[0].split()
    assert [h for h in header if "ms" in h] == [
        "bf16_ms_modelled", "mxfp8_to_experts_ms_modelled", "mxfp8_ms_modelled"
    ], header  # fmt: skip
    assert "assumed" in result.stdout and "(not measured)" in result.stdout
    rows = json.loads(out.read_text())["model"]
    keys = [(r["nodes"], r["max_nodes"], r["route"]) for r in rows]
    assert len(keys) == len(set(keys)), keys  # M = 4 limits nothing at 2 and 4 nodes
    assert keys == [(2, "-", "flat"), (2, "-", "node"), (4, "-", "flat"), (4, "-", "node"),
                    (8, "-", "flat"), (8, "-", "node"), (8, 4, "flat"), (8, 4, "node")]  # fmt: skip
