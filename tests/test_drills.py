"""Fault drills: a user's worst day, on the tiny params with 2 processes on CPU. Run them alone with
`python -m pytest tests/test_drills.py` (or `-m drills`); they are part of the full suite too.

Each drill breaks something a real run meets (a kill, a full or read-only disk, a second trainer, a dead launcher, a
requeue) and asserts what the kit promises: the run continues bit-identical, or stops with one clear error and loses
nothing already saved."""
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from conftest import (
    BIN, ROOT, STEPS, check_same_run, command, free_port, kill_during, losses, run, small_corpus, tree_hashes)
from marin_study.trainer.checkpoint import Checkpoints, checkpoint_name
from marin_study.trainer.metrics import MetricsLog
from test_launch import STEPS as LAUNCH_STEPS, FINAL, job_states, launch_params, marin, wait_for as job_end  # noqa: F401 (a fixture)

pytestmark = pytest.mark.drills


def start(cmd: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}, **kw)


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def workers_of(proc: subprocess.Popen) -> list[psutil.Process]:
    return [c for c in psutil.Process(proc.pid).children(recursive=True) if "marin-study" in " ".join(c.cmdline())]


@pytest.mark.parametrize("zero", [0, 2])
def test_sigkill_at_three_random_steps_then_resume_is_bit_exact(zero, reference, params_file, tmp_path):
    steps = sorted(random.sample(range(2, STEPS), 3))
    cmd = command("torchrun", params_file, tmp_path / "run", f"parallel.zero_stage={zero}")
    if zero == 0:  # first, once, a kill before the first checkpoint: the next start begins again from step 0
        kill_during(command("torchrun", params_file, tmp_path / "run", "train.checkpoint_every=0"), tmp_path / "run", 1,
                    checkpointed=False)
        assert not Checkpoints(tmp_path / "run/checkpoints").steps()
    for step in steps:
        kill_during(cmd, tmp_path / "run", step)
    result = run(cmd)
    assert "resumed from" in result.stderr, f"killed after steps {steps}: {result.stderr[-2000:]}"
    check_same_run(tmp_path / "run", reference(zero), f"killed after steps {steps}")


def test_a_second_trainer_on_a_run_folder_is_refused_naming_the_first(reference, params_file, tmp_path):
    run_dir, lock = tmp_path / "run", tmp_path / "run/trainer.lock"
    first = start(command("torchrun", params_file, run_dir))
    wait_for(lambda: lock.exists() and lock.read_text().strip(), first, "the first trainer's lock")
    holder = int(lock.read_text().split()[1])  # "PID 1234 on HOST, since ..."
    paused = workers_of(first)
    for worker in paused: worker.suspend()  # held mid-run, so the second surely meets it
    try:
        second = run(command("torchrun", params_file, run_dir), check=False, timeout=300)
    finally:
        for worker in paused: worker.resume()
    assert second.returncode != 0
    assert f"is in use by the trainer with PID {holder} on " in second.stderr, second.stderr[-3000:]
    assert second.stderr.count("marin-study: error:") == 1, second.stderr[-3000:]
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    check_same_run(run_dir, reference(0), "the first trainer, after the second was refused")
    assert lock.read_text() == ""  # released cleanly at the end: the next start sees no stale lock


def test_killing_torchrun_stops_its_workers_and_the_rerun_continues_exactly(reference, params_file, tmp_path):
    run_dir = tmp_path / "run"
    launcher = start(command("torchrun", params_file, run_dir), start_new_session=True)
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= 2, launcher, "step 2")
    workers = workers_of(launcher)
    assert len(workers) == 2
    launcher.kill()  # SIGKILL to torchrun alone: its workers live in sessions of their own
    launcher.wait()
    gone, alive = psutil.wait_procs(workers, timeout=120)
    assert not alive, f"workers outlived their launcher: {[p.pid for p in alive]}"
    result = run(command("torchrun", params_file, run_dir))
    assert "resumed from" in result.stderr and "in use" not in result.stderr, result.stderr[-3000:]
    check_same_run(run_dir, reference(0), "after the launcher was killed")


def test_a_lock_left_by_a_killed_trainer_is_stale_and_taken_over_with_a_note(tmp_path, capsys):
    from marin_study.trainer.processes import LOCK_FILE, RunLock
    killed = subprocess.run([BIN / "python", "-c", "import os, signal, sys; from marin_study.trainer.processes import RunLock; "
                             "held = RunLock(sys.argv[1]).acquire(); os.kill(os.getpid(), signal.SIGKILL)", tmp_path])
    assert killed.returncode == -signal.SIGKILL
    stale = (tmp_path / LOCK_FILE).read_text().strip()
    assert stale.startswith("PID ")  # its line is still there, but the kernel dropped its lock
    lock = RunLock(tmp_path).acquire()
    assert f"taking over from the trainer with {stale}, which has ended" in capsys.readouterr().err
    lock.release()


# Checkpoints: a kill in the middle of a save, torn files, a full disk and a read-only run folder.

def steps_and(run_dir: Path, key: str = "loss") -> list:
    return [(r["step"], r[key]) for r in MetricsLog(run_dir / "metrics.jsonl").read()]


def one_error(result) -> str:
    "The run's single `marin-study: error:` line, after checking that no rank printed a traceback."
    assert result.returncode != 0 and result.stderr.count("marin-study: error: ") == 1, result.stderr[-3000:]
    assert "marin_study/" not in result.stderr and 'py", line' not in result.stderr.split("torchrun")[0], result.stderr[-3000:]
    return result.stderr.split("marin-study: error: ")[1].splitlines()[0]


@contextlib.contextmanager
def mounted(folder: Path, *options: str):
    "A mount over `folder` for the drill (root only), undone after it; the drill is skipped where mounting is refused."
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", *options, str(folder)], capture_output=True, text=True)
    if done.returncode: pytest.skip(f"cannot mount here (mount {' '.join(options)}: {done.stderr.strip()})")
    try: yield folder
    finally: subprocess.run(["umount", "-l", str(folder)], capture_output=True)


KILLED_IN_A_SAVE = """
import os, signal, sys
from marin_study import cli
from marin_study.trainer.checkpoint import Checkpoints

commit, step = Checkpoints.commit, int(sys.argv[1])
def killed(self, s):
    "Rank 0 dies in the middle of sealing checkpoint `step`: every rank's files written, no manifest, no rename."
    if s == step: os.kill(os.getpid(), signal.SIGKILL)
    return commit(self, s)
Checkpoints.commit = killed
raise SystemExit(cli.main(sys.argv[2:]))
"""


def test_sigkill_during_a_save_resumes_from_the_newest_complete_checkpoint_bit_exact(reference, params_file,
                                                                                             tmp_path):
    script, run_dir = tmp_path / "killed.py", tmp_path / "run"
    script.write_text(KILLED_IN_A_SAVE)
    killed = run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), str(script), "6"]
                 + command("alone", params_file, run_dir)[1:], check=False, timeout=300)
    assert killed.returncode != 0
    checkpoints = Checkpoints(run_dir / "checkpoints")
    assert checkpoints.steps() == [2, 4] and checkpoints.staging(6).is_dir()  # the save of step 6 never finished
    resumed = run(command("torchrun", params_file, run_dir))
    assert f"resumed from {checkpoints.root / checkpoint_name(4)}" in resumed.stderr
    for key in ("loss", "grad_norm", "moe/bias_norm"):  # bit-identical to the uninterrupted run
        assert steps_and(run_dir, key) == steps_and(reference(0), key), key
    assert checkpoints.steps()[-1] == STEPS and not checkpoints.staging(6).exists()


def test_a_full_disk_during_a_save_is_one_error_and_the_run_resumes(params_file, tmp_path):
    "A 20 MB tmpfs as the run folder: the tiny model's first checkpoint (about 49 MB) cannot fit."
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=20m", "tmpfs") as disk:
        run_dir = disk / "run"
        result = run(command("torchrun", params_file, run_dir, until=2), check=False, timeout=300)
        error = one_error(result)
        assert f"saving the checkpoint of step 2 in {run_dir / 'checkpoints'} failed" in error
        assert "a checkpoint needs about 49.4 MB" in error and "MB are free there" in error
        assert "resume from step 0 (no checkpoint was completed)" in error
        assert not list((run_dir / "checkpoints").iterdir())  # the staging folder is removed
        assert [s for s, _ in steps_and(run_dir)] == [1, 2]


def test_a_read_only_run_folder_is_one_error_naming_the_file(params_file, tmp_path):
    run_dir = tmp_path / "run"
    run(command("alone", params_file, run_dir, until=2))
    before = steps_and(run_dir)
    with mounted(run_dir, "--bind", str(run_dir)):
        done = subprocess.run(["mount", "-o", "remount,ro,bind", str(run_dir)], capture_output=True, text=True)
        if done.returncode: pytest.skip(f"cannot remount read-only here: {done.stderr.strip()}")
        result = run(command("alone", params_file, run_dir, until=4), check=False, timeout=300)
    error = one_error(result)  # the first write refused: the run folder's lock, or else metrics.jsonl
    assert "Read-only file system" in error and str(run_dir) in error
    assert steps_and(run_dir) == before and Checkpoints(run_dir / "checkpoints").steps() == [2]
    run(command("alone", params_file, run_dir, until=4))  # writable again: it goes on
    assert [s for s, _ in steps_and(run_dir)] == [1, 2, 3, 4]


def test_a_corrupt_checkpoint_is_reported_and_skipped_never_silently_replaced(reference, params_file, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference(0), run_dir)
    newest = run_dir / "checkpoints/step-00000008/deepspeed/mp_rank_00_model_states.pt"
    newest.write_bytes(newest.read_bytes()[:-10] + b"0123456789")
    torn = Checkpoints(run_dir / "checkpoints").begin(10)  # a save that never finished
    result = run(command("torchrun", params_file, run_dir, "train.steps=10"))
    assert "step-00000008" in result.stderr and "sha256" in result.stderr and "resumed from" in result.stderr
    assert "step-00000006" in result.stderr.split("resumed from")[1].splitlines()[0]
    assert [r["step"] for r in MetricsLog(run_dir / "metrics.jsonl").read()] == list(range(1, 11))
    assert not torn.exists()
    for step in (2, 4, 6):
        (run_dir / f"checkpoints/step-{step:08d}/trainer.json").write_text("torn")
    for step in (8, 10):
        shutil.rmtree(run_dir / f"checkpoints/step-{step:08d}/deepspeed")
    result = run(command("alone", params_file, run_dir, "train.steps=10"), check=False)
    assert result.returncode == 2 and "refusing to start over" in result.stderr


# Data: `marin-study data clean`, `data tokenizer` and `data pack` killed (SIGKILL) at random moments, three times in a
# row, on top of older outputs of other params. After each kill the stage's output is the old one, the new one, or
# none, and a training start on it works or is refused with a DataError (never an IndexError in the embedding). A
# rerun then gives exactly the bytes of an uninterrupted run. DRILL_SEED=<n> replays a drill's kill moments.

# The run's params: a 1024-id tokenizer and model. The old outputs come from other params, among them a 2048-id
# tokenizer whose ids an unchecked loader would feed to the 1024-row embedding.
NEW = ["model.vocab_size=1024"]
OLD = ["model.vocab_size=2048", "data.heldout_fraction=0.1", "data.token_dtype=uint32"]
OUTPUTS = {"clean": ["clean"], "tokenizer": ["tokenizer.json", "tokenizer_report.json"], "pack": ["shards"]}


def data_cmd(action: str, raw: Path, out: Path, sets: list[str]) -> list[str]:
    overrides = [f"data.dir={raw}", f"data.out_dir={out}", *sets]
    return [str(BIN / "marin-study"), "data", action, str(ROOT / "params/tiny.yaml")] + \
        [a for s in overrides for a in ("--set", s)]


@pytest.fixture(scope="module")
def data_drill(tmp_path_factory):
    "A small corpus; its outputs from an uninterrupted run ('new', with each stage's seconds) and from other params ('old')."
    root = tmp_path_factory.mktemp("data_drill")
    raw = small_corpus(root / "raw", per_source=10)
    seconds = {}
    for name, sets in (("new", NEW), ("old", OLD)):
        for action in OUTPUTS:
            start = time.perf_counter()
            run(data_cmd(action, raw, root / name, sets))
            seconds.setdefault(action, time.perf_counter() - start)
    return {"root": root, "raw": raw, "seconds": seconds}


def training_start(out: Path) -> str:
    "What a run meets first: its loader, its held-out windows, and a batch of each through the model. 'works' or why not."
    import torch
    from marin_study.config import load_params
    from marin_study.data.corpus import DataError
    from marin_study.data.mixture import make_loader
    from marin_study.model import Transformer
    from marin_study.trainer.evaluation import HeldOut
    params = load_params(ROOT / "params/tiny.yaml", [f"data.out_dir={out}", *NEW, "data.max_epochs=1000", "train.steps=2",
                                                     "train.global_batch=4", "train.micro_batch=2", "train.seq_len=64",
                                                     "model.sliding_window=32", "data.mixture={web: 1, books: 1}"])
    try:
        batch = next(iter(make_loader(params, workers=0)))
        heldout = HeldOut(params, samples=4, rank=0, world_size=1)
    except DataError as e:
        return f"refused: {e}"
    model = Transformer(params.model)
    with torch.no_grad():  # the embedding is where a token id past model.vocab_size fails
        model(batch[:, :-1])
        for tokens_BW, _, _ in heldout.windows.values(): model(tokens_BW[:, :-1].clamp(min=0))
    return "works"


@pytest.mark.parametrize("stage", list(OUTPUTS))
def test_sigkill_during_a_data_stage_leaves_old_or_no_output_and_a_rerun_is_identical(stage, data_drill, tmp_path):
    root, raw = data_drill["root"], data_drill["raw"]
    seed = int(os.environ.get("DRILL_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    out = tmp_path / "out"
    shutil.copytree(root / "old", out)
    for earlier in list(OUTPUTS)[:list(OUTPUTS).index(stage)]:  # the stages before this one are up to date
        for name in OUTPUTS[earlier]:
            target = out / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
            (shutil.copytree if (root / "new" / name).is_dir() else shutil.copy)(root / "new" / name, target)
    allowed = [{name: tree_hashes(tree / name) for name in OUTPUTS[stage]} for tree in (root / "old", root / "new")]
    for kill in range(3):
        delay = rng.uniform(0.2, 1.0) * data_drill["seconds"][stage]
        proc = subprocess.Popen(data_cmd(stage, raw, out, NEW), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try: proc.wait(timeout=delay)
        except subprocess.TimeoutExpired: os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        context = f"DRILL_SEED={seed}, kill {kill + 1} after {delay:.2f} s (exit {proc.returncode}): {err[-2000:]}"
        assert proc.returncode in (0, -signal.SIGKILL), context
        left = {name: tree_hashes(out / name) for name in OUTPUTS[stage]}
        # a file output (tokenizer.json) and its report are committed one after the other: each is old, new or absent
        for name, files in left.items():
            assert files in ({}, allowed[0][name], allowed[1][name]), f"{name} is a mix of old and new; {context}"
        outcome = training_start(out)
        assert outcome == "works" or outcome.startswith("refused: "), context
    for action in list(OUTPUTS)[list(OUTPUTS).index(stage):]:  # the rerun, and the stages after it as dvc repro runs them
        run(data_cmd(action, raw, out, NEW))
    assert tree_hashes(out) == tree_hashes(root / "new"), f"the rerun differs from an uninterrupted run (DRILL_SEED={seed})"
    assert training_start(out) == "works"


# Slurm: a job signalled before its time limit checkpoints and requeues itself, on the localhost cluster.

def test_a_slurm_requeue_mid_run_continues_with_nothing_repeated_and_a_capped_chain_resumes_on_resubmission(slurm, launch_params, tmp_path):
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
    assert job_end(job) == "FAILED"  # the cap: checkpointed but not requeued a second time
    text = log.read_text()
    assert "requeueing (restart 1 of at most 1)" in text and "not requeued after 1 requeues" in text
    steps_done = len(MetricsLog(metrics).read())
    assert 3 < steps_done < LAUNCH_STEPS
    job = re.search(r"submitted job (\d+)", marin(*submit).stdout).group(1)  # the same command continues the run
    assert job_end(job) == "COMPLETED", log.read_text()
    assert [r["step"] for r in MetricsLog(metrics).read()] == list(range(1, LAUNCH_STEPS + 1))
    assert losses(tmp_path / "run") == pytest.approx(losses(tmp_path / "reference"), rel=1e-6)
    assert len(json.loads((tmp_path / "run/launch/launch.json").read_text())["jobs"]) == 2
    assert len(list((tmp_path / "run/logs").iterdir())) == 3  # per-rank logs of each job and restart
