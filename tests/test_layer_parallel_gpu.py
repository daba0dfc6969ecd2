"""ExpertParallelMoE trained on one GPU over NCCL: unwrapped, under DDP (prepare_ddp) and
under FSDP2 (shard_experts), with the synced and the static dispatch, each exchange: the
wrapped runs give the unwrapped run's loss curve and weights (a group of one rank: the
same sums, so the same bits apart from the wrappers' own arithmetic)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from parallel_workers import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIGS = [(wrap, 1, exchange, static) for exchange in ("bf16", "mxfp8") for static in
           (False, True) for wrap in ("none", "ddp", "fsdp2")]  # fmt: skip


def test_wrapped_layer_trains_like_the_unwrapped_one_on_a_gpu():
    runs = run_distributed(train, 1, CONFIGS, None, "cuda", backend="nccl", timeout=600)[0]
    for i, (wrap, _, exchange, static) in enumerate(CONFIGS):
        ref = runs[CONFIGS.index(("none", 1, exchange, static))]
        what = f"{wrap}, {exchange}, static={static}"
        got = runs[i]
        print(what, "final loss", got["loss"][-1], "max |loss - unwrapped|",
              max(abs(a - b) for a, b in zip(got["loss"], ref["loss"], strict=True)))  # fmt: skip
        torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]),
                                   rtol=1e-5, atol=1e-6, msg=what)  # fmt: skip
        for key, value in got["layers"][0].items():
            torch.testing.assert_close(torch.as_tensor(value),
                                       torch.as_tensor(ref["layers"][0][key]),
                                       rtol=1e-5, atol=1e-6, msg=what)  # fmt: skip
