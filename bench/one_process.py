"""One process against `torchrun` with two, side by side, on the shards `dvc repro pack` built.

The README's tour trains with `marin-study train params/tiny.yaml` on one process; the study trains on two
with `torchrun --nproc_per_node 2`. Both train the same global batch, so tokens per second should be close: one
process takes every core's threads and accumulates two micro-batches, two processes take one thread each. Each
launcher trains `--steps` steps in a fresh run folder, `--rounds` times, alternating; a run's speed is the median
`tokens_per_sec` of its metrics after the first `--skip` steps, and its wall clock includes start-up. Ends with
`ratio: X`, one process's best over two processes' best.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def train(launcher: list[str], params: str, steps: int, skip: int) -> tuple[float, float]:
    "(median tokens/s after `skip` steps, wall seconds) of one fresh run under `launcher`."
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        subprocess.run([*launcher, str(BIN / "marin-study"), "train", params, "--run-dir", run_dir,
                        "--set", f"train.steps={steps}", "--set", "train.eval_every=0"],
                       cwd=ROOT, check=True, capture_output=True, text=True)
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    speeds = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r and r["step"] > skip]
    return statistics.median(speeds), wall


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--params", default="params/tiny.yaml")
    cli.add_argument("--steps", type=int, default=40)
    cli.add_argument("--skip", type=int, default=5, help="steps left out of the median (warm-up)")
    cli.add_argument("--rounds", type=int, default=2)
    args = cli.parse_args()
    launchers = {"one process": [], "torchrun, 2 processes": [str(BIN / "torchrun"), "--nproc_per_node", "2", "--no-python"]}
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((l.split(":", 1)[1].strip() for l in cpuinfo.splitlines() if l.startswith("model name")), platform.machine())
    print(f"machine: {model}, {os.cpu_count()} cores; {args.params}, "
          f"{args.steps} steps, {args.rounds} rounds")
    best = {}
    for round_ in range(args.rounds):
        for name, launcher in launchers.items():
            speed, wall = train(launcher, args.params, args.steps, args.skip)
            print(f"round {round_ + 1}, {name}: {speed:,.0f} tokens/s, {wall:.0f} s wall")
            best[name] = max(best.get(name, 0.0), speed)
    one, two = best.values()
    print(f"one process {one:,.0f} against torchrun {two:,.0f} tokens/s")
    print(f"ratio: {one / two:.2f}")


if __name__ == "__main__":
    main()
