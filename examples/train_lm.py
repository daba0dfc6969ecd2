"""Train a byte-level MoE language model on Python source, to compare the exchanges' precision.

A decoder-only transformer (byte embedding; blocks of pre-norm causal self-attention with
rotary positions and a pre-norm mxfp8_a2a.ExpertParallelMoE on the static dispatch; final norm,
output head) learns the .py files of the Python standard library and the installed torch
(tens of MB on any machine with torch), split into training and held-out files by a hash of
the path (about 5% held out). Batches: random windows of seq_len + 1 bytes, seeded by --seed
and the rank. Held-out bits/byte every --eval-every steps on fixed windows (the same in every
run). AdamW (decay on matrices), warm-up and cosine decay, clipping by the whole model's
gradient norm, a load-balancing loss (--aux-loss); bf16 activations on CUDA, fp32 on CPU.

    python examples/train_lm.py --size toy                      # CPU, seconds a step
    torchrun --nproc-per-node=2 examples/train_lm.py --size toy --exchange mxfp8

The measurement on one H200 (4 configurations x 3 seeds), then the plot and the table:

    mkdir -p runs; for seed in 0 1 2; do
      for cfg in "bf16 bf16" "mxfp8_to_experts bf16" "mxfp8 bf16" \\
                 "mxfp8_to_experts fp8_rowwise_gw_hp"; do
        set -- $cfg
        python examples/train_lm.py --size gpu --compile --seed $seed --exchange $1 \\
            --precision $2 --json runs/lm_$1_$2_$seed.json
      done
    done
    python scripts/plot_curves.py runs/lm_*.json --out runs/lm_curves.png

It prints the corpus (files, bytes, train/held-out split, a sha256 digest: runs are comparable
when it matches), the parameter count (total / active per token), a progress bar (step, train
loss, last held-out bits/byte, tokens/s; plain lines without tqdm), the rows the static
dispatch dropped, and last ``final held-out bits/byte: <value>``. --json writes the config,
the corpus, the curves (train loss per step, held-out bits/byte per eval), tokens/s and the
final held-out bits/byte. Runs under torchrun at any world size (experts spread over all
ranks, data parallelism through mx.prepare_ddp and DistributedDataParallel; NCCL on GPUs,
gloo on CPU) or as one plain process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import socket
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mxfp8_a2a as mx

SIZES = {  # every field can be overridden by its flag
    "toy": dict(d_model=64, layers=2, heads=4, experts=8, ffn=128, top_k=2, seq_len=64,
                batch=8, steps=40, lr=3e-3, warmup=5, eval_every=20, eval_windows=32),
    "gpu": dict(d_model=512, layers=8, heads=8, experts=32, ffn=384, top_k=4, seq_len=512,
                batch=64, steps=2000, lr=1e-3, warmup=100, eval_every=100, eval_windows=512),
}  # fmt: skip
HELD_OUT_PER_MILLE = 50  # files whose path hash falls below this (of 1000) are held out
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
EVAL_SEED = 0x5EED  # the held-out windows: the same in every run, whatever --seed


class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's lines and shows each option's default."""


def corpus_roots() -> dict[str, str]:
    """{name: directory}: the standard library's and the installed torch package's sources."""
    return {"stdlib": sysconfig.get_paths()["stdlib"], "torch": os.path.dirname(torch.__file__)}


def list_files(roots: dict[str, str]) -> list[tuple[str, str]]:
    """Sorted [(name/relative/path.py, absolute path)] of the .py files under ``roots``
    (site-packages, dist-packages and __pycache__ skipped)."""
    found = []
    for name, root in roots.items():
        for here, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(here, f)
                    rel = os.path.relpath(path, root).replace(os.sep, "/")
                    found.append((f"{name}/{rel}", path))
    return sorted(found)


def is_held_out(rel: str) -> bool:
    """A file's split, from blake2b of its relative path alone (the same on every machine)."""
    h = int.from_bytes(hashlib.blake2b(rel.encode(), digest_size=8).digest(), "little")
    return h % 1000 < HELD_OUT_PER_MILLE


def load_corpus(roots: dict[str, str] | None = None) -> dict:
    """{"train", "held_out": uint8 [bytes] tensors (the files concatenated in path order),
    "info": counts and "sha256" (over the sorted relative paths and contents)}."""
    digest, parts, files = hashlib.sha256(), {True: [], False: []}, {True: 0, False: 0}
    for rel, path in list_files(roots or corpus_roots()):
        with open(path, "rb") as f:
            data = f.read()
        digest.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        parts[is_held_out(rel)].append(data)
        files[is_held_out(rel)] += 1
    joined = {k: bytearray(b"".join(v)) for k, v in parts.items()}
    split = {k: torch.frombuffer(v, dtype=torch.uint8) for k, v in joined.items()}
    info = {"train_files": files[False], "train_bytes": split[False].numel(),
            "held_out_files": files[True], "held_out_bytes": split[True].numel(),
            "sha256": digest.hexdigest()}  # fmt: skip
    return {"train": split[False], "held_out": split[True], "info": info}


def windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """int64 [len(starts), seq_len + 1]: the bytes from each start."""
    return data[starts[:, None] + torch.arange(seq_len + 1)].long()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions: x [B, heads, S, head_dim], cos/sin [S, head_dim / 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Block(torch.nn.Module):
    """Pre-norm causal self-attention, then a pre-norm MoE layer; both residual."""

    def __init__(self, a, world: int, seed: int, moe_dtype: torch.dtype):
        super().__init__()
        d, self.heads, self.moe_dtype = a.d_model, a.heads, moe_dtype
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d, bias=False)
        torch.nn.init.normal_(self.proj.weight, std=0.02 / math.sqrt(2 * a.layers))
        # the static dispatch: every rank passes at most batch * seq_len tokens per call
        static = {"max_tokens": a.batch * a.seq_len, "capacity_factor": a.capacity_factor}
        self.moe = mx.ExpertParallelMoE(d, a.ffn, a.experts, a.top_k, exchange=a.exchange,
                                        precision=a.precision, seed=seed, **static)  # fmt: skip

    def forward(self, x, cos, sin):
        B, S, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, -1).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v,
                                           is_causal=True)  # fmt: skip
        x = x + self.proj(y.transpose(1, 2).reshape(B, S, d))
        h = self.norm2(x).to(self.moe_dtype).reshape(B * S, d)  # (autocast: fp32)
        with torch.autocast(x.device.type, enabled=False):  # the layer takes h's dtype
            y = self.moe(h)
            aux = self.moe.balance_loss()
        return x + y.view(B, S, d), aux


class ByteLM(torch.nn.Module):
    """tokens int64 [B, S] -> (logits [B, S, 256], the blocks' balance loss, fp32 scalar)."""

    def __init__(self, a, world: int, moe_dtype: torch.dtype):
        super().__init__()
        seeds = torch.randint(
            0, 2**31 - 1, (a.layers,), generator=torch.Generator().manual_seed(a.seed)
        )
        self.embed = torch.nn.Embedding(256, a.d_model)
        self.blocks = torch.nn.ModuleList(Block(a, world, int(s), moe_dtype) for s in seeds)
        self.norm = torch.nn.LayerNorm(a.d_model)
        self.head = None if a.tie_head else torch.nn.Linear(a.d_model, 256, bias=False)
        half = a.d_model // a.heads // 2
        angle = torch.outer(torch.arange(a.seq_len).float(), 10000 ** (-torch.arange(half) / half))
        self.register_buffer("cos", angle.cos(), persistent=False)
        self.register_buffer("sin", angle.sin(), persistent=False)

    def forward(self, tokens):
        x, aux, S = self.embed(tokens), 0.0, tokens.shape[1]
        for block in self.blocks:
            x, a = block(x, self.cos[:S], self.sin[:S])
            aux = aux + a
        x = self.norm(x)
        logits = (
            self.head(x) if self.head is not None else x @ self.embed.weight.T * x.shape[-1] ** -0.5
        )
        return logits, aux / len(self.blocks)


def count_params(net: ByteLM, a) -> dict[str, int]:
    """Parameters of the whole model (all ranks' experts) and those one token uses."""
    dense = sum(p.numel() for n, p in net.named_parameters() if ".experts." not in n)
    expert = 2 * a.d_model * a.ffn * a.layers
    return {"total": dense + expert * a.experts, "active": dense + expert * a.top_k}


def init_distributed() -> tuple[torch.device, int, int]:
    """Join the torchrun group, or make a group of one (env defaults) for a plain run. NCCL
    with one GPU per process (LOCAL_RANK) where CUDA is present, gloo otherwise."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        for k, v in defaults.items():
            os.environ.setdefault(k, v)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device, dist.get_rank(), dist.get_world_size()


def lr_factor(step: int, warmup: int, steps: int, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor`` at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def clip_gradients(net: ByteLM, max_norm: float) -> torch.Tensor:
    """Scale the gradients to a norm of at most ``max_norm``, the norm over the whole model
    (every rank's experts once, the replicated rest once): the same factor on every rank, so
    the replicas stay alike. Returns that norm (fp32 scalar). A collective."""
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    zero = net.cos.new_zeros(())
    experts = sum((g.float().square().sum() for n, g in grads.items() if ".experts." in n), zero)
    dense = sum((g.float().square().sum() for n, g in grads.items() if ".experts." not in n), zero)
    dist.all_reduce(experts)  # each rank its own experts; the rest is the same on every rank
    norm = (experts + dense).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads.values():
        g.mul_(scale.to(g.dtype))
    return norm


def check_replicas(net: ByteLM) -> None:
    """Raise on every rank if the replicated (non-expert) parameters differ between ranks."""
    sums = torch.stack([p.detach().double().sum() for n, p in net.named_parameters()
                        if ".experts." not in n])  # fmt: skip
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)
    if not all(torch.equal(g, sums) for g in gathered):
        raise RuntimeError("the ranks' replicated (non-expert) parameters differ after training")


def eval_share(held: torch.Tensor, a, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the fixed held-out windows (drawn from EVAL_SEED: the same set in
    every run and at every world size): (int64 [n, seq_len + 1], weights fp32 [n]). n is the
    same on every rank, a multiple of --batch (one shape per call); the padding rows repeat
    real windows (routed like real text) with weight 0."""
    if a.eval_windows < world:  # (every rank sees it: none waits)
        raise ValueError(f"--eval-windows ({a.eval_windows}) must be >= the world size ({world})")
    g = torch.Generator().manual_seed(EVAL_SEED)
    starts = torch.randint(0, held.numel() - a.seq_len - 1, (a.eval_windows,), generator=g)
    mine = windows(held, starts, a.seq_len)[rank::world]
    n = math.ceil(math.ceil(a.eval_windows / world) / a.batch) * a.batch
    weights = (torch.arange(n) < len(mine)).float()
    return mine[torch.arange(n) % len(mine)], weights


@torch.no_grad()
def held_out_bpb(net, evals: torch.Tensor, weights: torch.Tensor, a, device, autocast) -> float:
    """Held-out bits/byte (nats / ln 2) over all ranks' windows, from :func:`eval_share`."""
    total = torch.zeros(2, device=device, dtype=torch.float64)
    for chunk, w in zip(evals.split(a.batch), weights.split(a.batch), strict=True):
        chunk, w = chunk.to(device), w.to(device)
        with autocast:
            logits, _ = net(chunk[:, :-1])
        nats = F.cross_entropy(logits.float().transpose(1, 2), chunk[:, 1:], reduction="none")
        total += torch.stack([(nats.sum(1) * w).sum(), w.sum() * nats.shape[1]])
    dist.all_reduce(total)
    return (total[0] / total[1]).item() / math.log(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=Help)  # fmt: skip
    p.add_argument("--size", choices=tuple(SIZES), default="toy",
                   help="toy: CPU, seconds a step; gpu: the H100 runs' model")  # fmt: skip
    for field, value in SIZES["toy"].items():
        p.add_argument(f"--{field.replace('_', '-')}", type=type(value), help="(size's value)")
    p.add_argument("--exchange", default="mxfp8",
                   help="the MoE layers' exchange= (the layer's default)")  # fmt: skip
    p.add_argument("--precision", default="bf16", help="the experts' grouped GEMMs")
    p.add_argument("--capacity-factor", type=float, default=2.0, help="static dispatch's room")
    p.add_argument("--aux-loss", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--tie-head", action="store_true", help="output head = embedding")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's, matrices only")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    p.add_argument("--seed", type=int, default=0, help="weights and training batches")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="activations (auto: bfloat16 on CUDA, float32 on CPU)")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="torch.compile the model (fullgraph)")
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument("--json", help="write config, corpus, curves and results here (rank 0)")
    a = p.parse_args(argv)
    for field, value in SIZES[a.size].items():
        if getattr(a, field) is None:
            setattr(a, field, value)
    for field, value in (*SIZES["toy"].items(), ("log_every", 1)):
        if type(value) is int and getattr(a, field) < (field != "warmup"):
            p.error(f"--{field.replace('_', '-')} must be >= {int(field != 'warmup')}")
    if a.dtype == "auto":
        a.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    if a.precision == "fp8_rowwise_gw_hp" and a.dtype != "bfloat16":
        p.error("--precision fp8_rowwise_gw_hp needs bf16 activations: pass --dtype bfloat16")
    if not a.lr > 0:
        p.error(f"--lr must be > 0, got {a.lr}")
    if a.d_model % a.heads or (a.d_model // a.heads) % 2:
        p.error(f"--d-model ({a.d_model}) must be a multiple of 2 * --heads ({a.heads})")
    return a


def write_record(path, a, world, device, params, info, curve, eval_steps, bpbs, final=None):
    """The run as JSON: config, corpus, curves so far; "complete" and the results (``final``:
    tokens_per_s, dropped_rows, final_bits_per_byte) once the last step is done."""
    config = {**vars(a), "world": world, "device": str(device), "params": params}
    record = {"config": config, "corpus": info, "train_loss": curve,
              "eval": {"step": eval_steps, "bits_per_byte": bpbs},
              "complete": final is not None, **(final or {})}  # fmt: skip
    with open(path, "w") as f:
        json.dump(record, f)


def main(argv=None) -> None:
    a = parse_args(argv)
    device, rank, world = init_distributed()
    dtype = getattr(torch, a.dtype)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = True
    corpus = load_corpus()
    info = corpus["info"]
    torch.manual_seed(a.seed)  # the dense weights (DDP broadcasts rank 0's anyway)
    net = ByteLM(a, world, dtype).to(device)
    params = count_params(net, a)
    if rank == 0:
        print(f"corpus: {info['train_files'] + info['held_out_files']} files, "
              f"{info['train_bytes'] + info['held_out_bytes']} bytes; train {info['train_files']} "
              f"files, {info['train_bytes']} bytes; held-out {info['held_out_files']} files, "
              f"{info['held_out_bytes']} bytes; sha256 {info['sha256']}")  # fmt: skip
        print(f"parameters: {params['total'] / 1e6:.2f}M total, {params['active'] / 1e6:.2f}M "
              f"active per token; {world} rank(s), {a.experts // world} experts each; "
              f"{world * a.batch * a.seq_len} tokens per step", flush=True)  # fmt: skip
    mx.prepare_ddp(net)  # each rank's experts its own, the rest averaged by DDP
    if a.compile:
        net.compile(fullgraph=True)
    model = torch.nn.parallel.DistributedDataParallel(net)
    flat = [p for p in net.parameters() if p.dim() < 2]  # norms: no weight decay
    groups = [{"params": [p for p in net.parameters() if p.dim() >= 2]},
              {"params": flat, "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), weight_decay=a.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, a.warmup, a.steps))
    data = torch.Generator().manual_seed(a.seed * 1_000_003 + rank)
    evals, eval_weights = eval_share(corpus["held_out"], a, rank, world)
    try:
        from tqdm import tqdm

        bar = tqdm(total=a.steps, disable=rank != 0, dynamic_ncols=True)
    except ImportError:
        bar = None
    curve, pending, eval_steps, bpbs = [], [], [], []

    def evaluate(done: int) -> None:  # held-out loss after `done` steps
        eval_steps.append(done)
        bpbs.append(held_out_bpb(net, evals, eval_weights, a, device, autocast))
        if rank == 0 and a.json and done < a.steps:  # a run cut short keeps its curves
            write_record(a.json, a, world, device, params, info, curve, eval_steps, bpbs)

    step_tokens = world * a.batch * a.seq_len
    train_s, timed_tokens, rate = 0.0, 0, float("nan")
    evaluate(0)
    clock = time.perf_counter()
    for step in range(a.steps):
        batch = windows(corpus["train"], torch.randint(0, info["train_bytes"] - a.seq_len - 1,
                        (a.batch,), generator=data), a.seq_len).to(device)  # fmt: skip
        with autocast:
            logits, aux = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        (loss + a.aux_loss * aux).backward()
        clip_gradients(net, a.clip)
        opt.step()
        sched.step()
        pending.append(loss.detach())
        done = step + 1
        evaluating = done == a.steps or done % a.eval_every == 0
        logging = step == 0 or evaluating or done % a.log_every == 0
        if logging:  # one host sync
            losses = torch.stack(pending)
            dist.all_reduce(losses)
            curve += (losses / world).tolist()
            now = time.perf_counter()
            if step > 0:  # the first step (compile, warm-up) is not timed
                rate = len(pending) * step_tokens / (now - clock)
                train_s, timed_tokens = train_s + now - clock, timed_tokens + rate * (now - clock)
            pending, clock = [], now
        if evaluating:  # before the line below, so it shows this evaluation (not timed)
            evaluate(done)
            clock = time.perf_counter()
        if logging:
            speed = "" if math.isnan(rate) else f"  {rate:,.0f} tok/s"  # (none after step 1)
            stats = f"loss {curve[-1]:.4f}  held-out {bpbs[-1]:.4f} bits/byte{speed}"
            if bar is not None:
                bar.update(done - bar.n)
                bar.set_postfix_str(stats)
            elif rank == 0:
                print(f"step {done:6d}  {stats}", flush=True)
    if bar is not None:
        bar.close()
    check_replicas(net)
    dropped = sum(b.moe.dispatch_stats for b in net.blocks)
    dist.all_reduce(dropped)
    routed = (
        (a.steps * a.batch + len(eval_steps) * len(evals)) * a.seq_len * a.top_k * a.layers * world
    )
    tokens_per_s = timed_tokens / train_s if train_s else float("nan")
    if rank == 0:
        print(f"static dispatch: {int(dropped[0])} of {routed} rows dropped "
              f"(capacity factor {a.capacity_factor}); "
              + ("tokens/s not timed (one step)" if math.isnan(tokens_per_s)
                 else f"{tokens_per_s:,.0f} tokens/s"))  # fmt: skip
        if a.json:
            write_record(a.json, a, world, device, params, info, curve, eval_steps, bpbs,
                         final=dict(tokens_per_s=tokens_per_s, dropped_rows=int(dropped[0]),
                                    final_bits_per_byte=bpbs[-1]))  # fmt: skip
        print(f"final held-out bits/byte: {bpbs[-1]:.4f}", flush=True)
    del model, opt  # DDP's reducer holds the process group: let it go before the group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
