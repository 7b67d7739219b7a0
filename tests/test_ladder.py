"The ladder trains: small.yaml fits the shipped corpus, node.yaml's layout runs on 2 CPU processes, node.yaml launches."
import json
import math

import pytest

from conftest import BIN, ROOT, command, run
from marin_study.config import load_params, save_params
from marin_study.trainer.metrics import MetricsLog


def marin(*args, **kw):
    return run([BIN / "marin-study", *map(str, args)], **kw)


def test_small_fits_the_shipped_corpus_at_its_steps():
    "small.yaml's run (train.steps x global_batch windows of seq_len) repeats no domain past data.max_epochs."
    from marin_study.data.corpus import DataError
    from marin_study.data.mixture import Mixture
    from marin_study.data.tokens import shard_dir, shard_meta
    small = load_params(ROOT / "params/small.yaml")
    tiny = load_params(ROOT / "params/tiny.yaml")  # the data stages (dvc.yaml) build runs/data with tiny.yaml
    assert small.data.out_dir == tiny.data.out_dir and small.model.vocab_size == tiny.model.vocab_size
    shards = shard_dir(small)
    if not (shards / "meta.json").is_file():
        pytest.skip(f"no token shards in {shards}: run `dvc repro pack` (the main job) first")
    assert shard_meta(shards)["vocab_size"] == small.model.vocab_size  # the tokenizer the pipeline trained
    t = small.train
    mixture = Mixture(small.data, shards, t.seq_len, t.global_batch)
    epochs = mixture.check_epochs(t.steps * t.global_batch)  # the trainer's own check: raises past data.max_epochs
    assert set(epochs) == set(small.data.mixture) and max(epochs.values()) <= small.data.max_epochs
    with pytest.raises(DataError, match="more than data.max_epochs"):  # the check would catch a run twice as long
        mixture.check_epochs(2 * t.steps * t.global_batch)


def test_small_plans_on_its_gpu():
    out = marin("plan", "params/small.yaml", timeout=300).stdout
    assert "1 x h100" in out and "tp1 pp1 ep1 dp1" in out


# node.yaml at test size: widths, vocabulary, batch and steps, float32, ep and the launch section (the test says why).
NODE_ON_TWO_CPUS = [
    "model.vocab_size=2048",      # the test corpus's tokenizer (conftest `pipeline`)
    "model.hidden_size=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=1", "model.head_dim=16",
    "model.n_experts=8", "model.top_k=2", "model.expert_ffn=32", "model.shared_ffn=32", "model.latent_dim=32",
    "model.sliding_window=32",
    "train.steps=8", "train.global_batch=8", "train.micro_batch=2", "train.seq_len=64", "train.dtype=float32",
    "parallel.ep=2",              # 8 -> 2: expert parallelism over the 2 processes there are
    "launch.procs_per_node=2", "launch.gpus_per_node=0", "launch.device=cpu",
]


def test_node_layout_trains_on_two_cpu_processes(pipeline, tmp_path):
    """node.yaml's layout (expert parallel, ZeRO 2, selective recompute) trained for 8 steps by 2 CPU processes.

    What changed from node.yaml, and why: the widths (hidden 1536 -> 64, 24 -> 4 layers, 12/3 -> 4/1 heads of 16,
    128 experts top-8 -> 8 top-2, expert, shared and latent widths 768 -> 32, window 2048 -> 32), so that a step takes
    a fraction of a second; the vocabulary (128,256 -> 2,048, the test corpus's tokenizer: the shards would not fit
    the model otherwise); the batch (256 x 4096 in micro-batches of 4 -> 8 x 64 in micro-batches of 2) and 8 steps;
    float32 (autocast to bf16 is slow on a CPU without bf16 units); parallel.ep 8 -> 2 and the launch section (8 H100s -> 2 CPU
    processes), since there are 2 processes; the data folders, the test corpus's. Kept: ZeRO stage 2, selective
    activation recompute, the schedule, lr, clipping, and every routing default node.yaml relies on."""
    raw = pipeline["params"].data
    params = load_params(ROOT / "params/node.yaml", NODE_ON_TWO_CPUS + [f"data.dir={raw.dir}", f"data.out_dir={raw.out_dir}"])
    node = load_params(ROOT / "params/node.yaml")
    assert (params.parallel.zero_stage, params.parallel.activation_checkpointing) == (2, "selective")
    assert (node.parallel.zero_stage, node.parallel.activation_checkpointing) == (2, "selective")
    path = save_params(params, tmp_path / "node-on-2-cpus.yaml")
    run(command("torchrun", path, tmp_path / "run"), timeout=300)
    records = MetricsLog(tmp_path / "run/metrics.jsonl").read()
    assert [r["step"] for r in records] == list(range(1, 9))
    loss = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in loss) and loss[-1] < loss[0] - 0.05, loss  # 7.64 -> 7.50 here
    assert math.isfinite(records[-1]["eval/bpb"])
    layout = json.loads((tmp_path / "run/memory.json").read_text())["layout"]
    assert layout == "tp1 pp1 ep2 dp2 zero2 mb2 selective", layout


def test_node_launches_without_a_refusal(tmp_path):
    "The docs' submit example, dry: node.yaml renders an sbatch script and no warning (the trainer runs its layout)."
    result = marin("launch", "slurm", "params/node.yaml", "--dry-run", timeout=300)  # as docs/planning-and-launch.md writes it
    assert result.stdout.startswith("#!/bin/bash\n") and "#SBATCH --gpus-per-node=8" in result.stdout
    assert "warning" not in result.stderr, result.stderr
    (tmp_path / "sbatch.sh").write_text(result.stdout)
    run(["bash", "-n", tmp_path / "sbatch.sh"])  # it parses
