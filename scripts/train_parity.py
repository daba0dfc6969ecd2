"""Training parity of ExpertParallelMoE under data parallelism: the model of
tests/parallel_workers.py trained on the same global batches at world 1 (unwrapped) and at
worlds 2 and 4 (DDP, FSDP2, 2 data x 2 expert), on CPU/gloo; prints, per run, the largest
relative difference of the loss curve and the largest absolute difference of the layer's
weights from the world-1 run.

    python scripts/train_parity.py [--worlds 2 4] [--json out.json]
    python scripts/train_parity.py --gpu   # one GPU: none / DDP / FSDP2 at world 1, NCCL
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from dist_utils import run_distributed  # noqa: E402
from parallel_workers import STEPS, train  # noqa: E402
from test_layer_parallel import REFERENCE, WORLD2, WORLD4  # noqa: E402


def _diffs(got: dict, want: dict) -> tuple[float, float]:
    loss, ref = np.asarray(got["loss"]), np.asarray(want["loss"])
    rel = float(np.max(np.abs(loss - ref) / np.abs(ref)))
    layer = max(
        float(np.max(np.abs(part[k] - want["layers"][0][k])))
        for part in got["layers"]
        for k in part
    )
    return rel, layer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    if args.gpu:
        configs = [(w, 1, e, s) for e in ("bf16", "mxfp8") for s in (False, True)
                   for w in ("none", "ddp", "fsdp2")]  # fmt: skip
        runs = run_distributed(train, 1, configs, None, "cuda", backend="nccl", timeout=900)[0]
        for config, got in zip(configs, runs, strict=True):
            want = runs[configs.index(("none", 1, *config[2:]))]
            rows.append(("cuda/nccl", 1, *config, got["loss"][-1], *_diffs(got, want)))
    else:
        ref = run_distributed(train, 1, REFERENCE, timeout=900)[0]
        for world in args.worlds:
            configs = {2: WORLD2, 4: WORLD4}[world]
            runs = run_distributed(train, world, configs, timeout=900)[0]
            for config, got in zip(configs, runs, strict=False):
                want = ref[REFERENCE.index(("none", 1, *config[2:]))]
                rows.append(("cpu/gloo", world, *config, got["loss"][-1], *_diffs(got, want)))
    head = "device world wrap dp exchange static final_loss loss_rel_diff weights_abs_diff"
    print(f"{STEPS} Adam steps; differences from the world-1 unwrapped run")
    print(head)
    for row in rows:
        print(" ".join(f"{v:.2e}" if isinstance(v, float) else str(v) for v in row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": STEPS, "columns": head.split(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
