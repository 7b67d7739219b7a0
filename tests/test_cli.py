"The marin-study command: real output on good input, a clear error and exit 2 (never a traceback) on bad input."
import argparse
import ast
import json
import re
import time
from pathlib import Path

import pytest
import yaml

from conftest import BIN, ROOT, run
from marin_study.cli import parser
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
    # run again at its last step, or with --until behind it: nothing to do, said in one line, and nothing touched
    before = {name: (folder / "run" / name).read_bytes() for name in ("metrics.jsonl", "run_card.json", "RUN_CARD.md")}
    for more in ([], ["--until", "1"]):
        again = run(["marin-study", "train", params, "--run-dir", folder / "run", "--set", "train.steps=2", *more], cwd=tmp_path)
        assert again.stdout == f"marin-study: nothing to do: {folder}/run is at step 2 of 2{' (--until 1)' if more else ''}\n"
        assert again.stderr == "" and {n: (folder / "run" / n).read_bytes() for n in before} == before


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


OTHER_TOOLS = re.compile(r"(pip install|docker run|python -m ipykernel install|nbdev_test|dvc [a-z]+|sbatch|torchrun)[^;`)]*")


def subcommands(ap, prefix=()) -> dict[str, argparse.ArgumentParser]:
    "Every subcommand of the parser, by its words ('train', 'data pack', ...)."
    found = {}
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[" ".join(prefix + (name,))] = sub
                found.update(subcommands(sub, prefix + (name,)))
    return found


def error_texts(path: Path):
    "The text of each error, refusal or fix the module raises or says, with '{}' where a value is filled in."
    def text(node) -> str:
        if isinstance(node, ast.JoinedStr): return "".join(text(v) if isinstance(v, ast.Constant) else "{}" for v in node.values)
        if isinstance(node, ast.Constant) and isinstance(node.value, str): return node.value
        return " ".join(text(child) for child in ast.iter_child_nodes(node))
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        name = getattr(getattr(node, "func", None), "id", getattr(getattr(node, "func", None), "attr", ""))
        if isinstance(node, ast.Raise) or name.endswith("Error") or name in ("_fail", "say", "Problem", "Check"):
            yield text(node)


def test_every_command_and_flag_that_an_error_names_exists():
    commands = subcommands(parser())
    flags = {words: {s for a in sub._actions for s in a.option_strings} for words, sub in commands.items()}
    wrong = []
    for path in sorted((ROOT / "marin_study").rglob("*.py")):
        for message in error_texts(path):
            for m in re.finditer(r"marin-study ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?([^`;)]*)", message):
                words = f"{m[1]} {m[2]}" if f"{m[1]} {m[2]}" in commands else m[1]
                if words not in commands: wrong.append(f"{path.name}: no command '{words}': {m[0]!r}")
                else: wrong += [f"{path.name}: `{words}` has no {f}: {m[0]!r}" for f in re.findall(r"(?<![\w-])--[a-z][a-z-]*", m[3])
                                if f not in flags[words]]
            every = set().union(*flags.values())
            wrong += [f"{path.name}: no command has {f}: {message[:120]!r}"
                      for f in re.findall(r"(?<![\w-])--[a-z][a-z-]*", OTHER_TOOLS.sub("", message)) if f not in every]
    assert not wrong, "\n".join(wrong)


def test_version_help_and_a_mistyped_command():
    from marin_study import __version__
    assert run(["marin-study", "--version"]).stdout.strip() == f"marin-study {__version__}"
    bare = run(["marin-study"], check=False)  # no command: the list of commands, not an error
    assert bare.returncode == 0 and "usage: marin-study" in bare.stdout and "train" in bare.stdout and "error" not in bare.stderr
    for args, close in ((["trian"], "train"), (["data", "clen", "params/tiny.yaml"], "clean"), (["exprot"], "export")):
        result = run(["marin-study", *args], check=False)
        assert result.returncode == 2 and result.stderr.splitlines()[-1].endswith(f"did you mean '{close}'?"), result.stderr


def test_every_option_with_a_default_shows_it_in_help():
    for words, sub in {"": parser(), **subcommands(parser())}.items():
        shown = sub.format_help()  # renders every help string: a stray % would raise here
        for action in sub._actions:
            nothing = action.default is None or action.default is False or action.default is argparse.SUPPRESS or action.default == []
            if nothing or not action.option_strings: continue  # an off switch, no default, or a positional
            assert "default" in (action.help or ""), f"marin-study {words} {action.option_strings[0]}: its default is not in --help"
        assert "%(default)s" not in shown
    assert "(default: 5GB)" in run(["marin-study", "export", "--help"]).stdout


def test_an_export_given_a_checkpoint_folder_names_the_run_folder(tmp_path):
    from marin_study.trainer.checkpoint import checkpoint_name
    (tmp_path / "run/checkpoints" / checkpoint_name(40)).mkdir(parents=True)
    for given in ("run/checkpoints", f"run/checkpoints/{checkpoint_name(40)}"):
        result = run(["marin-study", "export", tmp_path / given, "--out", tmp_path / "e"], check=False)
        assert result.returncode == 2 and "checkpoints/checkpoints" not in result.stderr, result.stderr
        assert f"give the run folder: marin-study export {tmp_path / 'run'}" in result.stderr, result.stderr
    missing = run(["marin-study", "export", tmp_path / "none", "--out", tmp_path / "e"], check=False)
    assert missing.returncode == 2 and "--run-dir a run" not in missing.stderr and not (tmp_path / "e").exists()


def tree(folder: Path) -> dict:
    "Every file and folder under `folder`, with the bytes of each file: what a refused command must leave as it was."
    return {p.relative_to(folder): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


# refusals a newcomer meets in the first minutes: each before torch, DeepSpeed and transformers are imported
QUICK = {
    "a missing params file": (["train", "params/missing.yaml", "--run-dir", "{d}/run"], "params/missing.yaml: (file): does not exist"),
    "a value of the wrong type": (["train", "params/tiny.yaml", "--set", "train.lr=abc", "--run-dir", "{d}/run"], "train.lr"),
    "a mistyped key": (["train", "params/tiny.yaml", "--set", "train.stpes=9", "--run-dir", "{d}/run"], "did you mean 'train.steps'?"),
    "--until 0": (["train", "params/tiny.yaml", "--run-dir", "{d}/run", "--until", "0"], "--until"),
    "no packed data": (["train", "params/tiny.yaml", "--run-dir", "{d}/run", "--set", "data.out_dir={d}/none"],
                       "no meta.json; run `marin-study data pack params/tiny.yaml` first"),
    "a missing prompts file": (["generate", "{d}/export", "--prompts", "{d}/none.jsonl", "--out", "{d}/out.jsonl"],
                               "{d}/none.jsonl: no such prompts file"),
    "a prompts file with bad lines": (["generate", "{d}/export", "--prompts", "{d}/bad.jsonl", "--out", "{d}/out.jsonl"],
                                      "{d}/bad.jsonl: 2 bad lines"),
    "--max-new-tokens 0": (["generate", "{d}/export", "--prompt", "Once", "--max-new-tokens", "0"], "--max-new-tokens: 0 is below 1"),
    "batch: a prompts file with bad lines": (["batch", "{d}/bad.jsonl", "--endpoint", "http://127.0.0.1:9/v1", "--out", "{d}/out.jsonl"],
                                             "{d}/bad.jsonl: 2 bad lines"),
}


@pytest.mark.parametrize("name", QUICK)
def test_a_bad_start_is_refused_within_two_seconds_and_writes_nothing(name, tmp_path):
    args, words = QUICK[name]
    (tmp_path / "bad.jsonl").write_text('{"id": 1, "prompt": "a"}\nnot json\n{"id": 1, "prompt": "b"}\n')
    before, start = tree(tmp_path), time.perf_counter()
    result = run(["marin-study", *(a.replace("{d}", str(tmp_path)) for a in args)], check=False)
    took = time.perf_counter() - start
    errors = [line for line in result.stderr.splitlines() if line.startswith("marin-study: error:")]
    assert result.returncode == 2 and len(errors) == 1 and words.replace("{d}", str(tmp_path)) in errors[0], result.stderr
    assert tree(tmp_path) == before and result.stdout == ""  # no run folder, no lock file, no output file
    assert took < 2, f"refused after {took:.1f} s"


def test_a_second_trainer_is_refused_at_once_and_the_data_is_found_from_any_folder(tmp_path):
    "Run from outside the repository, the params' data is the project's; the lock refuses in a fraction of a second."
    from marin_study.trainer.processes import RunLock
    if not (ROOT / "runs/data/shards/train/meta.json").is_file(): pytest.skip("no packed data in runs/data (install.sh packs it)")
    held = RunLock(tmp_path / "run").acquire()
    before, start = tree(tmp_path), time.perf_counter()
    result = run(["marin-study", "train", ROOT / "params/tiny.yaml", "--run-dir", tmp_path / "run"], cwd=tmp_path, check=False)
    took, after = time.perf_counter() - start, tree(tmp_path)
    held.release()
    assert result.returncode == 2 and f"{tmp_path / 'run'} is in use by the trainer with PID" in result.stderr, result.stderr
    assert after == before and took < 2, took
    assert tree(tmp_path) == {}  # a lock that was never used leaves no folder behind


def test_the_data_paths_of_a_params_file_are_its_projects():
    "data.dir and data.out_dir in a file are relative to its project; the corpus check finds the corpus from anywhere."
    from marin_study.config import project_root
    assert project_root(ROOT / "params/tiny.yaml") == ROOT and project_root("/") is None
    if not (ROOT / "data/SOURCES.json").is_file(): pytest.skip("no collected corpus in data/")
    refused = run(["marin-study", "params", "show", ROOT / "params/tiny.yaml", "--set", "data.mixture.nosuch=0.1"], cwd="/", check=False)
    assert refused.returncode == 2 and "domain 'nosuch' is not in the corpus" in refused.stderr, refused.stderr
    shown = run(["marin-study", "params", "show", ROOT / "params/tiny.yaml"], cwd="/").stdout
    assert yaml.safe_load(shown)["data"]["out_dir"] == "runs/data"  # the text as written: params files stay portable


def test_eval_writes_under_runs_evals_never_in_or_beside_the_folder_it_evaluates():
    from marin_study.evaluate import eval_out
    assert eval_out("runs/tiny/export") == Path("runs/evals/tiny-export.json")
    assert eval_out("runs/tiny/run/0123abcd/") == Path("runs/evals/tiny-run-0123abcd.json")  # not inside runs/tiny/run
    assert eval_out(".") == Path("runs/evals") / f"{Path.cwd().name}.json"
    assert eval_out("/elsewhere/exports/final") == Path("runs/evals/exports-final.json")
    assert "default: runs/evals/NAME.json" in " ".join(run(["marin-study", "eval", "--help"]).stdout.split())


def test_a_start_refused_after_it_took_the_lock_leaves_no_folder(tmp_path):
    "A refusal once torch is up (here a tracker this machine lacks) still leaves neither the run folder nor its lock."
    import importlib.util
    if importlib.util.find_spec("wandb"): pytest.skip("wandb is installed here")
    result = run(["marin-study", "train", "params/tiny.yaml", "--run-dir", tmp_path / "run", "--set", "train.trackers=[wandb]"],
                 check=False)
    assert result.returncode == 2 and "train.trackers names wandb, not installed here" in result.stderr, result.stderr
    assert tree(tmp_path) == {}


def test_a_finished_run_has_nothing_to_do_and_another_experiment_in_its_folder_is_refused_first(tmp_path):
    "Both answered before torch is imported: a run at its last step is not started, a folder of another model refused."
    from marin_study.config import save_params
    from marin_study.trainer.checkpoint import checkpoint_name, write_manifest
    run_dir = tmp_path / "run"
    save_params(load_params(ROOT / "params/tiny.yaml"), run_dir / "params.yaml")
    (last := run_dir / "checkpoints" / checkpoint_name(800)).mkdir(parents=True)
    write_manifest(last)
    before, start = tree(tmp_path), time.perf_counter()
    done = run(["marin-study", "train", "params/tiny.yaml", "--run-dir", run_dir])
    assert done.stdout == f"marin-study: nothing to do: {run_dir} is at step 800 of 800\n" and done.stderr == ""
    other = run(["marin-study", "train", "params/tiny.yaml", "--run-dir", run_dir, "--set", "model.n_layers=2"], check=False)
    assert other.returncode == 2 and "holds a run with different model.n_layers" in other.stderr, other.stderr
    assert tree(tmp_path) == before and time.perf_counter() - start < 4
