"""ExpertParallelMoE construction: memory for the local experts only, device and dtype, the
same experts at every group size, the data-parallel helpers' checks (one process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import mxfp8_a2a as mx
from mxfp8_a2a.moe.layer import init_moe_weights

# One rank of 64 building 256 experts of 7168 -> 2048 in bf16: its 4 experts are 235 MB;
# the whole layer in fp32 would be 30 GB. A process group of the "fake" backend (torch's
# testing store) stands in for the 64 ranks.
BIG = textwrap.dedent(
    """
    import resource, torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import mxfp8_a2a as mx
    dist.init_process_group("fake", rank=5, world_size=64, store=FakeStore())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    layer = mx.ExpertParallelMoE(7168, 2048, 256, 8, dtype=torch.bfloat16)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(layer.experts.first, tuple(layer.w1.shape), layer.w1.dtype, grown * 1024)
    """
)


def test_builds_only_the_local_experts():
    env_out = subprocess.run([sys.executable, "-c", BIG], capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert env_out.returncode == 0, env_out.stderr[-3000:]
    first, rest = env_out.stdout.split(" ", 1)
    grown = rest.rsplit(" ", 1)[1]
    assert first == "20", env_out.stdout  # rank 5 of 64: experts 20..23
    assert "(4, 7168, 2048) torch.bfloat16" in rest, env_out.stdout
    local = 2 * 4 * 7168 * 2048 * 2  # w1 and w2 of 4 experts, bf16
    assert int(grown) < local + 2**29, f"peak memory grew {int(grown) / 2**20:.0f} MiB"


def test_experts_are_the_same_at_every_group_size(group_of_one):
    full = init_moe_weights(32, 16, 8, seed=4)
    layer = mx.ExpertParallelMoE(32, 16, 8, 2, seed=4, dtype=torch.float64)
    assert layer.w1.dtype == torch.float64 and layer.router.dtype == torch.float64
    for key, value in (("router", layer.router), ("w1", layer.w1), ("w2", layer.w2)):
        torch.testing.assert_close(value.float(), full[key], rtol=0, atol=0)
    # expert e does not depend on how many experts there are (its own generator)
    more = init_moe_weights(32, 16, 16, seed=4)
    torch.testing.assert_close(more["w1"][:8], full["w1"], rtol=0, atol=0)
    meta = mx.ExpertParallelMoE(32, 16, 8, 2, device="meta")
    assert meta.w1.is_meta and meta.router.is_meta and meta.dispatch_stats.is_meta


def test_layer_arguments(group_of_one):
    with pytest.raises(ValueError, match="hidden must be an int >= 1"):
        mx.ExpertParallelMoE(0, 16, 8, 2)
    with pytest.raises(ValueError, match="num_experts must be an int >= 1"):
        mx.ExpertParallelMoE(32, 16, 8.0, 2)
    with pytest.raises(ValueError, match="seed must be in"):
        mx.ExpertParallelMoE(32, 16, 8, 2, seed=-1)
    layer = mx.ExpertParallelMoE(32, 16, 8, 2)
    with pytest.raises(ValueError, match="precision must be one of"):
        layer.precision = "fp4"
    x = torch.randn(2, 3, 32)
    assert layer(x).shape == (2, 3, 32)


def test_data_parallel_helpers_refuse_what_they_cannot_do(group_of_one):
    plain = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="no ExpertParallelMoE layer"):
        mx.prepare_ddp(plain)
    model = torch.nn.Sequential(mx.ExpertParallelMoE(32, 16, 8, 2), torch.nn.Linear(32, 32))
    mx.prepare_ddp(model)
    assert "0.experts.w1" in model._ddp_params_and_buffers_to_ignore
    assert "0.dispatch_stats" in model._ddp_params_and_buffers_to_ignore
    with pytest.raises(RuntimeError, match="already prepared"):
        mx.prepare_ddp(model)
    with pytest.raises(ValueError, match="1-D DeviceMesh"):
        mx.shard_experts(mx.ExpertParallelMoE(32, 16, 8, 2), None)
    layer = mx.ExpertParallelMoE(32, 16, 8, 2)
    state = mx.full_state_dict(layer)
    state["experts.w1"] = state["experts.w1"][:4]
    with pytest.raises(ValueError, match=r"state\['experts.w1'\]: expected shape \(8, 32, 16\)"):
        mx.load_full_state_dict(layer, state)


def test_prepare_ddp_without_the_exclusion_api(group_of_one, monkeypatch):
    """Without DDP's exclusion switch, prepare_ddp says to use FSDP2 instead."""
    from torch.nn.parallel import DistributedDataParallel

    monkeypatch.delattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model")
    with pytest.raises(RuntimeError, match="use FSDP2 instead"):
        mx.prepare_ddp(mx.ExpertParallelMoE(32, 16, 8, 2))
