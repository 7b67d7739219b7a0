"""Learning speed: tokens and minutes of training to a held-out bits-per-byte target, side by side, on the tiny rung.

Each arm (a name and its params overrides; by default AdamW, Muon, and Muon with document masking, each at its own
learning rates whatever params/tiny.yaml says) trains params/tiny.yaml with
`marin-study train` under torchrun on 2 processes, once per seed (the initialisation's and the data order's),
evaluating the held-out sample every `--eval-every` steps. The target is the first arm's final held-out bits per
byte, the highest of its seeds (so that each of them reaches it), unless `--target` names one. A run reaches the
target at its first evaluation at or below it, linearly interpolated from the evaluation before; its minutes are the
summed step times up to there (start-up and evaluation left out). Prints one line per run, one per arm (with its
tokens per second over the whole run), then `ratio <arm>: X` for every arm after the first, its tokens to the target
over the first arm's (below 1: it learns faster), and last `ratio: X`, the second arm's. Needs the shards of
`dvc repro pack`.
"""
import argparse
import json
import math
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ADAMW = "train.optimizer=adamw,train.lr=3e-3,train.adam_lr=0,model.document_mask=false"
MUON = "train.optimizer=muon,train.lr=0.01,train.adam_lr=0.06"
ARMS = [f"adamw:{ADAMW}", f"muon:{MUON},model.document_mask=false", f"muon-masked:{MUON},model.document_mask=true"]


def train(params: str, run_dir: Path, sets: list[str]) -> list[dict]:
    "The metrics of one finished 2-process run of `params` with `sets`."
    with socket.socket() as s:  # a free port: two benchmarks at once do not meet on torchrun's default
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", port, "--no-python", BIN / "marin-study",
           "train", params, "--run-dir", run_dir] + [a for s in sets for a in ("--set", s)]
    done = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True)
    if done.returncode: sys.exit(f"learning benchmark: {' '.join(sets)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def to_target(records: list[dict], target: float) -> tuple[float, float] | None:
    "(tokens, minutes of steps) at which held-out bits per byte first reaches `target`; None if it never does."
    minutes, before = 0.0, None
    for r in records:
        minutes += r.get("step_time", 0.0) / 60
        if not math.isfinite(r.get("eval/bpb", math.nan)): continue
        point = (r["tokens"], minutes, r["eval/bpb"])
        if point[2] <= target:
            if before is None: return point[:2]
            share = (before[2] - target) / (before[2] - point[2])
            return tuple(b + share * (p - b) for b, p in zip(before[:2], point[:2]))
        before = point
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="params/tiny.yaml")
    ap.add_argument("--arm", action="append", metavar="NAME:KEY=VALUE,...",
                    help=f"an arm (default: {' and '.join(ARMS)})")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, help="steps of every run (default: the params'; docs/benchmarks.md's figures: 300)")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--target", type=float,
                    help="held-out bits per byte (default: the first arm's final, its highest seed)")
    args = ap.parse_args()
    arms = [(spec.partition(":")[0], [s for s in spec.partition(":")[2].split(",") if s]) for spec in args.arm or ARMS]
    common = [f"train.eval_every={args.eval_every}", "train.log_every=1", "train.checkpoint_every=0",
              "train.trackers=[]"] + ([f"train.steps={args.steps}"] if args.steps else [])
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets in arms:
            for seed in range(args.seeds):
                seeds = [f"train.seed={seed}", f"data.seed={seed}"]
                records = train(args.params, Path(tmp) / f"{name}-{seed}", common + sets + seeds)
                runs[name, seed] = records
                last = [r for r in records if "eval/bpb" in r][-1]
                print(f"{name} seed {seed}: final held-out {last['eval/bpb']:.4f} bits per byte at {last['tokens']:,} "
                      f"tokens, {sum(r.get('step_time', 0) for r in records) / 60:.1f} min of steps, "
                      f"{records[-1].get('bad_steps', 0)} skipped steps")
    first = arms[0][0]
    finals = [[r for r in runs[first, s] if "eval/bpb" in r][-1]["eval/bpb"] for s in range(args.seeds)]
    target = args.target if args.target is not None else max(finals)
    print(f"target: {target:.4f} held-out bits per byte")
    tokens = {}
    for name, _ in arms:
        reached = [to_target(runs[name, s], target) for s in range(args.seeds)]
        if None in reached:
            print(f"{name}: {sum(r is not None for r in reached)} of {args.seeds} seeds reach the target")
            continue
        tokens[name] = statistics.mean(r[0] for r in reached)
        rate = statistics.mean(rec[-1]["tokens"] / sum(r.get("step_time", 0) for r in rec)
                               for rec in (runs[name, s] for s in range(args.seeds)))
        print(f"{name}: {tokens[name]:,.0f} tokens, {statistics.mean(r[1] for r in reached):.2f} min to the target "
              f"(seeds: {', '.join(f'{r[0]:,.0f}' for r in reached)}); {rate:,.0f} tokens/s")
    if first in tokens:
        for name, _ in arms[1:]:
            if name in tokens: print(f"ratio {name}: {tokens[name] / tokens[first]:.3f}")
        if len(arms) > 1 and arms[1][0] in tokens: print(f"ratio: {tokens[arms[1][0]] / tokens[first]:.3f}")


if __name__ == "__main__":
    main()
