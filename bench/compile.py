"""torch.compile (inductor's CPU backend) on the tiny training step against eager, side by side in one process.

Both legs train the same model (params/tiny.yaml by default) from the same seed on the same batches of the trainer's
own loader: forward, backward, clipping, an AdamW step and the balancing-bias update, with every core. The
compiled leg wraps the model in `torch.compile` (the whole forward and backward; the optimizer step stays eager) and
runs the experts one by one: dynamo cannot trace `torch._grouped_mm` in fp32 (its meta kernel in torch 2.13 accepts
bf16 only), so the eager leg's grouped matmul is not open to it; a third leg runs eager on that same path. Each leg
runs `--steps` timed steps after `--warmup` untimed ones (the compiled leg's first steps compile; their time is
printed apart). The compiled leg runs twice to see whether it is bit-reproducible on one machine, and its losses
are compared with eager's. Ends with `ratio: X`, compiled tokens/s over eager tokens/s (the kit adopts compile at
>= 1.10, and only where it stays bit-reproducible and resumable).
"""
import argparse
import os
import time
from pathlib import Path

import torch

from marin_study.config import load_params
from marin_study.data.mixture import make_loader
from marin_study.model import Transformer, use_grouped_mm
from marin_study.trainer.optim import param_groups, peak_lr
from marin_study.trainer.schedule import lr_at

ROOT = Path(__file__).resolve().parents[1]


def leg(params, steps: int, warmup: int, compiled: bool, grouped: bool = True) -> tuple[list[float], float, float]:
    "Losses of every step, seconds of the warmup steps, tokens per second of the timed ones."
    t = params.train
    torch.manual_seed(t.seed)
    model = use_grouped_mm(Transformer(params.model), grouped and not compiled)
    optimizer = torch.optim.AdamW(param_groups(model, t), betas=(t.beta1, t.beta2), eps=t.eps)
    forward = torch.compile(model) if compiled else model
    accumulation = t.global_batch // t.micro_batch
    batches, losses = iter(make_loader(params)), []
    start = time.perf_counter()
    for step in range(warmup + steps):
        if step == warmup: warm_s, start = time.perf_counter() - start, time.perf_counter()
        for group in optimizer.param_groups: group["lr"] = lr_at(step, t, peak_lr(group, t))
        loss = 0.0
        for _ in range(accumulation):
            batch_BT = next(batches)
            micro = forward(batch_BT[:, :-1], batch_BT[:, 1:]).loss / accumulation
            micro.backward()
            loss += micro.item()
        if t.grad_clip: torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.update_balance_bias()
        losses.append(loss)
    return losses, warm_s, steps * t.global_batch * t.seq_len / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default=str(ROOT / "params/tiny.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a params key")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    params = load_params(args.params, args.set + [f"train.steps={args.steps + args.warmup}"])
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    print(f"{params.train.global_batch} x {params.train.seq_len} tokens per step, fp32, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    _, eager_warm, eager_rate = leg(params, args.steps, args.warmup, compiled=False)
    print(f"eager: {eager_rate:,.0f} tokens/s, first {args.warmup} steps {eager_warm:.1f} s")
    looped, _, looped_rate = leg(params, args.steps, args.warmup, compiled=False, grouped=False)
    print(f"eager, experts one by one (what the compiled leg runs): {looped_rate:,.0f} tokens/s")
    runs = []
    for i in range(2):
        torch._dynamo.reset()
        runs.append(leg(params, args.steps, args.warmup, compiled=True))
        print(f"compiled run {i + 1}: {runs[-1][2]:,.0f} tokens/s, first {args.warmup} steps {runs[-1][1]:.1f} s "
              f"(compiling)")
    same = runs[0][0] == runs[1][0]
    gap = max(abs(a - b) for a, b in zip(looped, runs[0][0]))
    print(f"compiled runs bit-identical: {'yes' if same else 'no'}; largest loss gap to eager on the same path over "
          f"{len(looped)} steps: {gap:.2e}")
    print(f"ratio: {max(r[2] for r in runs) / eager_rate:.3f}")


if __name__ == "__main__":
    main()
