"The marin-study command: real output on good input, a clear error and exit 2 (never a traceback) on bad input."
import json

import yaml

from conftest import BIN, ROOT, run
from marin_study.config import load_params


def test_params_show_prints_the_validated_config_and_accounting():
    out = run(["marin-study", "params", "show", "params/marin-535b-a23b.yaml"]).stdout
    assert yaml.safe_load(out)["model"]["n_experts"] == 384
    assert "535.31B total" in out and "22.76B without embedding and head" in out and "18.01T" in out


def test_params_show_applies_overrides_and_round_trips(tmp_path):
    out = run(["marin-study", "params", "show", "params/tiny.yaml", "--set", "train.lr=3e-4", "--set", "train.steps=9"]).stdout
    (tmp_path / "shown.yaml").write_text(out)
    shown = load_params(tmp_path / "shown.yaml")
    assert shown.train.lr == 3e-4 and shown.train.steps == 9
    assert shown == load_params(ROOT / "params/tiny.yaml", ["train.lr=3e-4", "train.steps=9"])


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path):
    cases = {
        ("params/tiny.yaml", "--set", "train.stpes=9"): "did you mean 'train.steps'?",
        ("params/tiny.yaml", "--set", "model.top_k=99"): "model.top_k: 99 is not between 1 and n_experts",
        ("no/such.yaml",): "no/such.yaml: (file): does not exist",
    }
    (tmp_path / "broken.yaml").write_text("model:\n  vocab_size: [1\n")
    cases[(str(tmp_path / "broken.yaml"),)] = "not valid YAML"
    for args, words in cases.items():
        result = run(["marin-study", "params", "show", *args], check=False)
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""


def test_usage_errors_from_argparse():
    result = run(["marin-study", "params"], check=False)
    assert result.returncode == 2 and "usage: marin-study params" in result.stderr


def test_paths_with_a_space_and_non_ascii_characters_work(params_file, tmp_path):
    folder = tmp_path / "dir with space/é"
    folder.mkdir(parents=True)
    params = folder / "tiny é.yaml"
    params.write_text(params_file.read_text())
    node = folder / "node é.yaml"
    node.write_text((ROOT / "params/node.yaml").read_text())
    assert "the planner's ranking of every layout on 8 GPUs" in run(["marin-study", "plan", node]).stdout
    assert yaml.safe_load(run(["marin-study", "params", "show", params]).stdout)["train"]["steps"] > 2
    script = run(["marin-study", "launch", "slurm", params, "--dry-run", "--run-dir", folder / "slurm run"]).stdout
    assert f'#SBATCH "--output={folder}/slurm run/slurm/%x-%j.out"' in script and not (folder / "slurm run").exists()
    out = run(["marin-study", "train", params, "--run-dir", folder / "run", "--set", "train.steps=2"]).stdout
    assert f"step 2: loss" in out and f"metrics in {folder}/run/metrics.jsonl" in out
    assert [r["step"] for r in map(json.loads, (folder / "run/metrics.jsonl").read_text().splitlines())] == [1, 2]


def fake_sinfo(folder, script: str) -> dict:
    "The environment of a command that meets `script` as sinfo (and no other Slurm command)."
    folder.mkdir()
    (folder / "sinfo").write_text("#!/bin/sh\n" + script)
    (folder / "sinfo").chmod(0o755)
    return {"PATH": f"{folder}:{BIN}:/usr/bin:/bin"}


def test_a_dry_run_checks_the_partition_where_slurm_answers_and_says_when_it_could_not(tmp_path):
    dry = ["marin-study", "launch", "slurm", "params/tiny.yaml", "--dry-run", "--set"]
    answers = fake_sinfo(tmp_path / "answers", 'printf "debug*\\ngpu\\n"\n')
    assert run(dry + ["launch.partition=gpu"], env=answers).stderr == ""
    refused = run(dry + ["launch.partition=h100"], env=answers, check=False)
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr == (
        "marin-study: error: params/tiny.yaml: launch.partition 'h100' does not exist; this cluster has debug, gpu "
        "(set launch.partition to one of them)\n")
    down = fake_sinfo(tmp_path / "down", 'echo "slurm_load_partitions: Unable to contact slurm controller" >&2; exit 1\n')
    noted = run(dry + ["launch.partition=h100"], env=down)
    assert noted.stdout.startswith("#!/bin/bash") and noted.stderr == (
        "marin-study: note: launch.partition 'h100' was not checked, no Slurm answers here "
        "(sinfo: slurm_load_partitions: Unable to contact slurm controller)\n")
    assert "no Slurm answers here (sinfo is not on PATH)" in run(dry + ["launch.partition=h100"], env={"PATH": str(BIN)}).stderr
