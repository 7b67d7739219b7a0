"The trainer as researchers run it: real DeepSpeed processes on CPU, kills, signals, resumes and bad batches."
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import BIN, ROOT, STEPS, check_same_run, command, free_port, losses, run
from marin_study.trainer.checkpoint import Checkpoints, checkpoint_name
from marin_study.trainer.metrics import MetricsLog, eval_domains

@pytest.mark.parametrize("zero", [1, 2, 3])
def test_each_rank_holds_the_model_state_bytes_the_planner_predicts(zero, reference, params_file, tmp_path):
    from marin_study.config import load_params
    from marin_study.layout import Layout
    from marin_study.trainer.deepspeed import model_state_memory
    run_dir = reference(2) if zero == 2 else tmp_path / "run"
    if zero != 2: run(command("torchrun", params_file, run_dir, f"parallel.zero_stage={zero}", until=2))
    report = json.loads((run_dir / "memory.json").read_text())
    assert report["layout"].startswith(f"tp1 pp1 ep1 dp2 zero{zero}") and len(report["ranks"]) == 2
    predicted = model_state_memory(load_params(params_file).model, Layout(dp=2, zero_stage=zero), "fp32", "runtime")
    assert list(report["predicted"].values()) == pytest.approx(predicted)
    for held in report["ranks"]:
        for key in ("params", "grads", "optimizer"):
            assert held[key] == pytest.approx(report["predicted"][key], rel=0.05), (key, held, report["predicted"])


def test_zero_stages_0_2_3_train_the_same_model_on_two_processes(reference, params_file, tmp_path):
    zero0 = losses(reference(0))
    assert [r["step"] for r in MetricsLog(reference(0) / "metrics.jsonl").read()] == list(range(1, STEPS + 1))
    assert zero0[-1] < zero0[0] - 0.5  # it learns
    assert losses(reference(2)) == pytest.approx(zero0, rel=1e-5)
    zero3 = tmp_path / "zero3"
    run(command("torchrun", params_file, zero3, "parallel.zero_stage=3", until=3))
    assert losses(zero3) == pytest.approx(zero0[:3], rel=1e-5)
    records = MetricsLog(reference(0) / "metrics.jsonl").read()
    for key in ("step", "tokens", "loss", "lr", "grad_norm", "step_time", "data_time", "tokens_per_sec",
                "moe/max_load", "moe/min_load", "moe/bias_norm", "aux_loss", "router_z_loss", "logit_z_loss", "bad_steps"):
        assert key in records[0], key
    evals = [r for r in records if "eval/bpb" in r]
    assert [r["step"] for r in evals] == [4, 8]
    domains = eval_domains(evals[0])
    assert len(domains) >= 5
    assert evals[0]["eval/bpb"] == pytest.approx(sum(evals[0][f"eval/{d}/bpb"] for d in domains) / len(domains))
    assert evals[1]["eval/bpb"] < evals[0]["eval/bpb"]


@pytest.mark.parametrize("launcher", ["accelerate", "deepspeed"])
def test_every_launcher_gives_identical_results(launcher, reference, params_file, tmp_path):
    run(command(launcher, params_file, tmp_path / "run", until=4))
    assert losses(tmp_path / "run") == losses(reference(0))[:4]


def test_two_processes_resume_on_one_through_a_universal_checkpoint(reference, params_file, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference(2), run_dir)
    for later in (4, 6, 8): shutil.rmtree(run_dir / f"checkpoints/step-{later:08d}")
    result = run(command("alone", params_file, run_dir, "parallel.zero_stage=2"))
    assert "universal checkpoint" in result.stderr and "resumed from" in result.stderr
    assert [r["step"] for r in MetricsLog(run_dir / "metrics.jsonl").read()] == list(range(1, STEPS + 1))
    # the data continues where it stopped: one process sees the very batches two did, so the losses agree closely
    assert losses(run_dir)[2:] == pytest.approx(losses(reference(2))[2:], rel=1e-4)
    # the balancing biases (buffers, which a universal checkpoint does not carry) come back too
    assert losses(run_dir, "moe/bias_norm") == pytest.approx(losses(reference(2), "moe/bias_norm"), rel=1e-4)
    assert json.loads((run_dir / "checkpoints/step-00000008/trainer.json").read_text())["world_size"] == 1
    card = json.loads((run_dir / "run_card.json").read_text())  # the run card keeps both starts, and their layouts
    assert [(l["start_step"], l["end_step"], l["world_size"]) for l in card["legs"]] == [(0, STEPS, 2), (2, STEPS, 1)]
    assert card["restarts"] == 1 and card["resumed_at"] == [2] and card["layout"].startswith("tp1 pp1 ep1 dp1 zero2")
    final = card["final"]["loss"]  # the final loss is the mean of the last 20 steps (chapter 08): here all 8
    assert final["value"] == pytest.approx(sum(losses(run_dir)) / STEPS, rel=1e-12) and card["tokens"] == STEPS * 8 * 128
    assert (final["step"], final["mean_of_last_steps"]) == (STEPS, STEPS)
    assert len(card["git_commit"]) == 40 and card["params_hash"] and card["data_hash_from"] == "shards meta"
    assert "resumed at step 2" in (run_dir / "RUN_CARD.md").read_text()


def test_changed_params_are_refused_in_an_existing_run(reference, params_file, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference(0), run_dir)
    result = run(command("alone", params_file, run_dir, "model.n_layers=2"), check=False)
    assert result.returncode == 2 and "model.n_layers" in result.stderr and "Traceback" not in result.stderr


def test_sigusr1_on_one_rank_saves_and_exits_cleanly_then_resumes_exactly(reference, params_file, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command("torchrun", params_file, run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})
    deadline = time.time() + 300
    while not (run_dir / "metrics.jsonl").exists() or not losses(run_dir):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    workers = [c for c in psutil.Process(proc.pid).children(recursive=True) if "marin-study" in " ".join(c.cmdline())]
    os.kill(workers[-1].pid, signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "received SIGUSR1" in err
    stopped = Checkpoints(run_dir / "checkpoints").steps()[-1]
    assert stopped < STEPS
    run(command("torchrun", params_file, run_dir))
    assert losses(run_dir) == losses(reference(0))


def test_sigterm_alone_saves_and_exits_zero(params_file, tmp_path):
    "One process in bf16 autocast with TensorBoard events (the default tracker), stopped by SIGTERM."
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command("alone", params_file, run_dir, "train.steps=200", "train.checkpoint_every=0",
                                    "train.dtype=bfloat16"),
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})
    deadline = time.time() + 300
    while not (run_dir / "metrics.jsonl").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "received SIGTERM" in err, err[-3000:]
    steps = Checkpoints(run_dir / "checkpoints").steps()
    assert len(steps) == 1 and steps[0] == len(losses(run_dir)) < 200
    assert 8.0 < losses(run_dir)[0] < 9.5  # bf16 autocast trains the same model: ln(8192) = 9.01 at the start
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


POISON = """
import sys, torch
from marin_study.config import load_params
from marin_study.trainer.optim import BadStepsError
from marin_study.trainer.train import Trainer

poisoned = {int(s) for s in sys.argv[3].split(",")}

class Poisoned:
    "The real loader, except that some steps get random ids the tokenizer never produces (corrupt data)."
    def __init__(self, loader, trainer): self.loader, self.trainer = loader, trainer
    def __iter__(self):
        for batch in self.loader:
            if self.trainer.step + 1 in poisoned:
                batch = torch.randint(2048, 8192, batch.shape, generator=torch.Generator().manual_seed(self.trainer.step))
            yield batch

trainer = Trainer(load_params(sys.argv[1], sys.argv[4:]), sys.argv[2])
trainer.loader = Poisoned(trainer.loader, trainer)
try:
    trainer.fit()
except BadStepsError as e:
    print(f"stopped: {e}")
finally:
    trainer.close()
"""


def test_poisoned_batches_are_skipped_counted_and_too_many_stop_the_run(params_file, tmp_path):
    script = tmp_path / "poison.py"
    script.write_text(POISON)
    sets = ["train.steps=40", "train.spike_window=5", "train.max_bad_steps=3", "train.checkpoint_every=5",
            "train.eval_every=0", "train.seq_len=64", "train.lr=1.0e-3", "train.spike_warmup=10"]
    result = run([sys.executable, str(script), str(params_file), str(tmp_path / "run"), "21,22,25,26,27,28", *sets])
    records = MetricsLog(tmp_path / "run/metrics.jsonl").read()
    skipped = {r["step"]: r["skip_reason"] for r in records if r.get("skipped")}
    assert set(skipped) == {21, 22, 25, 26}, skipped
    assert all(why.startswith("loss ") for why in skipped.values())
    assert records[22]["bad_steps"] == 2 and records[-1]["bad_steps"] == 4 and records[-1]["step"] == 26
    assert "stopped: 3 bad steps in a row" in result.stdout  # at step 27
    assert Checkpoints(tmp_path / "run/checkpoints").steps()[-1] == 25  # the last checkpoint stays


RECORDER = """
import json, sys
from marin_study.config import load_params
from marin_study.trainer.callbacks import Callback
from marin_study.trainer.train import train

class Recorder(Callback):
    "A side job the loop was never edited for: every call it gets, in order, written out when the trainer closes."
    def __init__(self, path): self.path, self.calls = path, []
    def on_fit_start(self, trainer): self.calls.append(["fit_start", trainer.step])
    def on_log(self, trainer, record): self.calls.append(["log", record["step"], record["loss"]])
    def on_step_end(self, trainer, record): self.calls.append(["step_end", record["step"]])
    def on_fit_end(self, trainer): self.calls.append(["fit_end", trainer.step])
    def close(self):
        with open(self.path, "w") as f: json.dump(self.calls + [["close"]], f)

train(load_params(sys.argv[1], sys.argv[5:]), sys.argv[2], until=int(sys.argv[3]), callbacks=[Recorder(sys.argv[4])])
"""


def test_a_new_callback_joins_the_loop_without_editing_it(params_file, tmp_path):
    script = tmp_path / "recorder.py"
    script.write_text(RECORDER)
    run([sys.executable, str(script), str(params_file), str(tmp_path / "run"), "3", str(tmp_path / "calls.json"),
         "train.log_every=2"])
    calls = json.loads((tmp_path / "calls.json").read_text())
    logged = MetricsLog(tmp_path / "run/metrics.jsonl").read()
    assert [r["step"] for r in logged] == [2, 3]  # every second step, and the last of the leg
    assert calls == [["fit_start", 0], ["step_end", 1], ["log", 2, logged[0]["loss"]], ["step_end", 2],
                     ["log", 3, logged[1]["loss"]], ["step_end", 3], ["fit_end", 3], ["close"]]


def test_profile_traces_its_steps_and_costs_nothing_when_off(reference, params_file, tmp_path):
    run_dir = tmp_path / "run"
    run(command("alone", params_file, run_dir, "train.profile.flops=true", until=3) + ["--profile", "2:1"])
    profile = run_dir / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["flops-rank0.txt", "rank0.pt.trace.json", "top_ops-rank0.txt"]
    trace = json.loads((profile / "rank0.pt.trace.json").read_text())  # a Chrome trace, as TensorBoard's plugin reads it
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    top = (profile / "top_ops-rank0.txt").read_text()
    assert top.startswith("steps 2-2 on rank 0") and "aten::mm" in top
    assert "fwd flops per GPU" in (profile / "flops-rank0.txt").read_text()  # DeepSpeed's flops profiler, on step 3
    assert not (reference(0) / "profile").exists()  # off by default
    refused = run(command("alone", params_file, tmp_path / "refused") + ["--profile", "7:5"], check=False)
    assert refused.returncode == 2 and "train.profile" in refused.stderr and "Traceback" not in refused.stderr


def test_trainer_benchmark_runs_and_prints_its_ratio(params_file):
    result = run([sys.executable, str(ROOT / "bench/trainer.py"), "--params", str(params_file), "--steps", "2",
                  "--warmup", "1", "--rounds", "1"])
    assert float(result.stdout.strip().splitlines()[-1].removeprefix("ratio: ")) > 0


def test_learning_benchmark_finds_tokens_to_a_target_for_each_arm_and_prints_their_ratio(params_file):
    result = run([sys.executable, str(ROOT / "bench/learning.py"), "--params", str(params_file), "--seeds", "1",
                  "--eval-every", "4"])
    lines = result.stdout.strip().splitlines()
    assert [line.split(" seed ")[0] for line in lines[:3]] == ["adamw", "muon", "muon-masked"], lines
    target = float(lines[3].removeprefix("target: ").split()[0])
    assert target == float(lines[0].split("final held-out ")[1].split()[0])  # the first arm's final, one seed
    assert lines[4].startswith("adamw: 8,192 tokens")  # it reaches its own final at its end: 8 steps x 8 x 128 tokens
    assert [line.split(":")[0] for line in lines[-3:]] == ["ratio muon", "ratio muon-masked", "ratio"]
    assert float(lines[-1].removeprefix("ratio: ")) <= 1  # Muon reaches AdamW's final held-out loss, no later


@pytest.mark.parametrize("settings, says", [(["parallel.pp=2"], "marin-study plan models them"),
                                            (["parallel.ep=2", "parallel.zero_stage=3"], "AutoEP"),
                                            (["train.optimizer=muon", "parallel.zero_stage=1"], "use parallel.zero_stage: 0")])
def test_parallelism_the_trainer_does_not_run_is_refused_not_ignored(settings, says, params_file, tmp_path):
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # rank 0 of 2: refused before any rendezvous
    result = run(command("alone", params_file, tmp_path / "run", *settings), check=False, env=env)
    assert result.returncode == 2 and says in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run/metrics.jsonl").exists()


# Expert parallelism: the same run with the routed experts split over the two processes (ep 2) or not (ep 1).
EP_STEPS = 20


def ep_settings(ep: int) -> tuple[str, ...]:
    return (f"parallel.ep={ep}", "parallel.zero_stage=1", f"train.steps={EP_STEPS}", "train.checkpoint_every=10",
            "train.eval_every=0")


@pytest.fixture(scope="session")
def expert_parallel(params_file, tmp_path_factory):
    "20-step 2-process runs at parallel.ep 1 and 2 (ZeRO 1, the 535B layout's stage), made once."
    runs = {}
    def get(ep: int) -> Path:
        if ep not in runs:
            runs[ep] = tmp_path_factory.mktemp(f"ep{ep}")
            run(command("torchrun", params_file, runs[ep], *ep_settings(ep)))
        return runs[ep]
    return get


def test_expert_parallel_trains_the_same_model_as_one_expert_group(expert_parallel, params_file, tmp_path):
    one, two = expert_parallel(1), expert_parallel(2)
    assert [r["step"] for r in MetricsLog(two / "metrics.jsonl").read()] == list(range(1, EP_STEPS + 1))
    # fp32, the same sums in another order (each rank's rows meet an expert in their own grouped matmul): 1e-5
    for key in ("loss", "grad_norm", "moe/max_load", "moe/bias_norm", "moe/layer0/entropy"):
        assert losses(two, key) == pytest.approx(losses(one, key), rel=1e-5), key
    assert losses(two)[-1] < losses(two)[0] - 0.5
    # memory at ZeRO 0, where every rank holds whole gradients as the planner counts them (ZeRO 1-2 reduce them in
    # buckets that leave the two ranks 16.3 and 11.5 MB apart)
    run(command("torchrun", params_file, tmp_path, "parallel.ep=2", until=2))
    report = json.loads((tmp_path / "memory.json").read_text())
    assert report["layout"].startswith("tp1 pp1 ep2 dp2 zero0")
    one_rank = json.loads((one / "memory.json").read_text())["ranks"][0]
    for held in report["ranks"]:  # each rank holds half of the experts' weights, gradients and Adam moments
        assert held["params"] < one_rank["params"]
        for key in ("params", "grads", "optimizer"):
            assert held[key] == pytest.approx(report["predicted"][key], rel=0.01), (key, held, report["predicted"])


def test_expert_parallel_resumes_bit_exact_and_another_layout_starts_from_its_weights(expert_parallel, params_file,
                                                                                     tmp_path):
    from marin_study.trainer.checkpointer import load_weights
    one, two, run_dir = expert_parallel(1), expert_parallel(2), tmp_path / "run"
    shutil.copytree(two, run_dir)
    shutil.rmtree(run_dir / f"checkpoints/step-{EP_STEPS:08d}")
    result = run(command("torchrun", params_file, run_dir, *ep_settings(2)))
    assert "resumed from" in result.stderr and "step-00000010" in result.stderr
    check_same_run(run_dir, two, "resumed at step 10 with ep 2", steps=EP_STEPS)
    assert sorted(p.name for p in (run_dir / "checkpoints/step-00000020").glob("experts-*")) == \
        ["experts-000-of-002.pt", "experts-001-of-002.pt"]

    refused = run(command("alone", params_file, run_dir, f"train.steps={EP_STEPS + 2}"), check=False)  # at ZeRO 0
    assert refused.returncode == 2 and "needs ZeRO 1-3 on both sides" in refused.stderr
    assert f"--run-dir NEW_DIR --set train.init_from={run_dir}:{EP_STEPS}" in refused.stderr
    assert "Traceback" not in refused.stderr
    # the weights put back together: the ep 1 run's, up to the order of fp32 sums, which Adam's step turns into up to
    # ~3e-5 on the embeddings of rarely seen tokens (their gradients are tiny, so their order matters)
    joined, whole = load_weights(two / "checkpoints/step-00000020"), load_weights(one / "checkpoints/step-00000020")
    assert joined.keys() == whole.keys()
    for key in whole: torch.testing.assert_close(joined[key], whole[key], rtol=1e-4, atol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
    new = tmp_path / "new"
    run(command("alone", params_file, new, f"train.init_from={run_dir}:{EP_STEPS}", until=1))
    assert losses(new)[0] < losses(two)[0] - 0.5  # the trained weights, on one process without expert parallelism


def test_expert_parallel_checkpoints_resume_on_another_layout_through_a_universal_checkpoint(expert_parallel,
                                                                                              params_file, tmp_path):
    # ep 2 on two processes to ep 1 on one, and ep 1 to ep 2: each run goes on as the one trained at the new layout from
    # the start, up to the order of fp32 sums (1e-4, as for two processes resumed on one without experts: one process
    # adds its two micro-batches where two processes all-reduce them)
    for saved, now, launcher in ((2, 1, "alone"), (1, 2, "torchrun")):
        run_dir = tmp_path / f"ep{saved}-to-ep{now}"
        shutil.copytree(expert_parallel(saved), run_dir)
        shutil.rmtree(run_dir / f"checkpoints/step-{EP_STEPS:08d}")
        result = run(command(launcher, params_file, run_dir, *ep_settings(now)))
        assert f"ZeRO 1, ep {saved}) to a universal checkpoint" in result.stderr and "step-00000010" in result.stderr
        assert [r["step"] for r in MetricsLog(run_dir / "metrics.jsonl").read()] == list(range(1, EP_STEPS + 1))
        for key in ("loss", "moe/bias_norm", "moe/layer0/entropy"):
            assert losses(run_dir, key)[10:] == pytest.approx(losses(expert_parallel(now), key)[10:], rel=1e-4), key
        # its first step used the very weights the source run saved: only the order of the forward's sums differs
        assert losses(run_dir)[10] == pytest.approx(losses(expert_parallel(saved))[10], rel=1e-6)
        assert not list((run_dir / "checkpoints").glob(".universal-*"))  # the converted copy is gone


def test_expert_parallel_gradients_equal_one_process_holding_every_expert(params_file):
    result = run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()),
                  ROOT / "tests/expert_parallel_grads.py", params_file], check=False)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.count("largest gradient difference") == 2


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_from_a_run_a_step_a_checkpoint_or_an_export_gives_that_checkpoints_weights(reference, params_file,
                                                                                          tiny_export):
    from marin_study.config import load_params
    from marin_study.model import Transformer
    from marin_study.trainer.checkpointer import initial_weights, load_weights
    params, run_dir = load_params(params_file), reference(0)
    newest, second = (run_dir / "checkpoints" / checkpoint_name(s) for s in (STEPS, 2))
    expected = load_weights(newest)
    for spec in (run_dir, f"{run_dir}:{STEPS}", newest, tiny_export):  # the export was made from the newest checkpoint
        assert same_weights(initial_weights(str(spec), params), expected), spec
    early = initial_weights(f"{run_dir}:2", params)
    assert same_weights(early, load_weights(second)) and not same_weights(early, expected)
    trained, fresh = Transformer(params.model), Transformer(params.model)
    trained.load_state_dict(expected, strict=True)
    biases = [k for k in expected if k.endswith("balance_bias")]
    assert biases and any(expected[k].any() for k in biases)  # the balancing biases come with the weights
    assert all(torch.equal(trained.get_buffer(k), expected[k]) for k in biases)
    from marin_study.config import load_params
    from marin_study.data.mixture import make_loader
    batch = next(iter(make_loader(params)))  # the first batch, which the source run trained on
    with torch.no_grad():
        assert trained(batch[:, :-1], batch[:, 1:]).ce_loss < fresh(batch[:, :-1], batch[:, 1:]).ce_loss


def test_init_from_refuses_what_it_cannot_start_from(reference, params_file, tiny_export, tmp_path):
    from marin_study.config import load_params
    from marin_study.trainer.checkpointer import initial_weights
    from marin_study.trainer.processes import TrainError
    params, run_dir = load_params(params_file), reference(0)
    def refusal(spec, p=params) -> str:
        with pytest.raises(TrainError) as error: initial_weights(str(spec), p)
        assert f"train.init_from {str(spec)!r}" in str(error.value)
        return str(error.value)
    other = load_params(params_file, ["model.n_layers=2", "model.qk_norm=true"])
    assert "model.n_layers 4 there, 2 here; model.qk_norm False there, True here" in refusal(run_dir, other)
    assert "matches" in refusal(tiny_export, other)
    assert "does not exist" in refusal(tmp_path / "nowhere") and "no weights" in refusal("")
    assert "its steps are [2, 4, 6, 8]" in refusal(f"{run_dir}:7")
    assert "drop ':2'" in refusal(f"{tiny_export}:2")
    damaged = tmp_path / "damaged"
    shutil.copytree(run_dir / "checkpoints" / checkpoint_name(2), damaged / "checkpoints" / checkpoint_name(2))
    (damaged / "checkpoints" / checkpoint_name(2) / "trainer.json").write_text("torn")
    assert "verifies" in refusal(damaged) and "trainer.json" in refusal(damaged / "checkpoints" / checkpoint_name(2))
    (tmp_path / "empty/checkpoints").mkdir(parents=True)
    assert "holds no checkpoint" in refusal(tmp_path / "empty")
    record = json.loads((tiny_export / "marin_export.json").read_text())
    for name, change, words in [("moved", {"source_run": str(tmp_path / "gone")}, "no longer there"),
                                ("changed", {"checkpoint_manifest_sha256": "0" * 64}, "has changed since")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "marin_export.json").write_text(json.dumps({**record, **change}))
        assert words in refusal(tmp_path / name)


def test_train_init_from_starts_a_new_run_from_the_weights_and_resume_wins(reference, params_file, tmp_path):
    run_dir, source = tmp_path / "run", reference(0)
    run(command("alone", params_file, run_dir, f"train.init_from={source}", until=2))
    records = MetricsLog(run_dir / "metrics.jsonl").read()
    assert [r["step"] for r in records] == [1, 2]  # a new run: step 0, not the source's step 8
    assert records[0]["loss"] < (losses(source)[0] + losses(source)[-1]) / 2  # trained weights on the same first batch
    again = run(command("alone", params_file, run_dir, f"train.init_from={source}", until=4))
    assert "resumed from" in again.stderr and [r["step"] for r in MetricsLog(run_dir / "metrics.jsonl").read()] == [1, 2, 3, 4]


def test_muon_learns_splits_experts_resumes_bit_exact_and_holds_the_memory_the_planner_predicts(params_file, tmp_path):
    muon = ("train.optimizer=muon", "train.adam_lr=1e-3", "train.trackers=[]")
    straight, ep2, resumed = tmp_path / "straight", tmp_path / "ep2", tmp_path / "resumed"
    run(command("torchrun", params_file, straight, *muon))
    assert losses(straight)[-1] < losses(straight)[0] - 0.5
    run(command("torchrun", params_file, ep2, *muon, "parallel.ep=2"))
    assert losses(ep2) == pytest.approx(losses(straight), rel=1e-5)  # each expert orthogonalised on its own rank
    run(command("torchrun", params_file, resumed, *muon, until=4))
    result = run(command("torchrun", params_file, resumed, *muon))
    assert "resumed from" in result.stderr and "step-00000004" in result.stderr
    check_same_run(resumed, straight, "muon resumed at step 4")  # Muon's momentum and AdamW's moments come back whole
    report = json.loads((straight / "memory.json").read_text())
    for held in report["ranks"]:  # one momentum per hidden matrix: 4 bytes less per parameter than Adam's two moments
        for key in ("params", "grads", "optimizer"):
            assert held[key] == pytest.approx(report["predicted"][key], rel=0.01), (key, held, report["predicted"])


def test_a_capacity_logs_each_layers_drop_fraction_of_the_whole_expert_parallel_group(params_file, tmp_path):
    "ep 2 at capacity_factor 1: a rank whose experts get more than the group's mean share drops the rest."
    run(command("torchrun", params_file, tmp_path, "parallel.ep=2", "parallel.zero_stage=1", "model.capacity_factor=1.0",
                "train.steps=5", "train.eval_every=0", "train.checkpoint_every=5"))
    records = MetricsLog(tmp_path / "metrics.jsonl").read()
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        layers = [r[f"moe/layer{i}/drop_fraction"] for i in range(4)]
        assert all(0 <= d < 0.5 for d in layers) and r["moe/drop_fraction"] == pytest.approx(sum(layers) / 4)
    assert any(r["moe/drop_fraction"] > 0 for r in records)  # an untrained router is uneven between the two ranks


def test_document_mask_reaches_the_heldout_evaluation_and_the_training_loss(params_file):
    "Issue 36: evaluation and training run Transformer(params.model), so model.document_mask holds in both."
    import dataclasses
    from contextlib import nullcontext
    from marin_study.config import load_params
    from marin_study.model import Transformer
    from marin_study.trainer.evaluation import HeldOut
    p = load_params(params_file)
    masked = dataclasses.replace(p, model=dataclasses.replace(p.model, document_mask=True))
    heldout = HeldOut(masked, samples=4, rank=0, world_size=1)
    window_BW = next(iter(heldout.windows.values()))[0].clamp(min=0)
    assert (window_BW[:, 0] == p.model.eod_id).any()  # a document's first window starts after the end of the one before
    results = {}
    for params in (p, masked):
        torch.manual_seed(0)
        model = Transformer(params.model)
        with torch.no_grad():
            results[params.model.document_mask] = (heldout.evaluate(model, 2, nullcontext(), torch.device("cpu"))["eval/loss"],
                                                   model(window_BW[:, :-1], window_BW[:, 1:]).loss.item())
    assert results[True][0] != results[False][0] and results[True][1] != results[False][1]
