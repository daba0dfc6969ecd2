"""Peak memory of the host-synced MoE dispatch + combine (mx.dispatch, mx.combine), forward
and backward, under balanced and skewed routing, per exchange (bf16, mxfp8).

    torchrun --nproc-per-node=2 benchmarks/bench_moe_memory.py --json moe_memory.json
    python benchmarks/bench_moe_memory.py                  (one rank, a group of one)
    TRITON_INTERPRET=1 torchrun --nproc-per-node=2 benchmarks/bench_moe_memory.py \\
        --tokens 1024 --hidden 256                          (CPU/gloo)

One measured step per (routing, exchange), after --warmup unmeasured steps of the same (default
1 on CUDA, 0 on CPU, where only storages made in the measured step count): x [T, H] bf16
and topk_weights fp32 [T, k] (a softmax over random logits, renormalized) require grad;
expert_x, counts, handle = dispatch(x, topk_ids, E, group, exchange=EXCHANGE); expert_y =
expert_x * 2 (a stand-in for the experts); out = combine(expert_y, topk_weights, handle);
out.float().sum().backward(). The forward runs in a function that returns out alone, so
expert_x, expert_y and the handle live on only where autograd saved them (as in a layer;
real experts would save expert_x for their weight gradients, the stand-in saves nothing).
T and H are per rank, E (--experts) in all (E / world per rank), k = --top-k. Every rank
draws its own tokens and routing (seed 100 + rank).

Routings:
    balanced    each token's k experts distinct and uniformly random over all E
    one_rank    each token's k experts all on rank 0: drawn from rank 0's E / world local
                experts (distinct where k <= E / world, else with repeats)
    one_expert  every token to expert 0 in all k slots (dispatch allows repeated ids)
At world 1 every routing sends every row to the one rank; one_rank then is balanced over
the local experts, and only the row order differs.

What "peak" is, per rank, then the max over ranks (with the rank that has it):
    CUDA   torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus
           memory_allocated() before the step: bytes the caching allocator handed out at
           once over and above what existed before (the inputs, the routing), so x.grad,
           topk_weights.grad and out are in it. NCCL's own buffers are not (not allocated
           through torch's allocator).
    CPU    no allocator statistic: a TorchDispatchMode (LiveBytes below) sees every op that
           reaches the dispatcher while the step runs, counts the storage of each output
           that is not one of the op's inputs' storages (a new storage; views and in-place
           results are not new), once per storage, and subtracts it when the storage is
           freed (weakref.finalize on the storage). Peak = the most such bytes alive at
           once. It is NOT allocator memory: a custom op (mxfp8_a2a::slot_sum, ::row_sums,
           quantize/dequantize ops) is seen as one op, so its outputs count but its internal
           temporaries do not; numpy buffers of the Triton interpreter are not seen; and on
           CPU the MXFP8 exchange's casts run as the torch references (exchange/rows.py),
           whose fp32 temporaries are seen, where CUDA runs Triton kernels in place.
           Compare CPU figures with CPU figures of the same script only. --trace prints
           the storages alive at the peaks, grouped by the op that made them.
"fwd" is the peak from the step's start to combine's return; "fwd+bwd" over the whole step.
"rows to busiest" is the rows dispatch returned (expert_x.shape[0]) on the rank that got the
most ("busiest rank"); "recv MiB" their size in x's dtype (one [N, H] tensor's worth).

On CPU, --interpret-block-t (default 64) sets the token block of the slot_sum/row_sums
kernels under the Triton interpreter (mxfp8_a2a._config.INTERPRET_SLOT_SUM_BLOCK_T, where
the package has it; the package's 2 makes a 1024-token step take minutes): a tiling only,
inside custom ops, so the figures do not change (checked: same peaks and gradients with 2
and 64, 2026-12-05), only the time; 0 keeps the package's value.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before mxfp8_a2a is imported (as tests/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import weakref  # noqa: E402

import torch.distributed as dist  # noqa: E402
from common import Help, versions, write_json  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import mxfp8_a2a as mx  # noqa: E402
from mxfp8_a2a import _config  # noqa: E402
from mxfp8_a2a._torchrun import init_from_torchrun  # noqa: E402

ROUTINGS = ("balanced", "one_rank", "one_expert")
EXCHANGES = ("bf16", "mxfp8")
MIB = float(1 << 20)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create while the mode is active and that are still
    alive: ``now``, and its maximum ``peak`` (see the module docstring for what it sees).
    ``at_peak``: (bytes, what made it) of each storage alive at the peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}  # data_ptr -> (nbytes, what made it)
        self.now = self.peak = 0
        self.at_peak: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {_ptr(a) for a in tree_leaves((args, kwargs))}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), given, func, t)
        return out

    def _add(self, storage: torch.UntypedStorage, given: set, func, t: torch.Tensor) -> None:
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in given or ptr in self.live:
            return
        dtype = str(t.dtype).removeprefix("torch.")
        self.live[ptr] = (nbytes, f"{func} {dtype} {list(t.shape)}")
        self.now += nbytes
        if self.now > self.peak:
            self.peak, self.at_peak = self.now, list(self.live.values())
        weakref.finalize(storage, self._free, ptr).atexit = False

    def _free(self, ptr: int) -> None:
        self.now -= self.live.pop(ptr, (0, ""))[0]

    def reset_peak(self) -> None:
        self.peak, self.at_peak = self.now, list(self.live.values())


def _ptr(a) -> int | None:
    if isinstance(a, torch.Tensor):
        return a.untyped_storage().data_ptr()
    if isinstance(a, torch.UntypedStorage):
        return a.data_ptr()
    return None


def check_live_bytes() -> None:
    """LiveBytes on a known sequence (raises AssertionError where it miscounts)."""
    mib = 1 << 20
    before = torch.empty(4 * mib, dtype=torch.uint8)
    with LiveBytes() as m:
        a = torch.empty(mib, dtype=torch.uint8)
        assert (m.now, m.peak) == (mib, mib), (m.now, m.peak)
        v = a.view(2, -1)[1]  # a view: no new storage
        a.add_(1)  # in place: none either
        before[:16].mul_(2)  # an input's storage, written in place: not counted
        assert m.now == mib, m.now
        del a
        assert m.now == mib, m.now  # the view keeps the storage
        del v
        assert m.now == 0, m.now
        b = torch.empty(2 * mib, dtype=torch.uint8)
        assert (m.now, m.peak) == (2 * mib, 2 * mib), (m.now, m.peak)
        m.reset_peak()
        c = b.float()  # 8 MiB next to b's 2
        del b, c
        assert (m.now, m.peak) == (0, 10 * mib), (m.now, m.peak)
        m.reset_peak()
        w = torch.ones(mib // 4, requires_grad=True)  # 1 MiB of fp32
        (w * 3).sum().backward()  # the backward's ops count too: w.grad (1 MiB)
        assert m.now == 2 * mib and 2 * mib <= m.peak < 2 * mib + 1024, (m.now, m.peak)
        del w
        assert m.now == 0, m.now


def make_routing(routing, tokens, top_k, experts, world, gen, device):
    """(topk_ids int64 [T, k], logits for the weights fp32 [T, k]) of ``routing``."""
    local = experts // world
    if routing == "balanced":
        ids = torch.rand(tokens, experts, generator=gen, device=device).argsort(1)[:, :top_k]
    elif routing == "one_rank" and top_k <= local:
        ids = torch.rand(tokens, local, generator=gen, device=device).argsort(1)[:, :top_k]
    elif routing == "one_rank":
        ids = torch.randint(0, local, (tokens, top_k), generator=gen, device=device)
    else:
        ids = torch.zeros(tokens, top_k, dtype=torch.int64, device=device)
    logits = torch.randn(tokens, top_k, generator=gen, device=device)
    return ids.contiguous(), logits


def forward(x, ids, weights, experts, exchange) -> tuple[torch.Tensor, int]:
    """combine(dispatch(x) * 2): (out, rows dispatch returned). Only what autograd saved
    outlives it, as in a layer's forward."""
    expert_x, _, handle = mx.dispatch(x, ids, experts, None, exchange=exchange)
    expert_y = expert_x * 2  # a stand-in for the experts
    return mx.combine(expert_y, weights, handle), expert_x.shape[0]


def step(x, ids, logits, experts, exchange, meter) -> int:
    """One forward + backward; ``meter`` marks its "start", the forward's return ("fwd") and
    its "end". Returns the rows dispatch returned."""
    w = torch.softmax(logits, -1)
    weights = (w / w.sum(-1, keepdim=True)).requires_grad_(True)
    x.grad = None
    meter("start")
    out, rows = forward(x, ids, weights, experts, exchange)
    meter("fwd")
    out.float().sum().backward()
    meter("end")
    return rows


class CudaMeter:
    def __init__(self, device):
        self.device, self.base, self.peaks = device, 0, {}

    def __call__(self, mark: str) -> None:
        torch.cuda.synchronize(self.device)
        if mark == "start":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.peaks[mark] = torch.cuda.max_memory_allocated(self.device) - self.base


class CpuMeter:
    """LiveBytes, entered at "start" and left at "end"."""

    def __init__(self):
        self.mode, self.peaks, self.at_peak = LiveBytes(), {}, {}

    def __call__(self, mark: str) -> None:
        if mark == "start":
            self.mode.__enter__()
            return
        self.peaks[mark], self.at_peak[mark] = self.mode.peak, self.mode.at_peak
        if mark == "end":
            self.mode.__exit__(None, None, None)


def measure(x, ids, logits, experts, exchange, warmup, device, trace: bool) -> dict:
    for _ in range(warmup):
        step(x, ids, logits, experts, exchange, lambda mark: None)
    dist.barrier()
    meter = CudaMeter(device) if device.type == "cuda" else CpuMeter()
    rows = step(x, ids, logits, experts, exchange, meter)
    x.grad = None
    mine = torch.tensor(
        [meter.peaks["fwd"], meter.peaks["end"], rows], dtype=torch.float64, device=device
    )
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    fwd, total, rows = torch.stack(every).cpu().T  # [world] each
    fwd, total = fwd / MIB, total / MIB
    busiest, peak_rank = int(rows.argmax()), int(total.argmax())
    res = {
        "peak_fwd_mib": fwd.max().item(),
        "peak_fwd_bwd_mib": total.max().item(),
        "peak_rank": peak_rank,
        "busiest_rank": busiest,
        "rows_busiest": int(rows[busiest]),
        "recv_mib_busiest": rows[busiest].item() * x.shape[1] * x.element_size() / MIB,
        "peak_fwd_mib_per_rank": fwd.tolist(),
        "peak_fwd_bwd_mib_per_rank": total.tolist(),
        "rows_per_rank": [int(r) for r in rows.tolist()],
    }
    if trace:  # what was alive at the peak rank's peaks
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {m: summary(v) for m, v in meter.at_peak.items()})
        res["live_at_peak"] = gathered[peak_rank]
    return res


def summary(live: list[tuple[int, str]]) -> list[tuple[float, int, str]]:
    """(MiB, how many, what made them) of the storages alive at a peak, largest first."""
    by: dict[str, list] = {}
    for nbytes, what in live:
        by.setdefault(what, [0, 0])
        by[what][0] += nbytes
        by[what][1] += 1
    return sorted(((b / MIB, n, what) for what, (b, n) in by.items()), reverse=True)


def print_trace(results: list[dict], min_mib: float) -> None:
    for r in results:
        for mark, name in (("fwd", "fwd"), ("end", "fwd+bwd")):
            live = r["live_at_peak"][mark]
            total = sum(m for m, _, _ in live)
            head = f"{r['routing']} {r['exchange']}: alive at the {name} peak of rank"
            print(f"\n{head} {r['peak_rank']} ({total:.2f} MiB; groups of {min_mib} MiB and up)")
            for mib, n, what in live:
                if mib >= min_mib:
                    print(f"  {mib:8.3f} MiB  x{n:<3d} {what}")


HEADERS = ["routing", "exchange", "tokens", "hidden", "peak MiB fwd", "peak MiB fwd+bwd"]
HEADERS += ["peak rank", "busiest rank", "rows to busiest", "recv MiB"]
KEYS = ["routing", "exchange", "tokens", "hidden", "peak_fwd_mib", "peak_fwd_bwd_mib"]
KEYS += ["peak_rank", "busiest_rank", "rows_busiest", "recv_mib_busiest"]


def join_group() -> torch.device:
    """The torchrun group, or a group of one in this process where torchrun did not start
    it (on a free port)."""
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
        os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return init_from_torchrun()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    # fmt: off
    p.add_argument("--tokens", type=int, default=4096, help="per rank")
    p.add_argument("--hidden", type=int, help="default 2048 on CUDA, 256 on CPU")
    p.add_argument("--top-k", type=int, default=8, help="experts per token")
    p.add_argument("--experts", type=int, default=16, help="in all (a multiple of the world)")
    p.add_argument("--routing", action="append", choices=ROUTINGS, help="repeatable")
    p.add_argument("--exchange", action="append", choices=EXCHANGES, help="repeatable")
    p.add_argument("--warmup", type=int, help="unmeasured steps first (default 1 CUDA, 0 CPU)")
    p.add_argument("--interpret-block-t", type=int, default=64, help="CPU: slot_sum's token "
                   "block in the Triton interpreter (0: the package's own; see the docstring)")
    p.add_argument("--trace", action="store_true", help="CPU: print what was alive at the "
                   "peaks (op outputs, by op, dtype and shape), of the rank with the peak")
    p.add_argument("--trace-min-mib", type=float, default=0.01, help="--trace: smaller "
                   "groups of storages are left out")
    p.add_argument("--check-tracker", action="store_true", help="only check LiveBytes on a "
                   "known sequence (no process group), then exit")
    p.add_argument("--json", help="write the results here (rank 0)")
    # fmt: on
    args = p.parse_args()
    if args.check_tracker:
        check_live_bytes()
        print("LiveBytes: the known sequence counts as expected")
        return

    device = join_group()
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden = args.hidden or (2048 if cuda else 256)
    if args.experts % world or args.top_k > args.experts:
        raise SystemExit(f"--experts ({args.experts}) must be a multiple of the world size "
                         f"({world}) and at least --top-k ({args.top_k})")  # fmt: skip
    warmup = args.warmup if args.warmup is not None else (1 if cuda else 0)
    if not cuda:
        check_live_bytes()
        if args.interpret_block_t and hasattr(_config, "INTERPRET_SLOT_SUM_BLOCK_T"):
            _config.INTERPRET_SLOT_SUM_BLOCK_T = args.interpret_block_t
    if rank == 0:
        interpret = os.environ.get("TRITON_INTERPRET")
        where = "CUDA" if cuda else f"CPU/gloo, TRITON_INTERPRET={interpret}"
        what = ("max_memory_allocated over the step minus memory_allocated before it" if cuda
                else "live bytes of op outputs seen by a TorchDispatchMode (not allocator "
                "memory; see the docstring)")  # fmt: skip
        print(f"{world} rank(s) on {where}; {versions()}", file=sys.stderr)
        print(f"peak: {what}; max over ranks", file=sys.stderr)
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(args.tokens, hidden, generator=gen, device=device, dtype=torch.bfloat16)
    x.requires_grad_(True)
    results = []
    for routing in args.routing or ROUTINGS:
        ids, logits = make_routing(
            routing, args.tokens, args.top_k, args.experts, world, gen, device
        )
        for exchange in args.exchange or EXCHANGES:
            res = {"routing": routing, "exchange": exchange, "tokens": args.tokens}
            res |= {"hidden": hidden, "top_k": args.top_k, "experts": args.experts}
            trace = args.trace and not cuda
            res |= measure(x, ids, logits, args.experts, exchange, warmup, device, trace)
            results.append(res)
            if rank == 0:
                print(f"  {routing} {exchange}: {res['peak_fwd_bwd_mib']:.2f} MiB",
                      file=sys.stderr)  # fmt: skip
    if rank == 0:
        print(f"{world} rank(s), {'CUDA' if cuda else 'CPU'}, top-k {args.top_k}, "
              f"{args.experts} experts; peaks: max over ranks (MiB)")  # fmt: skip
        print(tabulate([[r[k] for k in KEYS] for r in results], headers=HEADERS, floatfmt=".2f"))
        write_json(
            args.json,
            {"versions": versions(), "world_size": world, "device": "cuda" if cuda else "cpu",
             "warmup": warmup, "interpret_block_t": None if cuda else args.interpret_block_t,
             "results": results},
        )  # fmt: skip
        if args.trace and not cuda:
            print_trace(results, args.trace_min_mib)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
