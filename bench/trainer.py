"""Trainer throughput against a bare PyTorch loop, side by side in one process, on the shards `dvc repro pack` built.

Both train the same model (params/tiny.yaml by default) on the same batches from the same loader, with the same
AdamW parameter groups, gradient accumulation, clipping, balancing-bias update and threads. The trainer adds
DeepSpeed's engine, the bad-step guard, the per-step metrics line and the end-of-leg checkpoint; the bare loop has
none of these. Each side runs `--steps` timed steps after `--warmup` untimed ones, `--rounds` times, alternating;
the best round of each counts. Ends with `ratio: X`, trainer tokens/s over bare-loop tokens/s (target >= 0.9).
"""
import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from marin_study.config import load_params
from marin_study.data.mixture import make_loader
from marin_study.model import Transformer
from marin_study.trainer.optim import param_groups
from marin_study.trainer.schedule import make_scheduler
from marin_study.trainer.train import Trainer

ROOT = Path(__file__).resolve().parents[1]


def bare_loop(params, steps: int, warmup: int) -> float:
    "Tokens per second of a plain forward/backward/AdamW loop over the trainer's own loader."
    t = params.train
    torch.manual_seed(t.seed)
    model = Transformer(params.model)
    optimizer = torch.optim.AdamW(param_groups(model, t), betas=(t.beta1, t.beta2), eps=t.eps)
    scheduler = make_scheduler(optimizer, t)
    accumulation = t.global_batch // t.micro_batch
    batches = iter(make_loader(params))
    for step in range(warmup + steps):
        if step == warmup: start = time.perf_counter()
        for _ in range(accumulation):
            batch_BT = next(batches)
            (model(batch_BT[:, :-1], batch_BT[:, 1:]).loss / accumulation).backward()
        if t.grad_clip: torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        model.update_balance_bias()
    return steps * t.global_batch * t.seq_len / (time.perf_counter() - start)


def trainer_leg(trainer: Trainer, steps: int, warmup: int) -> float:
    "Tokens per second of `Trainer.fit` over `steps` more steps, after `warmup` untimed ones."
    t = trainer.params.train
    trainer.until = trainer.step + warmup
    trainer.loader = make_loader(trainer.params, start_step=trainer.step)
    trainer.fit()
    trainer.until = trainer.step + steps
    trainer.loader = make_loader(trainer.params, start_step=trainer.step)
    start = time.perf_counter()
    trainer.fit()
    return steps * t.global_batch * t.seq_len / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default=str(ROOT / "params/tiny.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a params key")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    total = args.rounds * (args.steps + args.warmup) + 1
    params = load_params(args.params, args.set + [f"train.steps={max(total, 2)}", "train.eval_every=0",
                                                  "train.checkpoint_every=0"])
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    print(f"{params.train.global_batch} x {params.train.seq_len} tokens per step, "
          f"{params.train.global_batch // params.train.micro_batch} micro-batches, {torch.get_num_threads()} threads, "
          f"ZeRO {params.parallel.zero_stage}, {params.train.dtype}")
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(params, run_dir)
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        bare, ours = [], []
        try:
            for round_ in range(args.rounds):
                bare.append(bare_loop(params, args.steps, args.warmup))
                ours.append(trainer_leg(trainer, args.steps, args.warmup))
                print(f"round {round_ + 1}: bare loop {bare[-1]:,.0f} tokens/s, trainer {ours[-1]:,.0f} tokens/s")
        finally:
            trainer.close()
    print(f"best: bare loop {max(bare):,.0f} tokens/s, trainer {max(ours):,.0f} tokens/s")
    print(f"ratio: {max(ours) / max(bare):.3f}")


if __name__ == "__main__":
    main()
