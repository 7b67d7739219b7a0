"""marin-study doctor: the real checks on this machine, and the failures a run would meet, injected for real where the
machine allows (a read-only mount, a small tmpfs) and faked in-process only where it does not."""
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, run
from marin_study.config import load_params
from marin_study import doctor
from marin_study.doctor import check_bf16, check_run_dir, check_shards, checkpoint_bytes, checkpoints_held

DOCTOR = [sys.executable, "-c", "import sys; from marin_study.cli import main; sys.exit(main())", "doctor"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    "data.out_dir holding random train shards in the packed layout, enough for the tiny preset's loader."
    tiny, out = load_params(ROOT / "params/tiny.yaml"), tmp_path_factory.mktemp("data")
    folder, rng, tokens = out / "shards/train", np.random.default_rng(0), 200_000
    folder.mkdir(parents=True)
    domains = list(tiny.data.phases[0].weights)
    for domain in domains:
        rng.integers(1, tiny.model.vocab_size, tokens, dtype=np.uint16).tofile(folder / f"{domain}.bin")
        np.save(folder / f"{domain}.idx.npy", np.arange(0, tokens + 1, 1000, dtype=np.int64))
    from tokenizers import Tokenizer, models
    from marin_study.data.tokens import tokenizer_sha256
    tokenizer = Tokenizer(models.BPE())  # any tokenizer: the shards record its hash, as a pack does
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True))
    (folder / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": tiny.model.vocab_size, "eod_id": 0,
                                                  "tokenizer_sha256": tokenizer_sha256(tokenizer),
                                                  "max_token_id": tiny.model.vocab_size - 1,
                                                  "domains": {d: {"tokens": tokens} for d in domains}}))
    return out


def tiny_with(out_dir) -> object:
    tiny = load_params(ROOT / "params/tiny.yaml")
    return dataclasses.replace(tiny, data=dataclasses.replace(tiny.data, out_dir=str(out_dir)))


@contextlib.contextmanager
def tmpfs(path, options: str):
    "A real tmpfs mounted at `path` (root only); skips the test where mounting is not permitted."
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root and CAP_SYS_ADMIN")
    try: yield path
    finally: subprocess.run(["umount", str(path)], check=True)


def by_name(result: dict) -> dict:
    return {c["name"]: c for c in result["checks"]}


def test_doctor_on_this_machine_passes_with_json_and_a_table(shards, tmp_path):
    out = run([*DOCTOR, "params/tiny.yaml", "--set", f"data.out_dir={shards}", "--run-dir", str(tmp_path / "run"),
               "--json"], check=False, timeout=120)
    result = json.loads(out.stdout)  # nothing else on stdout
    checks = by_name(result)
    assert out.returncode == 0 and result["ok"], out.stdout + out.stderr[-2000:]
    assert all(c["status"] in ("ok", "warn", "fail") and c["detail"] for c in result["checks"])
    for name in ("python", "packages", "torch", "gpus", "bf16", "deepspeed", "all-reduce", "run folder", "disk space",
                 "write speed", "cache folders", "shards", "loader"):
        assert checks[name]["status"] == "ok", checks[name]
    assert "GB/s" in checks["all-reduce"]["detail"] and "samples/s" in checks["loader"]["detail"]
    assert "41.4 MB" in checks["disk space"]["detail"] and not (tmp_path / "run").exists()  # judged, not created
    assert checks["slurm"]["status"] in ("ok", "warn")
    if not shutil.which("nvidia-smi"):
        assert checks["gpus"]["detail"].startswith("none") and "gloo" in checks["all-reduce"]["detail"]
    text = run([*DOCTOR, "params/tiny.yaml", "--set", f"data.out_dir={shards}", "--run-dir", str(tmp_path)], timeout=120)
    assert text.stdout.startswith("ok    python") and "Traceback" not in text.stderr


def test_a_read_only_run_folder_and_missing_shards_fail_with_their_fixes(tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        with pytest.raises(OSError): (ro / "probe").write_text("root writes here only if the mount is not read-only")
        out = run([*DOCTOR, "params/tiny.yaml", "--set", f"data.out_dir={tmp_path / 'empty'}", "--run-dir",
                   str(ro / "run"), "--json"], check=False, timeout=120)
    checks = by_name(json.loads(out.stdout))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert checks["run folder"]["status"] == "fail" and "Read-only file system" in checks["run folder"]["detail"]
    assert "writable" in checks["run folder"]["fix"]
    assert checks["shards"]["status"] == "fail" and "no meta.json" in checks["shards"]["detail"]
    assert "dvc repro pack" in checks["shards"]["fix"] and "marin-study data" in checks["shards"]["fix"]
    assert checks["python"]["status"] == "ok"  # the other checks still answer


def test_missing_or_truncated_shards_fail(shards, tmp_path):
    assert [c.status for c in check_shards(tiny_with(shards))] == ["ok", "ok"]
    assert [c.status for c in check_shards(tiny_with(tmp_path))] == ["fail", "fail"]
    broken = tmp_path / "broken"
    shutil.copytree(shards / "shards", broken / "shards")
    shutil.copy(shards / "tokenizer.json", broken / "tokenizer.json")  # the shards' own tokenizer: only a shard is lost
    (broken / "shards/train/web.bin").unlink()
    found = check_shards(tiny_with(broken), "params/tiny.yaml")
    assert found[0].status == "fail" and "web.bin" in found[0].detail and "pack params/tiny.yaml" in found[0].fix


def test_a_disk_too_small_for_the_checkpoints_fails(tmp_path):
    tiny = load_params(ROOT / "params/tiny.yaml")
    need = checkpoint_bytes(tiny) * checkpoints_held(tiny)
    assert need > 100e6  # 7 checkpoints of 41.4 MB (Muon keeps one moment)
    with tmpfs(tmp_path / "small", "size=8m") as small:
        writable, space, speed = check_run_dir(small / "run", tiny)
        assert list(small.iterdir()) == []  # the probe is gone
    assert writable.status == "ok" and speed.status in ("ok", "warn")
    assert space.status == "fail" and "289.6 MB" in space.detail and "--run-dir" in space.fix


def test_a_disk_too_small_faked_in_process(tmp_path, monkeypatch):
    "Where no tmpfs can be mounted: statvfs says 10 MB free, so the write probe stays small too."
    real = os.statvfs(tmp_path)
    fake = os.statvfs_result((4096, 4096, 2560, 2560, 2560, *real[5:]))
    monkeypatch.setattr(os, "statvfs", lambda path: fake)
    writable, space, _ = check_run_dir(tmp_path, load_params(ROOT / "params/tiny.yaml"))
    assert writable.status == "ok" and space.status == "fail" and space.detail.startswith("10.5 MB free")


def test_bad_params_are_one_line_not_a_traceback():
    out = run([*DOCTOR, "no/such.yaml"], check=False, timeout=120)
    assert out.returncode == 2 and "no/such.yaml: (file): does not exist" in out.stderr and "Traceback" not in out.stderr


def test_bf16_params_on_a_cpu_that_would_emulate_it_get_a_warning_and_the_fix(monkeypatch):
    import torch
    if torch.cuda.is_available(): pytest.skip("on a GPU machine the GPU answers for bf16, not the CPU")
    small, tiny = load_params(ROOT / "params/small.yaml"), load_params(ROOT / "params/tiny.yaml")
    monkeypatch.setattr(doctor, "cpu_bf16", lambda: None)  # a CPU without AMX or AVX512_BF16 (an AMD EPYC of CI's kind)
    warned = check_bf16(small)
    assert warned.status == "warn" and "emulated" in warned.detail and "train.dtype=float32" in warned.fix
    assert check_bf16(tiny).status == "ok"  # the CPU preset trains in fp32 already
