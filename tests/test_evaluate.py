"""Evaluation through lm-evaluation-harness on checkpoints the real trainer wrote: the suite, ability against tokens,
two paths to one number, contamination, offline, bad input."""
import json
import shutil
from importlib.metadata import version
from pathlib import Path

import pytest

from conftest import BIN, ROOT, command, quick_params, run
from marin_study.config import save_params
from marin_study.data.corpus import read_jsonl
from marin_study.evaluate import EvalError, build_evalset, evaluate, load_suite, trainer_bpb
from marin_study.export import export
from marin_study.utils import json_lines, write_jsonl

pytest.importorskip("lm_eval")
STEPS, EVERY = 24, 8
PPL = "marin_ppl"


def marin(*args, check=True):
    return run([str(BIN / "marin-study"), *map(str, args)], check=check)


@pytest.fixture(scope="module")
def trained(pipeline, tmp_path_factory):
    "The tiny model on the small corpus, trained by `marin-study train` for 24 steps, a checkpoint kept every 8."
    p = quick_params(pipeline["params"], steps=STEPS, checkpoint_every=EVERY, permanent_every=EVERY, eval_every=STEPS,
                     eval_samples=4)
    folder = tmp_path_factory.mktemp("trained")
    run(command("alone", save_params(p, folder / "params.yaml"), folder / "run"))
    return {"run": folder / "run", "params": p}


@pytest.fixture(scope="module")
def curve(trained, suite, tmp_path_factory):
    "`marin-study eval RUN_DIR --every 8` on the perplexity tasks and the cloze: rows of steps 8, 16 and 24."
    out = tmp_path_factory.mktemp("curve") / "eval.json"
    done = marin("eval", trained["run"], "--every", EVERY, "--tasks", f"{PPL},cloze_books", "--data-dir", suite[0], "--out", out)
    (out.parent / "printed.txt").write_text(done.stdout + done.stderr)  # what a user sees, for the quiet-output test
    return out


@pytest.fixture(scope="module")
def exported(trained, pipeline, tmp_path_factory):
    "The run's last checkpoint as a Hugging Face folder."
    out = tmp_path_factory.mktemp("export") / "step-24"
    export(trained["run"], out, tokenizer=pipeline["root"] / "out/tokenizer.json")
    return out


def items(path):
    return [record for _, record in json_lines(path)]


def by(rows, step, metric):
    return {r["task"]: r["value"] for r in rows if r["step"] == step and r["metric"] == metric}


def test_the_suite_is_the_heldout_split_less_what_overlaps_training(pipeline, suite):
    data_dir, counts = suite
    heldout = pipeline["root"] / "out/clean/heldout"
    for domain in ("books", "code", "math", "quotes"):
        docs = list(read_jsonl(heldout / f"{domain}.jsonl"))
        assert counts[f"ppl_{domain}"] == {"documents": len(docs), "dropped": 0}
        assert [d["text"] for d in items(data_dir / f"ppl_{domain}.jsonl")] == [d["text"] for d in docs]
    choice = items(data_dir / "choice_heldout.jsonl")
    assert choice and all(len(c["choices"]) == 4 and c["choices"][c["label"]] == c["query"][len(c["context"]):]
                          for c in choice)
    assert all(c["query"].endswith(" " + c["target"]) for c in items(data_dir / "cloze_books.jsonl"))
    order = items(data_dir / "order_heldout.jsonl")  # the real passage, and the same characters in another order
    assert order and all(c["choices"][c["label"]] == c["query"] and c["choices"][0] != c["choices"][1]
                         and sorted(c["choices"][0]) == sorted(c["choices"][1]) for c in order)
    assert {c["label"] for c in order} == {0, 1}
    again = build_evalset(load_suite(ROOT / "evals/tasks"), pipeline["root"] / "out/clean", data_dir / "again")
    assert again == counts and (data_dir / "again/choice_heldout.jsonl").read_bytes() == (data_dir / "choice_heldout.jsonl").read_bytes()


def test_a_run_is_evaluated_at_its_kept_checkpoints_and_more_tokens_score_better(curve, trained):
    rows = json.loads(curve.read_text())
    assert sorted({r["step"] for r in rows}) == [8, 16, 24]
    assert {r["tokens"] for r in rows if r["step"] == 24} == {24 * 8 * 128}
    assert len({r["model_hash"] for r in rows}) == 3 and {r["lm_eval_version"] for r in rows} == {version("lm-eval")}
    assert all(r["n"] > 0 and r["num_fewshot"] == 0 and r["seed"] == 0 and r["contaminated"] is False for r in rows)
    assert sorted(p.name for p in (curve.parent / "eval").iterdir()) == [f"step-{s:08d}.lm_eval.json" for s in (8, 16, 24)]
    assert not list(curve.parent.glob(".eval-*"))  # the temporary exports are gone
    worse, better = by(rows, 8, "bits_per_byte"), by(rows, 24, "bits_per_byte")
    assert all(better[task] < worse[task] for task in worse), (worse, better)
    assert by(rows, 24, "perplexity")["cloze_books"] < by(rows, 8, "perplexity")["cloze_books"]


def test_evaluation_prints_no_library_notice_and_states_truncation_once_a_step(curve):
    "lm-eval's per-batch truncation notes, the tokenizer's long-sequence note and DeepSpeed's accelerator note stay out."
    printed = (curve.parent / "printed.txt").read_text()
    for notice in ("Left truncation applied", "Token indices sequence length is longer", "Setting accelerator to CPU"):
        assert notice not in printed, notice
    assert printed.count("note: lm-eval kept the last tokens of") <= 3  # at most one line for each of the 3 checkpoints


def test_lm_eval_and_the_trainer_give_one_held_out_bits_per_byte(curve, exported, trained):
    "Two independent paths (whole documents through the HF folder; token-shard windows through our Transformer)."
    theirs = {task.removeprefix("ppl_"): v for task, v in by(json.loads(curve.read_text()), STEPS, "bits_per_byte").items()}
    ours = trainer_bpb(exported, trained["params"])
    assert set(theirs) == set(ours)
    gaps = {d: theirs[d] / ours[d] - 1 for d in ours}
    # the issue asks for 1%; both score each document alone in the same windows, so they agree to float precision
    assert all(abs(g) < 1e-4 for g in gaps.values()), gaps


def test_our_transformer_and_the_exported_folder_score_the_same(exported, suite, tmp_path):
    rows = {backend: evaluate(exported, limit=6, backend=backend, data_dir=suite[0], tasks_dir=ROOT / "evals/tasks",
                              out=tmp_path / f"{backend}.json") for backend in ("hf", "kit")}
    assert [(r["task"], r["metric"]) for r in rows["hf"]] == [(r["task"], r["metric"]) for r in rows["kit"]]
    assert {r["task"] for r in rows["hf"]} >= {"cloze_books", "choice_heldout", "complete_code", "ppl_books"}
    for a, b in zip(rows["hf"], rows["kit"]):
        assert a["value"] == pytest.approx(b["value"], rel=1e-4), (a["task"], a["metric"])
    written = json.loads((tmp_path / "hf.json").read_text())
    assert written == rows["hf"] and json.loads((tmp_path / "hf.lm_eval.json").read_text())["versions"]["cloze_books"]


def test_a_model_evaluated_on_its_own_training_text_is_flagged(exported, pipeline, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(ROOT / "evals/tasks/_ppl.yaml", tasks)
    for name, split in (("own_text", "train"), ("held_text", "heldout")):
        docs = [{"text": d["text"]} for d in read_jsonl(pipeline["root"] / f"out/clean/{split}/books.jsonl")][:6]
        write_jsonl(tmp_path / f"{name}.jsonl", docs)
        (tasks / f"{name}.yaml").write_text(f"include: _ppl.yaml\ntask: {name}\n"
                                            f"dataset_kwargs: {{data_files: {{test: {tmp_path / name}.jsonl}}}}\n")
    result = marin("eval", exported, "--tasks-dir", tasks, "--out", tmp_path / "eval.json")
    rows = json.loads((tmp_path / "eval.json").read_text())
    assert {r["task"]: r["contaminated"] for r in rows} == {"own_text": True, "held_text": False}
    assert {r["task"]: r["contamination"] for r in rows} == {"own_text": 1.0, "held_text": 0.0}
    assert "warning: own_text: 100% of its documents overlap the training text" in result.stderr


def test_evaluation_makes_no_network_call(exported, suite, tmp_path):
    "Every socket of the process refuses to connect; the evaluation still runs (the datasets are local files)."
    (tmp_path / "sitecustomize.py").write_text(
        "import socket\n"
        "def refuse(self, *a, **k): raise OSError('network call blocked by the test')\n"
        "socket.socket.connect = socket.socket.connect_ex = refuse\n")
    env = {"PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "", "HF_DATASETS_OFFLINE": "", "TRANSFORMERS_OFFLINE": ""}
    probe = run([str(BIN / "python"), "-c", "import socket; socket.create_connection(('127.0.0.1', 9))"], check=False, env=env)
    assert "network call blocked by the test" in probe.stderr
    run([str(BIN / "marin-study"), "eval", exported, "--tasks", "ppl_math,choice_heldout,complete_code", "--limit", "3",
         "--data-dir", suite[0], "--out", tmp_path / "eval.json"], env=env)
    assert {r["task"] for r in json.loads((tmp_path / "eval.json").read_text())} == {"ppl_math", "choice_heldout", "complete_code"}


def test_bad_input_is_refused_in_one_line_and_writes_nothing(exported, trained, suite, tmp_path):
    for args, words in ((["--tasks", "lambada_openai"], "unknown task 'lambada_openai'; the suite has the tasks"),
                        (["--every", "8"], "has no checkpoints/; give a run folder, or drop --every")):
        result = marin("eval", exported, *args, "--data-dir", suite[0], "--out", tmp_path / "eval.json", check=False)
        assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr, result.stderr
    result = marin("eval", tmp_path, check=False)
    assert result.returncode == 2 and f"{tmp_path}: no config.json, so not an exported model" in result.stderr
    result = marin("eval", trained["run"], "--every", "7", check=False)
    assert result.returncode == 2 and "no kept checkpoint is a multiple of --every 7; the steps kept are [8, 16, 24]" in result.stderr
    tasks = tmp_path / "tasks"
    shutil.copytree(ROOT / "evals/tasks", tasks)
    cloze = tasks / "cloze_books.yaml"
    cloze.write_text(cloze.read_text().replace("output_type: loglikelihood\n", ""))
    with pytest.raises(EvalError, match=f"{cloze}: no 'output_type'; every task file needs"):
        evaluate(exported, ["cloze_books"], tasks_dir=tasks, data_dir=suite[0])
    with pytest.raises(EvalError, match="the documents of task ppl_web .* are missing; build them with"):
        evaluate(exported, ["ppl_web"], data_dir=tmp_path / "nowhere")
    with pytest.raises(EvalError, match="--train-data .*: no such folder"):
        evaluate(exported, ["ppl_web"], data_dir=suite[0], train_data=tmp_path / "nowhere")
    assert not (tmp_path / "eval.json").exists() and not (exported / "eval.json").exists()


def test_the_suite_refuses_a_task_file_it_cannot_build(pipeline, tmp_path):
    tasks = tmp_path / "tasks"
    shutil.copytree(ROOT / "evals/tasks", tasks)
    code = tasks / "complete_code.yaml"
    code.write_text(code.read_text().replace("kind: completion", "kind: riddles"))
    with pytest.raises(EvalError, match=f"{code}: metadata.build.kind is 'riddles'; use one of documents, cloze"):
        build_evalset(load_suite(tasks), pipeline["root"] / "out/clean", tmp_path / "data")
    code.write_text(code.read_text().replace("kind: riddles", "kind: completion").replace(
        "doc_to_decontamination_query: query", "doc_to_decontamination_query: snippet"))
    with pytest.raises(EvalError, match="doc_to_decontamination_query names 'snippet', a field its documents lack"):
        build_evalset(load_suite(tasks), pipeline["root"] / "out/clean", tmp_path / "data")
    assert not (tmp_path / "data").exists()  # nothing half-written


def test_eval_without_out_writes_under_runs_evals_never_in_or_beside_the_export(exported, suite, tmp_path):
    "An export is a DVC output: a file written into it would make every stage that reads it stale."
    copy = tmp_path / "runs/tiny/export"
    shutil.copytree(exported, copy)
    inside = sorted(copy.rglob("*"))
    done = run([BIN / "marin-study", "eval", "runs/tiny/export", "--tasks", "ppl_math", "--limit", "2", "--data-dir",
                str(Path(suite[0]).resolve()), "--tasks-dir", ROOT / "evals/tasks"], cwd=tmp_path)
    assert sorted(copy.rglob("*")) == inside and sorted(p.name for p in copy.parent.iterdir()) == ["export"]
    assert "results in runs/evals/tiny-export.json" in done.stdout
    assert json.loads((tmp_path / "runs/evals/tiny-export.json").read_text())
    assert (tmp_path / "runs/evals/tiny-export.lm_eval.json").is_file()
