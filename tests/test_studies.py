"Study notebooks under papermill, the offline HTML reports, and the DVC pipeline on a fresh copy of the project."
import csv
import json
import re
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import nbformat
import numpy as np
import pandas as pd
import pytest

from conftest import BIN, ROOT, readme_block, run
from marin_study.analysis import KINDS
from marin_study.config import load_params
from marin_study.studies import StudyError, remote_references, run_study, study_parameters
from marin_study.trainer.metrics import MetricsLog
from marin_study.utils import sha256_file


def test_remote_references_are_detected():
    assert remote_references('<script src="https://cdn.example/x.js"></script><link rel="stylesheet" href="//cdn/x.css">')
    assert not remote_references('<img src="data:image/png;base64,AAAA"><a href="https://example.org">link</a>')


def test_a_notebook_without_parameters_cell_is_refused(tmp_path):
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), tmp_path / "s.ipynb")
    with pytest.raises(StudyError, match="no cell is tagged 'parameters'"):
        run_study(tmp_path / "s.ipynb", tmp_path / "out.ipynb")
    assert not (tmp_path / "out.ipynb").exists()


def test_a_failing_study_keeps_the_previous_output_and_saves_the_failed_run(tmp_path):
    cells = [nbformat.v4.new_code_cell("fail = False", metadata={"tags": ["parameters"]}),
             nbformat.v4.new_code_cell("assert not fail, 'planted failure'\nprint('ok')")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), tmp_path / "s.ipynb")
    out = tmp_path / "runs/s.ipynb"
    run_study(tmp_path / "s.ipynb", out, {"fail": False})
    before = out.read_bytes()
    with pytest.raises(StudyError, match="planted failure"):
        run_study(tmp_path / "s.ipynb", out, {"fail": True})
    assert out.read_bytes() == before
    assert "planted failure" in (tmp_path / "runs/s.failed.ipynb").read_text()
    with pytest.raises(StudyError, match="unknown parameter"):
        run_study(tmp_path / "s.ipynb", out, {"fial": True})


def test_ladder_study_declares_its_parameters():
    assert set(study_parameters(ROOT / "nbs/studies/ladder.ipynb")) == {"params_glob", "overrides", "table_csv"}


def test_dvc_repro_runs_the_ladder_on_a_fresh_copy(project_copy):
    result = run(["dvc", "repro", "ladder"], cwd=project_copy)
    assert "Running stage 'ladder'" in result.stdout
    html = (project_copy / "reports/ladder.html").read_text()
    assert not remote_references(html) and html.count("data:image/png;base64,") >= 2
    assert "def " not in html and "import " not in html  # code cells are left out
    rows = {r["preset"]: r for r in csv.DictReader(open(project_copy / "reports/ladder.csv"))}
    assert set(rows) == {"tiny", "small", "node", "marin-535b-a23b"}
    assert int(rows["marin-535b-a23b"]["total_params"]) == 535_305_984_000
    for name in rows: assert name in html
    assert "Running stage" not in run(["dvc", "repro", "ladder"], cwd=project_copy).stdout  # nothing changed, nothing reruns
    status = run(["dvc", "status", "ladder"], cwd=project_copy).stdout
    assert "changed" not in status, status


def test_changing_a_preset_reruns_the_ladder(project_copy):
    run(["dvc", "repro", "ladder"], cwd=project_copy)
    tiny = project_copy / "params/tiny.yaml"
    tiny.write_text(tiny.read_text().replace("steps: 800", "steps: 600"))
    assert "Running stage 'ladder'" in run(["dvc", "repro", "ladder"], cwd=project_copy).stdout
    rows = {r["preset"]: r for r in csv.DictReader(open(project_copy / "reports/ladder.csv"))}
    assert int(rows["tiny"]["tokens"]) == load_params(tiny).train.tokens == 600 * 16 * 256


def test_folders_given_as_output_or_report_are_refused_up_front(tmp_path):
    cells = [nbformat.v4.new_code_cell("n = 1", metadata={"tags": ["parameters"]})]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), tmp_path / "s.ipynb")
    with pytest.raises(StudyError, match="--output is a folder"):
        run_study(tmp_path / "s.ipynb", tmp_path)
    with pytest.raises(StudyError, match="--report is a folder"):
        run_study(tmp_path / "s.ipynb", tmp_path / "out.ipynb", report=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.ipynb"]
    bad = run(["marin-study", "study", "run", str(tmp_path / "s.ipynb"), "-o", str(tmp_path / "o.ipynb"), "-p", "n=[1,"], check=False)
    assert bad.returncode == 2 and "not valid YAML" in bad.stderr and "Traceback" not in bad.stderr


def test_train_study_declares_its_parameters():
    assert set(study_parameters(ROOT / "nbs/studies/train_tiny.ipynb")) == {
        "params_path", "overrides", "runs_root", "procs", "summary_json", "loss_plot", "metrics_copy", "curve_csv",
        "run_card_copy"}


def screenshot_and_text(html: Path, tmp_path: Path) -> tuple[np.ndarray, str]:
    "Open a report in headless Chromium: the rendered page as pixels, and its text after layout."
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser: pytest.skip("no chromium here; install.sh installs it where apt is available (apt-get install chromium)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,2000"]
    run([browser, *flags, f"--screenshot={tmp_path / 'shot.png'}", html.resolve().as_uri()])
    dom = run([browser, *flags, "--dump-dom", html.resolve().as_uri()]).stdout
    return plt.imread(tmp_path / "shot.png"), dom


def test_dvc_repro_trains_the_tiny_study_reports_on_it_and_a_second_repro_resumes_its_run(project_copy, tmp_path):
    # the pipeline's mechanics, not the suite's numbers: 8 documents per task keep the two evaluations short
    stages = project_copy / "dvc.yaml"
    assert stages.read_text().count("--batch-size 32") == 1
    stages.write_text(stages.read_text().replace("--batch-size 32", "--batch-size 32 --limit 8"))
    preset = project_copy / "params/tiny.yaml"  # 200 steps, not 800, and two checkpoints evaluated: the same checks
    text = preset.read_text().replace("  steps: 800\n", "  steps: 200\n", 1)
    preset.write_text(text.replace("permanent_every: 200", "permanent_every: 100").replace("eval_every: 100", "eval_every: 50"))
    # the project's DVC cache, as a team shares one: stages a `dvc repro` here already ran (the data stages, the eval
    # suite) come from its run cache in seconds, not 80 s (tests/test_data.py reruns them); training always runs,
    # since a persistent output is never restored from the run cache
    run(["dvc", "config", "--local", "cache.dir", str(ROOT / ".dvc/cache")], cwd=project_copy)
    result = run(["dvc", "repro", "report"], cwd=project_copy)
    assert all(f"Running stage '{stage}'" in result.stdout for stage in ("train", "eval", "report"))
    assert all(f"stage '{s}'" in result.stdout.lower() for s in ("clean", "tokenizer", "pack", "evalset"))  # ran or restored
    findings = json.loads((project_copy / "reports/loss_findings.json").read_text())["train_tiny"]
    card = json.loads((project_copy / "reports/train_tiny_run_card.json").read_text())
    assert card["resumed_at"] == [100] and card["steps"] == 200 and card["git_commit"] and card["data_hash"]
    assert {f["kind"] for f in findings["findings"]} <= set(KINDS) and findings["errors"] == 0
    assert findings["warnings"] == sum(f["severity"] != "info" for f in findings["findings"]) >= 1  # the early imbalance
    assert "without encryption" not in result.stdout + result.stderr  # kernels over IPC, not TCP
    report = project_copy / "reports/loss_report.html"
    assert not remote_references(report.read_text())
    pixels, dom = screenshot_and_text(report, tmp_path)
    assert pixels[..., :3].std() > 0.05 and (pixels[..., :3] < 0.9).mean() > 0.02  # drawn, not a blank page
    assert "Findings" in dom and f"0 error(s), {findings['warnings']} warning(s)" in dom and "schedule" in dom
    assert "router_imbalance" in dom and "not enough data" in dom  # 200 steps fit no scaling law worth a target
    assert f"params/tiny.yaml</code> (sha256 <code>{sha256_file(project_copy / 'params/tiny.yaml')[:12]}" in report.read_text()
    assert "Run card" in dom and card["params_hash"][:12] in dom
    run(["dvc", "plots", "show", "-o", str(tmp_path / "plots")], cwd=project_copy)
    assert (tmp_path / "plots/index.html").exists()
    summary = json.loads((project_copy / "reports/train_tiny.json").read_text())
    final_loss = summary["final_train_loss_last20_mean"]  # one definition (chapter 08), in the card, the JSON and the report
    assert summary["steps"] == 200 and final_loss < summary["initial_train_loss_first5_mean"] - 2.0
    assert card["final"]["loss"] == {"value": final_loss, "step": 200, "mean_of_last_steps": 20}
    assert card["final"]["eval/bpb"]["value"] == summary["heldout_sample_bpb"]
    assert "final train loss (mean of the last 20 steps)" in (project_copy / "reports/loss_report.html").read_text()
    curve = pd.read_csv(project_copy / "reports/train_tiny_curve.csv")  # DVC plots draws what each file holds
    held = pd.read_csv(project_copy / "reports/train_tiny_curve_eval.csv")
    assert len(curve) == 200 and "eval_loss" not in curve and held["step"].tolist() == [50, 100, 150, 200]
    assert held["eval_loss"].notna().all() and (held["eval_loss"] > 0).all()
    html = (project_copy / "reports/train_tiny.html").read_text()
    assert not remote_references(html) and html.count("data:image/png;base64,") >= 1
    assert "resumed from" in html  # the second leg continued from the half-way checkpoint
    assert (project_copy / "reports/train_tiny_loss.png").stat().st_size > 10_000
    assert "heldout_sample_bpb" in run(["dvc", "metrics", "show"], cwd=project_copy).stdout
    runs = project_copy / "runs/tiny/run" / (project_copy / "runs/tiny/run/LATEST").read_text().strip()
    assert {p.name for p in (project_copy / "runs/tiny/run").iterdir()} == {runs.name, "LATEST"}
    # the run leaves the kit: exported as a Hugging Face folder, and what it writes rendered
    result = run(["dvc", "repro", "generate"], cwd=project_copy)
    assert "Running stage 'export'" in result.stdout and "Running stage 'generate'" in result.stdout
    record = json.loads((project_copy / "runs/tiny/export/marin_export.json").read_text())
    assert record["step"] == 200 and record["source_run"] == str(runs.resolve())
    samples = [json.loads(l) for l in (project_copy / "reports/generate_tiny.jsonl").read_text().splitlines()]
    assert {s["domain"] for s in samples} >= {"web", "code", "chat"}
    assert all(s["finish_reason"] == "stop" or s["new_tokens"] == 48 for s in samples)
    html = (project_copy / "reports/generate_tiny.html").read_text()
    assert not remote_references(html) and "greedy tokens equal" in html and "sampled" in html
    assert f"params.yaml (via runs/tiny/export)</code> (sha256 <code>{record['params_sha256'][:12]}" in html  # the run it came from
    # what it can do: lm-eval on the checkpoints of steps 100 and 200, a report, and DVC metrics to compare runs
    rows = json.loads((project_copy / "runs/tiny/eval.json").read_text())
    assert sorted({r["step"] for r in rows}) == [100, 200] and not any(r["contaminated"] for r in rows)
    assert "Ability against tokens" in (project_copy / "reports/loss_report.html").read_text()
    run(["dvc", "repro", "eval_report"], cwd=project_copy)
    html = (project_copy / "reports/eval_tiny.html").read_text()
    assert not remote_references(html) and "cloze_books" in html and html.count("data:image/png;base64,") >= 1
    metrics = run(["dvc", "metrics", "show", "--json"], cwd=project_copy).stdout
    assert "reports/eval_tiny.json" in metrics and "choice_heldout" in metrics
    # what the stages wrote reads the same on any machine: no path of the folder they ran in, nor of this one's /work
    for path in sorted(p for p in (project_copy / "reports").rglob("*") if p.is_file() and p.suffix in (".html", ".json", ".jsonl", ".csv", ".md")):
        text = path.read_text(errors="replace")
        assert str(project_copy) not in text and str(project_copy.resolve()) not in text, f"{path.name} names {project_copy}"
        assert "/work/" not in text, f"{path.name} names a /work/ path"
    # the README's five-minute tour as written (train, analyze, generate, serve) leaves the pipeline as it was
    before = run(["dvc", "status"], cwd=project_copy).stdout
    tour = run(["bash", "-e", "-c", readme_block("A five-minute tour")], cwd=project_copy, timeout=900)
    assert '"finish_reason"' in tour.stdout and "server stopped" in tour.stderr
    assert (project_copy / "runs/tour/RUN_CARD.md").is_file() and "Traceback" not in tour.stderr
    assert "Setting accelerator to CPU" not in tour.stdout + tour.stderr and "built successfully" not in tour.stdout  # quiet
    assert run(["dvc", "status"], cwd=project_copy).stdout == before
    ran = run(["dvc", "status", "report", "generate", "eval_report"], cwd=project_copy).stdout  # the stages this test ran
    assert "Data and pipelines are up to date" in ran, ran
    # the persistent run is found, nothing retrains (--single-item: --force alone reruns the data stages too)
    run(["dvc", "repro", "--force", "--single-item", "train"], cwd=project_copy)
    assert len(MetricsLog(runs / "metrics.jsonl").read()) == 200
    assert "Data and pipelines are up to date" in run(["dvc", "status", "train"], cwd=project_copy).stdout
    # a DVC experiment with -S overrides (what `dvc exp run --queue` would queue) reaches the stages that read the
    # params; the ladder stage reads every preset and is seconds long (a second training run on other seeds cost CI
    # three minutes: the seeds' robustness at full length is tests/slow/tiny_robustness.py's)
    run(["dvc", "exp", "run", "-S", "params/tiny.yaml:train.steps=400", "ladder"], cwd=project_copy)
    tiny = pd.read_csv(project_copy / "reports/ladder.csv").set_index("preset").loc["tiny"]
    assert tiny["tokens"] == 400 * 16 * 256
    assert len(run(["dvc", "exp", "list", "--name-only"], cwd=project_copy).stdout.split()) == 1


def test_serve_study_declares_its_parameters():
    assert set(study_parameters(ROOT / "nbs/studies/serve_tiny.ipynb")) == {
        "export_dir", "clean_dir", "work_dir", "prompts_per_domain", "prompt_words", "max_tokens", "concurrency", "summary_json"}


def test_eval_report_declares_its_parameters():
    assert set(study_parameters(ROOT / "nbs/studies/eval_tiny.ipynb")) == {"eval_json", "export_dir", "params_path", "metrics_json"}


def test_loss_report_declares_its_parameters():
    assert set(study_parameters(ROOT / "nbs/studies/loss_report.ipynb")) == {
        "metrics", "reference", "params_path", "target_tokens", "findings_json", "evals", "run_cards", "record_name",
        "record_params"}


def test_marin_record_study_declares_its_parameters():
    assert set(study_parameters(ROOT / "nbs/studies/marin_record.ipynb")) == {
        "record_name", "params_path", "gpus", "backtest_fraction", "findings_json"}


def test_the_landing_page_gives_the_headline_numbers_and_every_report(tmp_path):
    "reports/index.html on the main job's reports (CI runs it first): its numbers are the metrics files', every link works."
    reports = ROOT / "reports"
    if not (reports / "train_tiny.json").is_file(): pytest.skip("no reports yet: run the main job (dvc repro) first")
    out = tmp_path / "reports"
    shutil.copytree(reports, out)
    (out / "index.html").unlink(missing_ok=True)
    run([BIN / "marin-study", "study", "run", ROOT / "nbs/studies/landing.ipynb", "--output", tmp_path / "landing.ipynb",
         "--report", out / "index.html", "-p", f"reports_dir={out}"])
    page = (out / "index.html").read_text()
    train = json.loads((reports / "train_tiny.json").read_text())
    serve = json.loads((reports / "serve_tiny.json").read_text())
    assert f"{train['final_train_loss_last20_mean']:.3f} nats" in page and f"{train['heldout_sample_bpb']:.3f}" in page
    assert f"p50 {serve['latency_p50_s']:.2f} s" in page and "abilities beyond chance" in page
    links = set(re.findall(r'href="([\w./]+\.html)"', page))
    assert {"train_tiny.html", "eval_tiny.html", "serve_tiny.html", "book/index.html"} <= links
    assert all((out / link).is_file() for link in links), links
    assert len(re.findall(r'<img[^>]*src="data:image/png;base64,', page)) >= 5  # a thumbnail per report with a plot
    assert not remote_references(page) and str(tmp_path) not in page and "not built yet" not in page
