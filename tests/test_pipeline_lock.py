"dvc.lock is current with the committed code: every stage's code and params are what the lock records."
import json
import shutil

import pytest
import yaml
from conftest import ROOT, run


def tracked(path: str) -> bool:
    return bool(run(["git", "ls-files", "--", path]).stdout.strip())


def stale_entries() -> list[str]:
    "Code and params deps, and git-tracked outputs, that differ from dvc.lock; built data and missing outputs don't count."
    status = json.loads(run(["dvc", "status", "--json"]).stdout or "{}")
    problems = []
    for stage, changes in status.items():
        for change in changes:
            if not isinstance(change, dict): continue
            for path, what in change.get("changed deps", {}).items():
                if isinstance(what, dict):  # a params file: {key: 'modified' | 'new' | 'deleted'}
                    problems += [f"stage '{stage}': params {path}:{key} is {how}" for key, how in what.items()]
                elif tracked(path):
                    problems.append(f"stage '{stage}': code dependency {path} is {what}")
            for path, what in change.get("changed outs", {}).items():
                if what == "modified" and tracked(path):
                    problems.append(f"stage '{stage}': committed output {path} is not the one dvc.lock records")
    return problems


def test_dvc_lock_records_the_committed_code_params_and_metrics():
    problems = stale_entries()
    assert not problems, ("dvc.lock is stale; run `dvc repro` and commit dvc.lock with its metrics:\n  "
                          + "\n  ".join(problems))


def test_the_first_dvc_repro_on_a_fresh_cache_leaves_data_dvc_as_committed(tmp_path):
    "DVC saves data.dvc again when it first verifies the corpus; what it writes must be what is committed."
    if not (ROOT / "data").is_dir():
        pytest.skip("data/ is not built here: ./install.sh builds it")
    for name in ("data.dvc", ".dvc/config", ".dvc/.gitignore"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "data", tmp_path / "data")
    run(["git", "init", "-q"], cwd=tmp_path)
    committed = (ROOT / "data.dvc").read_text()
    run(["dvc", "repro", "data.dvc"], cwd=tmp_path)
    rewritten = (tmp_path / "data.dvc").read_text()
    if yaml.safe_load(rewritten)["outs"] == yaml.safe_load(committed)["outs"]:  # the corpus here is the pinned one
        assert rewritten == committed, "commit data.dvc as DVC writes it (its quoting), or a fresh clone's repro changes it"
    else:  # another corpus: DVC records its hash, and the pin's notes and source versions survive
        assert rewritten.split("meta:")[1] == committed.split("meta:")[1]
