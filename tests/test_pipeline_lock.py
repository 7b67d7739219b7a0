"dvc.lock is current with the committed code: every stage's code and params are what the lock records."
import json

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
