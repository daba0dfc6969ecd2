"""The kernels compile for Hopper and Blackwell on any machine; only the Blackwell build
carries the hardware e8m0 conversion, and both use the hardware e4m3 conversion."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def builds():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_targets.py")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_variant_compiles(builds):
    assert len(builds) == 2 * (2 * 2 + 2 + 2 + 1 + 7)


def test_per_group_kernels_move_whole_vectors(builds):
    """With 16-byte aligned rows the aligned-group path loads 16 bytes at a time."""
    per_group = [b for b in builds if b["kernel"].startswith("per_group")]
    assert per_group and all(b["v4_loads"] for b in per_group), per_group


def test_push_kernel_stores_whole_vectors(builds):
    """The push transport's encoder stores its e4m3 data 16 bytes at a time (its destination
    addresses come from a table, so only its alignment hint tells the compiler; without it
    the stores went out a byte at a time, 19x slower on an H200)."""
    push = [b for b in builds if b["kernel"] == "push"]
    assert push and all(b["v4_stores"] for b in push), push


def test_rowwise_register_cap(builds):
    """The rowwise per-group builds carry the launcher's register cap (ROWWISE_TILING)."""
    from mxfp8_a2a._config import ROWWISE_TILING

    rowwise = [b for b in builds if b["kernel"] == "per_group_rowwise"]
    assert rowwise and all(b["maxnreg"] == ROWWISE_TILING.maxnreg for b in rowwise), rowwise


def test_e8m0_instruction_only_on_blackwell(builds):
    for b in builds:
        if b["kernel"] in ("quantize", "roundtrip", "push"):
            want = b["cap"] >= 100 and b["variant"].endswith("rceil")
            assert b["ue8m0"] == want, b


def test_hardware_e4m3_conversion(builds):
    """Every kernel that writes e4m3 (all but the colwise amax pass) converts in hardware."""
    casts = [b for b in builds if not b["kernel"].endswith("_amax")]
    assert all(b["e4m3_cvt"] for b in casts), builds
