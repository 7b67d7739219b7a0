"""Bad input through the real `marin-study` command: exit status 2, one `marin-study: error:` line that names the
file, key or line, no traceback, and nothing written. Every case's files live in a folder whose name holds a space and
a non-ASCII character, so the errors must name such paths as they are."""
import pytest

from conftest import BIN, ROOT, run

TINY = (ROOT / "params/tiny.yaml").read_text(encoding="utf-8")
LOSS_CSV = "step,loss\n" + "".join(f"{s},{8 - s / 10}\n" for s in range(1, 31))
FAKE_SINFO = '#!/bin/sh\nprintf "debug*\\ngpu\\n"\n'  # a Slurm that answers: two partitions, debug the default


def corpus(**files: str | bytes) -> dict:
    "A raw corpus folder's files: train/NAME.jsonl for each keyword."
    return {f"corpus/train/{name}.jsonl": text for name, text in files.items()}


DOC = '{"id": "a#0", "domain": "web", "source": "a", "license": "CC0", "group": "a#0", "text": "words that pass the filters here"}\n'
DATA = ["--set", "data.dir={d}/corpus", "--set", "data.out_dir={d}/out"]

# name: (files in the folder {d}, the command, words the error holds: the first, a file or key, on its first line)
CASES = {
    # params files and overrides
    "malformed YAML": ({"p.yaml": "model: [1\n"}, ["params", "show", "{d}/p.yaml"], ["{d}/p.yaml:2", "not valid YAML"]),
    "a tab in the indentation": ({"p.yaml": "model:\n\tvocab_size: 8\n"}, ["params", "show", "{d}/p.yaml"], ["{d}/p.yaml:2", "tab"]),
    "an empty params file": ({"p.yaml": ""}, ["params", "show", "{d}/p.yaml"], ["{d}/p.yaml"]),
    "a params file that is a list": ({"p.yaml": "- 1\n- 2\n"}, ["params", "show", "{d}/p.yaml"], ["{d}/p.yaml"]),
    "a params file not in UTF-8": ({"p.yaml": TINY.encode("utf-8").replace(b"tiny:", b"\xff\xfe")}, ["params", "show", "{d}/p.yaml"],
                                   ["{d}/p.yaml", "UTF-8"]),
    "no such params file": ({}, ["params", "show", "{d}/none.yaml"], ["{d}/none.yaml", "does not exist"]),
    "a params path that is a folder": ({"folder.yaml/x": ""}, ["params", "show", "{d}/folder.yaml"], ["{d}/folder.yaml", "folder"]),
    "a wrong type in the file": ({"p.yaml": TINY.replace("steps: 800", "steps: ten")}, ["params", "show", "{d}/p.yaml"],
                                ["{d}/p.yaml", "train.steps", "'ten'"]),
    "a wrong type in an override": ({}, ["params", "show", "params/tiny.yaml", "--set", "train.steps=abc"], ["train.steps", "'abc'"]),
    "an unknown section": ({"p.yaml": TINY.replace("model:", "modle:")}, ["params", "show", "{d}/p.yaml"], ["{d}/p.yaml", "modle"]),
    "an out-of-range learning rate": ({}, ["params", "show", "params/tiny.yaml", "--set", "train.lr=-1"], ["train.lr", "-1"]),
    "top_k above n_experts": ({}, ["params", "show", "params/tiny.yaml", "--set", "model.top_k=99"], ["model.top_k", "99"]),
    "a batch that micro-batches do not divide": ({}, ["params", "show", "params/tiny.yaml", "--set", "train.global_batch=12"],
                                                 ["train.global_batch", "12"]),
    "a batch that the processes do not divide": ({}, ["params", "show", "params/tiny.yaml", "--set", "train.global_batch=24"],
                                                 ["train.global_batch", "24"]),
    "a mixture with an unknown domain": ({}, ["params", "show", "params/tiny.yaml", "--set", "data.mixture.nosuch=0.1"],
                                         ["data.mixture", "nosuch"]),
    "a mixture with a negative weight": ({}, ["params", "show", "params/tiny.yaml", "--set", "data.mixture.web=-0.35"],
                                         ["data.mixture.web", "-0.35"]),
    "an unknown nested key": ({}, ["params", "show", "params/tiny.yaml", "--set", "train.nested.key=1"], ["train.nested.key"]),
    "--set without '='": ({}, ["params", "show", "params/tiny.yaml", "--set", "train.steps"], ["train.steps", "="]),
    # the data pipeline
    "an empty corpus folder": ({"corpus/.keep": ""}, ["data", "clean", "params/tiny.yaml", *DATA], ["{d}/corpus", "train/*.jsonl"]),
    "an empty corpus file": (corpus(web=""), ["data", "clean", "params/tiny.yaml", *DATA], ["{d}/corpus"]),
    "a broken JSON line": (corpus(web=DOC + '{"id": "b#0", "text": \n'), ["data", "clean", "params/tiny.yaml", *DATA],
                           ["{d}/corpus/train/web.jsonl:2", "JSON"]),
    "bytes that are not UTF-8": (corpus(web=DOC.encode() + b'{"id": "\xff\xfe"}\n'), ["data", "clean", "params/tiny.yaml", *DATA],
                                 ["{d}/corpus/train/web.jsonl:2", "UTF-8"]),
    # the command line
    "an unknown GPU": ({}, ["plan", "params/node.yaml", "--gpu", "nosuch-gpu"], ["nosuch-gpu", "h100"]),
    "--gpus 0": ({}, ["plan", "params/node.yaml", "--gpus", "0"], ["--gpus", "0"]),
    "negative tokens": ({}, ["plan", "params/node.yaml", "--tokens=-1e9"], ["--tokens", "-1e+09"]),
    "an MFU above 1": ({}, ["plan", "params/node.yaml", "--mfu", "22.9"], ["mfu", "22.9"]),
    "--top 0": ({}, ["plan", "params/node.yaml", "--top", "0"], ["--top", "0"]),
    "--until -5": ({}, ["train", "params/tiny.yaml", "--run-dir", "{d}/run", "--until", "-5"], ["--until", "-5"]),
    "a run folder that is a file": ({"run": "a file"}, ["train", "params/tiny.yaml", "--run-dir", "{d}/run", "--set", "train.steps=2"],
                                    ["--run-dir", "{d}/run", "file"]),
    "a run folder inside a file": ({"run": "a file"}, ["train", "params/tiny.yaml", "--run-dir", "{d}/run/inner"],
                                   ["--run-dir", "{d}/run", "file"]),
    "an unknown partition (Slurm answers)": ({"bin/sinfo": FAKE_SINFO}, ["launch", "slurm", "params/tiny.yaml", "--dry-run", "--set",
                                             "launch.partition=nosuch"], ["launch.partition", "'nosuch'", "debug, gpu"]),
    "a partition with a line break": ({}, ["launch", "slurm", "params/tiny.yaml", "--dry-run", "--set", 'launch.partition="a\\nrm -rf ~"'],
                                      ["launch.partition", "'a\\nrm -rf ~'"]),
    "an env name with a ';'": ({}, ["launch", "slurm", "params/tiny.yaml", "--dry-run", "--set", 'launch.env={"A;touch x": "1"}'],
                               ["launch.env", "'A;touch x'"]),
    "a sweep file that is not YAML": ({"sweep.yaml": "grid: [1\n"}, ["launch", "sweep", "{d}/sweep.yaml", "--dry-run"],
                                      ["{d}/sweep.yaml:2", "not valid YAML"]),
    "a grid value that is not YAML": ({}, ["launch", "sweep", "params/tiny.yaml", "--grid", "train.lr={1", "--dry-run"],
                                      ["--grid", "train.lr={1", "not valid YAML"]),
    # analysis inputs
    "an empty metrics file": ({"metrics.jsonl": ""}, ["analyze", "{d}/metrics.jsonl"], ["{d}/metrics.jsonl", "empty"]),
    "no metrics file": ({}, ["analyze", "{d}/none.jsonl"], ["{d}/none.jsonl"]),
    "a curve without a loss column": ({"c.csv": "step,acc\n1,0.5\n2,0.6\n"}, ["analyze", "{d}/c.csv"], ["{d}/c.csv", "'loss'"]),
    "a curve of NaN losses": ({"c.csv": "step,loss\n1,nan\n2,nan\n3,nan\n"}, ["analyze", "{d}/c.csv"], ["{d}/c.csv", "loss"]),
    "a loss column of text": ({"c.csv": "step,loss\n1,high\n2,low\n"}, ["analyze", "{d}/c.csv"], ["{d}/c.csv", "loss"]),
    "a torn metrics line mid-file": ({"metrics.jsonl": '{"step": 1, "loss": 8.0}\n{"step": 2, "lo\n{"step": 3, "loss": 7.9}\n'},
                                     ["analyze", "{d}/metrics.jsonl"], ["{d}/metrics.jsonl:2"]),
    "an unknown --map column": ({"c.csv": LOSS_CSV}, ["analyze", "{d}/c.csv", "--map", "loss=train/lm_loss"], ["{d}/c.csv", "train/lm_loss"]),
}


def snapshot(folder):
    "Every file under `folder` with its bytes, and every folder: what a refused command must leave as it was."
    return {p.relative_to(folder): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_error_line_exit_2_and_nothing_written(name, tmp_path):
    files, args, words = CASES[name]
    folder = tmp_path / "bad input é"
    for path, content in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        getattr(folder / path, "write_bytes" if isinstance(content, bytes) else "write_text")(content)
    folder.mkdir(exist_ok=True)
    if (folder / "bin/sinfo").exists(): (folder / "bin/sinfo").chmod(0o755)
    before = snapshot(folder)
    env = {"PATH": f"{folder / 'bin'}:{BIN}:/usr/bin:/bin"}
    result = run([BIN / "marin-study", *(a.replace("{d}", str(folder)) for a in args)], check=False, env=env, timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("marin-study: error:")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    words = [w.replace("{d}", str(folder)) for w in words]  # the first on the error line; the rest there or below it
    assert words[0] in errors[0] and all(w in result.stderr for w in words), (words, result.stderr)
    assert result.stdout == "" and snapshot(folder) == before, result.stdout
