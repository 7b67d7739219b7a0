"Launching on a real Slurm (one node on localhost): training jobs, preemption and requeue, papermill arrays, bad input."
import json
import re
import shlex
import subprocess
import time
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from conftest import BIN, ROOT, quick_params, run
from marin_study.config import save_params
from marin_study.trainer.metrics import MetricsLog
from marin_study.utils import sha256_file

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
    folder = tmp_path / "a folder é"  # sbatch, srun and both shells see the space and the non-ASCII name as they are
    out = marin("launch", "slurm", launch_params, "--launcher", "srun", "--run-dir", folder / "run").stdout
    job = re.search(r"submitted job (\d+)", out).group(1)
    log = folder / f"run/slurm/{launch_params.stem}-{job}.out"
    assert wait_for(job) == "COMPLETED", log.read_text()
    assert [r["step"] for r in MetricsLog(folder / "run/metrics.jsonl").read()] == list(range(1, STEPS + 1))
    assert "training finished" in log.read_text()
    ranks = sorted(p.name for p in (folder / "run/slurm").glob(f"*-{job}-rank*.out"))
    assert ranks == [f"{launch_params.stem}-{job}-rank0.out", f"{launch_params.stem}-{job}-rank1.out"]
    assert f"step {STEPS}: loss" in (folder / "run/slurm" / ranks[0]).read_text()
    record = json.loads((folder / "run/launch/launch.json").read_text())
    assert record["jobs"][0]["job_id"] == job and re.fullmatch(r"[0-9a-f]{40}(\+dirty)?|unknown", record["jobs"][0]["commit"])
    assert {p.name for p in (folder / "run/launch").iterdir()} >= {"sbatch.sh", "params.yaml", "deepspeed.json",
                                                                     "accelerate.yaml", "launch.json"}


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
        "params_path", "overrides", "gpu", "gpus", "mfu", "goodput", "gpu_hour_usd", "run_dir", "launcher", "submit",
        "summary_json"}
    assert "Running stage 'launch'" in run(["dvc", "repro", "launch"], cwd=project_copy).stdout
    summary = json.loads((project_copy / "reports/cluster_launch.json").read_text())
    assert 60 <= summary["days"] <= 90 and summary["fits"] and summary["gpus"] == 704
    assert summary["cost_usd"] == pytest.approx(summary["days"] * 24 * 704 * 4.0)
    assert summary["submittable"]  # the trainer runs its layout: 64-way expert parallelism, ZeRO 1, full recompute
    html = (project_copy / "reports/cluster_launch.html").read_text()
    assert not remote_references(html) and "#SBATCH --nodes=176" in html and "not submitted" in html
    assert not (project_copy / "runs/slurm").exists()


@pytest.mark.parametrize("key,value", [("launch.partition", "gpu\nrm -rf ~"), ("launch.account", "lab;touch pwned"),
                                       ("launch.qos", "$(reboot)"), ("launch.partition", "-w node1")])
def test_a_launch_value_that_a_shell_or_sbatch_would_read_is_refused_naming_it(key, value, tmp_path):
    result = marin("launch", "slurm", "params/tiny.yaml", "--dry-run", "--run-dir", tmp_path / "run",
                   "--set", f"{key}={json.dumps(value)}", check=False)
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr, result.stderr
    assert f"{key}: {value!r} has a space, a line break or a shell character" in result.stderr
    assert not (tmp_path / "run").exists() and not (ROOT / "pwned").exists()


def test_env_names_must_be_shell_names_and_env_values_reach_the_job_as_written(tmp_path):
    refused = marin("launch", "slurm", "params/tiny.yaml", "--dry-run", "--set",
                    'launch.env={"A;touch pwned": "1"}', check=False)
    assert refused.returncode == 2 and refused.stdout == "" and "Traceback" not in refused.stderr
    assert "launch.env: 'A;touch pwned' is not a shell variable name" in refused.stderr
    value = "a b; $(touch pwned) `touch pwned` 'quoted' \"double\" \\ é"
    env = json.dumps({"NOTE": value})
    script = marin("launch", "slurm", "params/tiny.yaml", "--dry-run", "--set", f"launch.env={env}").stdout
    preamble = script.split("\nMAX_REQUEUES=")[0]  # the #SBATCH lines, the environment and the cd
    shown = run(["bash", "-c", preamble + '\nprintf %s "$NOTE"'], cwd=tmp_path).stdout
    assert shown == value and not (tmp_path / "pwned").exists() and not (ROOT / "pwned").exists()


def fake_slurm(folder: Path) -> Path:
    "Stand-ins for what a job script calls: srun runs its command (fakes first on PATH), the rest record their arguments."
    folder.mkdir()
    (folder / "srun").write_text('#!/bin/bash\nfor a; do case $a in --output=*) printf "%s\\n" "${a#--output=}" '
                                 '> "$FAKE_LOG/srun-output";; --*) ;; *) break;; esac; shift; done\n'
                                 'PATH="$FAKE_BIN:$PATH" exec "$@"\n')
    (folder / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    for name in ("marin-study", "accelerate", "torchrun", "scancel"):
        (folder / name).write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$FAKE_LOG/$(basename "$0")"\n')
    for f in folder.iterdir(): f.chmod(0o755)
    return folder


def sbatch_options(script: str) -> list[str]:
    "The #SBATCH options as sbatch reads them: words, with quotes and backslashes as a shell's."
    return [word for line in script.splitlines() if line.startswith("#SBATCH ") for word in shlex.split(line[8:], comments=True)]


@pytest.mark.parametrize("launcher", ["accelerate", "torchrun", "srun"])
def test_a_script_for_a_folder_with_a_space_and_non_ascii_runs_each_command_on_that_folder(launcher, tmp_path):
    from marin_study.launch import render_sbatch
    from marin_study.config import load_params
    run_dir = tmp_path / "runs with space/é 'quoted' \"double\" $HOME `x`"
    script = render_sbatch(load_params(ROOT / "params/tiny.yaml"), run_dir, launcher, job_name="tiny é", project=ROOT)
    (tmp_path / "job.sh").write_text(script)
    run(["bash", "-n", tmp_path / "job.sh"])
    assert f"--output={run_dir}/slurm/%x-%j.out" in sbatch_options(script) and "--job-name=tiny é" in sbatch_options(script)
    bin_, log = fake_slurm(tmp_path / "bin"), tmp_path / "log"
    log.mkdir()
    env = {"FAKE_BIN": str(bin_), "FAKE_LOG": str(log), "PATH": f"{bin_}:/usr/bin:/bin", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "localhost", "SLURM_NODEID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}
    out = run(["bash", tmp_path / "job.sh"], env=env).stdout
    assert "training finished" in out
    expected_output = f"{run_dir}/slurm/%x-%j-" + ("rank%t" if launcher == "srun" else "node%n") + ".out"
    assert (log / "srun-output").read_text() == expected_output + "\n"
    train = ["train", f"{run_dir}/launch/params.yaml", "--run-dir", str(run_dir)]
    args = (log / ("marin-study" if launcher == "srun" else launcher)).read_text().splitlines()
    assert args[-4:] == train
    if launcher == "accelerate":
        assert args[args.index("--config_file") + 1] == f"{run_dir}/launch/accelerate.yaml"
    if launcher != "srun":
        assert args[args.index("--log_dir" if launcher == "accelerate" else "--log-dir") + 1] == f"{run_dir}/logs/7-r0"


def test_sweep_scripts_run_the_task_and_summary_of_a_folder_with_a_space_and_non_ascii(tmp_path):
    from marin_study.launch import render_array, render_summary
    from marin_study.config import load_params
    out, params = tmp_path / "sweeps with space/é $HOME", load_params(ROOT / "params/tiny.yaml")
    bin_, log = fake_slurm(tmp_path / "bin"), tmp_path / "log"
    log.mkdir()
    env = {"FAKE_LOG": str(log), "PATH": f"{bin_}:/usr/bin:/bin", "SLURM_ARRAY_TASK_ID": "1"}
    own_env = lambda script: "\n".join(l for l in script.splitlines() if not l.startswith("source "))  # else the real marin-study
    array = render_array(out, [{}, {}], params, "sweep-é", project=ROOT)
    assert f"--output={out}/task-%a/slurm-%A_%a.out" in sbatch_options(array)
    (tmp_path / "array.sh").write_text(own_env(array))
    run(["bash", tmp_path / "array.sh"], env=env)
    assert (log / "marin-study").read_text().splitlines() == ["launch", "task", str(out), "1"]
    (tmp_path / "summary.sh").write_text(own_env(render_summary(out, params, "sweep-é", project=ROOT)))
    run(["bash", tmp_path / "summary.sh"], env=env)
    assert (log / "marin-study").read_text().splitlines() == ["launch", "summarize", str(out)]
