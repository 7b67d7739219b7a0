"Launching on a real Slurm (one node on localhost): training jobs, preemption and requeue, papermill arrays, bad input."
import json
import re
import subprocess
import time
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from conftest import BIN, ROOT, command, quick_params, run
from marin_study.config import save_params
from marin_study.trainer.metrics import MetricsLog
from marin_study.utils import sha256_file
from test_trainer import losses

STEPS = 16
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def job_states(job: str) -> list[str]:
    "The state of a job (every task of an array), as `scontrol show job` tells it."
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return re.findall(r"JobState=(\S+)", out)


def wait_for(job: str, timeout: float = 600) -> str:
    "Wait until every task of `job` has ended; its final state (the worst one for an array)."
    end = time.time() + timeout
    while time.time() < end:
        states = job_states(job)
        if states and all(s in FINAL for s in states):
            return "COMPLETED" if set(states) == {"COMPLETED"} else next(s for s in states if s != "COMPLETED")
        time.sleep(1)
    subprocess.run(["scancel", job], timeout=30)
    raise AssertionError(f"job {job} still {job_states(job)} after {timeout} s")


def marin(*args, check=True, **kw):
    return run([BIN / "marin-study", *map(str, args)], check=check, **kw)


@pytest.fixture(scope="session")
def launch_params(pipeline, tmp_path_factory) -> Path:
    "The tiny model on the small real corpus, 2 CPU processes on one node: a step takes a fraction of a second."
    p = quick_params(pipeline["params"], steps=STEPS, checkpoint_every=0, eval_every=0, eval_samples=2)
    return save_params(p, tmp_path_factory.mktemp("launch") / "tiny-launch.yaml")


def test_dry_run_prints_a_valid_script_and_writes_nothing(tmp_path):
    script = marin("launch", "slurm", "params/tiny.yaml", "--dry-run", "--run-dir", tmp_path / "run").stdout
    assert script.startswith("#!/bin/bash\n") and "#SBATCH --nodes=1\n" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --signal=B:USR1@" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "accelerate launch --config_file" in script and "scontrol show hostnames" in script
    (tmp_path / "script.sh").write_text(script)
    run(["bash", "-n", tmp_path / "script.sh"])  # it parses
    assert not (tmp_path / "run").exists()
    big = marin("launch", "slurm", "params/marin-535b-a23b.yaml", "--dry-run", "--launcher", "torchrun")
    assert "#SBATCH --nodes=176" in big.stdout and "#SBATCH --gpus-per-node=4" in big.stdout
    assert "torchrun --nnodes 176 --node_rank \\$SLURM_NODEID --nproc_per_node 4" in big.stdout
    assert "warning" not in big.stderr, big.stderr  # the trainer runs its expert parallelism, ZeRO 1 and full recompute
    pp = marin("launch", "slurm", "params/node.yaml", "--dry-run", "--set", "parallel.pp=2", "--set", "parallel.ep=4")
    assert "warning" in pp.stderr and "the trainer runs data and expert parallelism only" in pp.stderr


def test_bad_input_is_refused_before_anything_is_submitted(slurm, launch_params, tmp_path):
    jobs_before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    def launch(*sets, **kw):
        result = marin("launch", "slurm", launch_params, "--run-dir", tmp_path / "run",
                       *[a for s in sets for a in ("--set", s)], check=False, **kw)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        return result.stderr
    assert "run one process per GPU" in launch("launch.gpus_per_node=4")   # more GPUs than processes use
    assert "cannot be split into micro-batches" in launch("launch.procs_per_node=3")  # more than the batch splits over
    assert "launch.partition 'gpu-a100' does not exist; this cluster has debug" in launch("launch.partition=gpu-a100")
    assert "the trainer runs data and expert parallelism only" in launch("parallel.pp=2")
    assert "AutoEP" in launch("parallel.ep=2", "parallel.zero_stage=3")  # expert parallelism wants ZeRO 0-2
    assert "sbatch is not on PATH" in launch(env={"PATH": str(BIN)})
    notebook = nbformat.read(ROOT / "nbs/studies/train_tiny.ipynb", as_version=4)
    for cell in notebook.cells: cell.metadata.pop("tags", None)
    nbformat.write(notebook, tmp_path / "untagged.ipynb")
    sweep = marin("launch", "sweep", launch_params, "--notebook", tmp_path / "untagged.ipynb", "--grid", "train.lr=0.001,0.003",
                  "--out", tmp_path / "sweep", check=False)
    assert sweep.returncode == 2 and "no cell is tagged 'parameters'" in sweep.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == jobs_before


def test_a_two_task_srun_job_trains_the_tiny_model_over_gloo(slurm, launch_params, tmp_path):
    out = marin("launch", "slurm", launch_params, "--launcher", "srun", "--run-dir", tmp_path / "run").stdout
    job = re.search(r"submitted job (\d+)", out).group(1)
    log = tmp_path / f"run/slurm/{launch_params.stem}-{job}.out"
    assert wait_for(job) == "COMPLETED", log.read_text()
    assert [r["step"] for r in MetricsLog(tmp_path / "run/metrics.jsonl").read()] == list(range(1, STEPS + 1))
    assert "training finished" in log.read_text()
    ranks = sorted(p.name for p in (tmp_path / "run/slurm").glob(f"*-{job}-rank*.out"))
    assert ranks == [f"{launch_params.stem}-{job}-rank0.out", f"{launch_params.stem}-{job}-rank1.out"]
    assert f"step {STEPS}: loss" in (tmp_path / "run/slurm" / ranks[0]).read_text()
    record = json.loads((tmp_path / "run/launch/launch.json").read_text())
    assert record["jobs"][0]["job_id"] == job and re.fullmatch(r"[0-9a-f]{40}(\+dirty)?|unknown", record["jobs"][0]["commit"])
    assert {p.name for p in (tmp_path / "run/launch").iterdir()} >= {"sbatch.sh", "params.yaml", "deepspeed.json",
                                                                     "accelerate.yaml", "launch.json"}


def test_usr1_checkpoints_requeues_resumes_and_a_capped_chain_continues_on_resubmission(slurm, launch_params, tmp_path):
    run(command("torchrun", launch_params, tmp_path / "reference"))
    submit = ["launch", "slurm", launch_params, "--run-dir", tmp_path / "run", "--set", "launch.max_requeues=1"]
    job = re.search(r"submitted job (\d+)", marin(*submit).stdout).group(1)  # accelerate launch, the planner's configs
    metrics, log = tmp_path / "run/metrics.jsonl", tmp_path / f"run/slurm/{launch_params.stem}-{job}.out"
    def signal_after(lines: int) -> None:
        "Once `lines` steps are logged (mid-run), do what --signal=B:USR1@N does before a time limit."
        end = time.time() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= lines):
            assert time.time() < end and not set(job_states(job)) & set(FINAL), log.read_text()
            time.sleep(0.2)
        run(["scancel", "--signal=USR1", "--batch", job])
    signal_after(3)
    end = time.time() + 300
    while "restart 1 (at most 1)" not in log.read_text():  # checkpointed, requeued, started again
        assert time.time() < end, log.read_text()
        time.sleep(0.5)
    signal_after(len(metrics.read_text().splitlines()) + 3)
    assert wait_for(job) == "FAILED"  # the cap: checkpointed but not requeued a second time
    text = log.read_text()
    assert "requeueing (restart 1 of at most 1)" in text and "not requeued after 1 requeues" in text
    steps_done = len(MetricsLog(metrics).read())
    assert 3 < steps_done < STEPS
    job = re.search(r"submitted job (\d+)", marin(*submit).stdout).group(1)  # the same command continues the run
    assert wait_for(job) == "COMPLETED", log.read_text()
    assert [r["step"] for r in MetricsLog(metrics).read()] == list(range(1, STEPS + 1))
    assert losses(tmp_path / "run") == pytest.approx(losses(tmp_path / "reference"), rel=1e-6)
    assert len(json.loads((tmp_path / "run/launch/launch.json").read_text())["jobs"]) == 2
    assert len(list((tmp_path / "run/logs").iterdir())) == 3  # per-rank logs of each job and restart


def test_a_three_task_papermill_array_and_its_summary(slurm, tmp_path):
    out = marin("launch", "sweep", "params/marin-535b-a23b.yaml", "--notebook", "nbs/studies/cluster_launch.ipynb",
                "--grid", "train.steps=100000,200000,400000", "--out", tmp_path / "sweep").stdout
    array, summary = re.search(r"submitted array (\d+) and summary job (\d+)", out).groups()
    assert wait_for(summary) == "COMPLETED" and wait_for(array) == "COMPLETED"
    for i in range(3):
        task = tmp_path / f"sweep/task-{i}"
        assert (task / "cluster_launch.ipynb").exists() and (task / "cluster_launch.html").exists()
    table = pd.read_csv(tmp_path / "sweep/summary.csv")
    assert list(table["status"]) == ["ok"] * 3 and list(table["train.steps"]) == [100000, 200000, 400000]
    assert table["days"].iloc[1] == pytest.approx(2 * table["days"].iloc[0]) and table["days"].iloc[2] == pytest.approx(4 * table["days"].iloc[0])
    html = (tmp_path / "sweep/summary.html").read_text()
    assert "<table" in html and f"params params/marin-535b-a23b.yaml (sha256 {sha256_file(ROOT / 'params/marin-535b-a23b.yaml')[:12]})" in html


def test_the_launch_study_shows_plan_script_days_and_cost_and_submits_nothing(project_copy):
    from marin_study.studies import remote_references, study_parameters
    assert set(study_parameters(ROOT / "nbs/studies/cluster_launch.ipynb")) == {
        "params_path", "overrides", "gpu", "gpus", "mfu", "gpu_hour_usd", "run_dir", "launcher", "submit", "summary_json"}
    assert "Running stage 'launch'" in run(["dvc", "repro", "launch"], cwd=project_copy).stdout
    summary = json.loads((project_copy / "reports/cluster_launch.json").read_text())
    assert 60 <= summary["days"] <= 90 and summary["fits"] and summary["gpus"] == 704
    assert summary["cost_usd"] == pytest.approx(summary["days"] * 24 * 704 * 4.0)
    assert summary["submittable"]  # the trainer runs its layout: 64-way expert parallelism, ZeRO 1, full recompute
    html = (project_copy / "reports/cluster_launch.html").read_text()
    assert not remote_references(html) and "#SBATCH --nodes=176" in html and "not submitted" in html
    assert not (project_copy / "runs/slurm").exists()
