"Trackers (train.trackers) as a run logs them: each one installed here, offline, read back against metrics.jsonl."
import importlib.util
import json
import struct
from pathlib import Path

import pytest

from conftest import command, run
from marin_study.trainer.metrics import PEAK_TFLOPS, STEP, MetricsLog


def logged(run_dir: Path) -> dict:
    "{name: {step: value}} of every number in metrics.jsonl: the curves, so not the peak a start notes once."
    values = {}
    for record in MetricsLog(run_dir / "metrics.jsonl").read():
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in (STEP, PEAK_TFLOPS):
                values.setdefault(key, {})[record[STEP]] = value
    return values


def tensorboard_values(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {key: {e.step: e.value for e in events.Scalars(key)} for key in events.Tags()["scalars"]}


def wandb_values(run_dir: Path) -> dict:
    "The history in W&B's offline log: LevelDB-style blocks of 32 KiB, records of protobuf after a 7-byte header each."
    from wandb.proto import wandb_internal_pb2
    values = {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, record = path.read_bytes(), 7, b""  # the file starts with "W&B", a magic number and a version
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            record, pos = record + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or the last piece of one
                parsed = wandb_internal_pb2.Record()
                parsed.ParseFromString(record)
                record = b""
                if parsed.WhichOneof("record_type") == "history":
                    items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in parsed.history.item}
                    for key, value in items.items():
                        if not key.startswith("_"): values.setdefault(key, {})[items["_step"]] = value
    return values


def mlflow_values(run_dir: Path) -> dict:
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    return {key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in client.get_run(run_id).data.metrics}


def test_tensorboard_is_on_by_default_with_the_metrics_names_and_values(reference):
    run_dir = reference(0)  # a run with the default params: no tracker asked for
    expected, found = logged(run_dir), tensorboard_values(run_dir)
    assert set(found) == set(expected) and {"loss", "eval/bpb", "moe/layer0/max_load"} <= set(found)
    for key, by_step in expected.items():
        assert found[key] == pytest.approx(by_step, rel=1e-6), key  # TensorBoard keeps float32


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_an_optional_tracker_logs_offline_and_reads_back(tracker, params_file, tmp_path):
    if importlib.util.find_spec(tracker) is None:
        pytest.skip(f"{tracker} is not installed here (optional: pip install {tracker})")
    run_dir = tmp_path / "run"
    run(command("alone", params_file, run_dir, f"train.trackers=[{tracker}]", until=2),
        env={"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": ""})  # no network, whatever this machine's settings
    assert not (run_dir / "tensorboard").exists()
    found = {"wandb": wandb_values, "mlflow": mlflow_values}[tracker](run_dir)
    assert found == logged(run_dir) and {"loss", "lr", "grad_norm"} <= set(found)


def test_a_tracker_this_machine_lacks_is_refused_before_any_process_starts(params_file, tmp_path):
    missing = [t for t in ("wandb", "mlflow") if importlib.util.find_spec(t) is None]
    if not missing: pytest.skip("every tracker is installed here")
    result = run(command("alone", params_file, tmp_path / "run", f"train.trackers=[tensorboard, {missing[0]}]"), check=False)
    assert result.returncode == 2 and f"pip install {missing[0]}" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
