"""A token exchange with MXFP8 on the wire, and an expert-parallel MoE layer on it.

    torchrun --nproc-per-node=2 examples/exchange.py          # GPUs (NCCL) or CPU (gloo)

Each rank sends a few rows to every rank, checks that what arrives is what was sent
(up to MXFP8 rounding), runs the backward, then runs one ExpertParallelMoE layer.
"""

import os

import torch
import torch.distributed as dist

import mxfp8_a2a as mx


def main() -> None:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    # rows grouped by destination: rank r sends r + d + 1 rows to rank d
    input_splits = [rank + d + 1 for d in range(world)]
    output_splits = mx.compute_output_splits(input_splits)  # one tiny all-to-all
    x = torch.randn(sum(input_splits), 256, device=device, dtype=torch.bfloat16)
    x.requires_grad_(True)
    y = mx.to_mxfp8_a2a_dequant(x, output_splits, input_splits)  # [sum(output_splits), 256]
    y.float().square().sum().backward()  # the gradient goes back as MXFP8 too

    # send the rows back: each returns as quantize -> dequantize of itself, bit for bit
    # (MXFP8 values survive a second trip unchanged)
    back = mx.to_mxfp8_a2a_dequant(y.detach(), input_splits, output_splits)
    assert torch.equal(back, mx.quantize_dequantize(x.detach()))

    layer = mx.ExpertParallelMoE(hidden=256, ffn=512, num_experts=4 * world, top_k=2, seed=0)
    layer = layer.to(device)  # (seed: the same router on every rank)
    tokens = torch.randn(64, 256, device=device, requires_grad=True)
    layer(tokens).sum().backward()
    if rank == 0:
        print(
            f"ok: {world} ranks on {device.type}; exchange {tuple(y.shape)}, MoE grads finite:",
            bool(tokens.grad.isfinite().all()),
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
