"""After the README's commands: fail if any tracked file changed, except dvc.lock entries of outputs that cannot be
bit-reproducible. Everything else a stage writes to git (metrics, plots, the tokenizer report) must come out byte for
byte as committed, and every stage's deps and params must be what the lock records."""
import subprocess
import sys

import yaml

# Outputs whose bytes differ on every run or every CPU kind, with the reason. All are DVC-cached (not in git), so only
# their hash in dvc.lock can change, as an output or as the next stage's dependency.
NOT_BIT_REPRODUCIBLE = {
    "runs/ladder/ladder.ipynb": "papermill records each cell's start and end time",
    "reports/ladder.html": "rendered from that executed notebook",
    "runs/tiny/run": "metrics.jsonl and the checkpoints' trainer state hold step times and tokens per second",
    # A run's floats follow the CPU: MKL and ATen pick AVX-512 or AVX2 kernels by processor, the sums differ in the
    # last bit from step 2, and 300 steps grow that to ~0.07 nats. Pinning MKL_CBWR, ATEN_CPU_CAPABILITY and
    # ONEDNN_MAX_CPU_ISA to AVX2 did not reproduce another machine's run, so these cannot be byte for byte.
    "reports/train_tiny.json": "the run's final losses (its floats follow the CPU)",
    "reports/train_tiny_curve.csv": "the run's loss curve (its floats follow the CPU)",
    "reports/train_tiny_loss.png": "the plot of that curve",
    "reports/loss_findings.json": "the scaling-law fit to that curve",
    "runs/tiny/train_tiny.ipynb": "papermill timings; the notebook prints the training time and speed",
    "reports/train_tiny.html": "rendered from that executed notebook",
    "reports/train_tiny_metrics.jsonl": "a copy of the run's metrics.jsonl, with step times",
    "runs/report/loss_report.ipynb": "papermill timings; it plots the throughput curve",
    "reports/loss_report.html": "rendered from that executed notebook",
    "runs/launch/cluster_launch.ipynb": "papermill records each cell's start and end time",
    "reports/cluster_launch.html": "rendered from that executed notebook",
    "reports/book": "the executed chapters print timings (the loader's speed, the optimizer's step) and embed plots",
}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def entries(lock: dict, stage: str, kind: str) -> dict:
    items = lock.get("stages", {}).get(stage, {}).get(kind, {})
    return items if kind == "params" else {item["path"]: item for item in items}


def main() -> int:
    problems = [f"{line[3:]} was modified" for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
                if line[3:] != "dvc.lock"]
    before, after = yaml.safe_load(git("show", "HEAD:dvc.lock")), yaml.safe_load(open("dvc.lock"))
    for stage in sorted(set(before["stages"]) | set(after["stages"])):
        for kind in ("deps", "params", "outs"):
            old, new = entries(before, stage, kind), entries(after, stage, kind)
            for path in sorted(set(old) | set(new)):
                if old.get(path) != new.get(path) and not (kind != "params" and path in NOT_BIT_REPRODUCIBLE):
                    problems.append(f"dvc.lock: stage '{stage}' {kind} '{path}' differs from the committed lock")
    for problem in problems: print(f".ci/check_tree: {problem}", file=sys.stderr)
    if problems:
        print(".ci/check_tree: commit what a full 'dvc repro' produces (dvc.lock and the metrics), or make the output "
              "reproducible", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
