import json
import os

from marin_study.trainer.checkpoint import Checkpoints, checkpoint_name, verify, write_manifest
from marin_study.trainer.metrics import MetricsLog


def save(ckpts, step, payload=b"weights"):
    folder = ckpts.begin(step)
    (folder / "model").mkdir()
    (folder / "model/shard0.pt").write_bytes(payload + bytes([step % 256]))
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    return ckpts.commit(step)


def test_a_committed_checkpoint_verifies_and_a_torn_one_is_skipped(tmp_path):
    ckpts = Checkpoints(tmp_path / "checkpoints", keep=5)
    for step in (1, 2, 3): save(ckpts, step)
    assert verify(ckpts.root / checkpoint_name(3)) is None
    torn = ckpts.root / checkpoint_name(4)  # a crash between writing files and writing the manifest
    torn.mkdir()
    (torn / "trainer_state.json").write_text("{}")
    (ckpts.root / checkpoint_name(3) / "model/shard0.pt").write_bytes(b"truncated")
    good, skipped = ckpts.latest()
    assert good == ckpts.root / checkpoint_name(2)
    assert "no MANIFEST.json" in skipped[0] and "shard0.pt has 9 bytes" in skipped[1]


def test_missing_file_and_bad_manifest_are_reported(tmp_path):
    ckpts = Checkpoints(tmp_path / "c")
    folder = save(ckpts, 7)
    os.remove(folder / "trainer_state.json")
    assert verify(folder) == "trainer_state.json is missing"
    (folder / "MANIFEST.json").write_text("{not json")
    assert verify(folder) == "MANIFEST.json is not valid JSON"
    assert ckpts.latest() == (None, [f"{folder}: MANIFEST.json is not valid JSON; skipped"])


def test_an_unfinished_save_never_replaces_a_good_checkpoint(tmp_path):
    ckpts = Checkpoints(tmp_path / "c")
    save(ckpts, 5, b"good")
    staging = ckpts.begin(5)  # the same step saved again, killed before commit
    (staging / "model").mkdir()
    (staging / "model/shard0.pt").write_bytes(b"half")
    good, _ = ckpts.latest()
    assert good.name == checkpoint_name(5) and (good / "model/shard0.pt").read_bytes().startswith(b"good")
    assert ckpts.steps() == [5]


def test_rotation_keeps_the_last_rolling_ones_and_every_permanent_one(tmp_path):
    ckpts = Checkpoints(tmp_path / "c", keep=2, permanent_every=100)
    for step in range(50, 501, 50): save(ckpts, step)
    assert ckpts.steps() == [100, 200, 300, 350, 400, 450, 500]


def test_manifest_covers_nested_files(tmp_path):
    (tmp_path / "a/b").mkdir(parents=True)
    (tmp_path / "a/b/c.bin").write_bytes(b"x")
    entries = json.loads(write_manifest(tmp_path).read_text())
    assert set(entries) == {"a/b/c.bin"} and entries["a/b/c.bin"]["bytes"] == 1


def test_metrics_log_truncates_back_to_a_checkpoint(tmp_path):
    log = MetricsLog(tmp_path / "run/metrics.jsonl")
    for step in range(3): log.write({"step": step, "loss": 1.0 / (step + 1)})
    offset = log.offset()
    for step in range(3, 6): log.write({"step": step, "loss": 0.1})
    log.truncate(offset)
    assert [r["step"] for r in log.read()] == [0, 1, 2]
    log.write({"step": 3, "loss": 0.2})
    assert [r["step"] for r in log.read()] == [0, 1, 2, 3]


def test_metrics_log_drops_a_torn_last_line(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (1, 2): log.write({"step": step})
    with open(log.path, "a") as f: f.write('{"step": 3, "lo')  # the run was killed while writing step 3
    assert [r["step"] for r in log.read()] == [1, 2]
