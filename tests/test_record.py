"The Marin record (chapter 08c): the shipped snapshot, its manifest, the stitched lineage, and the analysis on it."
import gzip
import json
import shutil

import numpy as np
import pandas as pd
import pytest

from conftest import ROOT, run
from marin_study import record as rec
from marin_study.analysis import compare, diagnose, fit_scaling_law, load_curves
from marin_study.config import load_params
from marin_study.widgets import explorer

FOLDER = ROOT / "record" / rec.RECORD
TOKENS_PER_STEP = 11_264 * 4_096


@pytest.fixture(scope="module")
def curves():
    return rec.curves()


def test_the_manifest_names_every_file_with_its_source_and_hash():
    manifest = rec.verify()
    files = {p.name for p in FOLDER.iterdir()} - {"MANIFEST.json"}
    assert set(manifest["files"]) == files and {"train.csv.gz", "eval.csv.gz", "router.csv.gz", "lineage.csv"} <= files
    for name, entry in manifest["files"].items():
        assert len(entry["sha256"]) == 64 and entry["rows"] > 0 and entry["what"], name
        for source in entry["sources"]:
            assert source["repository"] in ("marin-community/marin", "fudan-chen/marin-pretrain-research"), name
            if source["repository"] == "fudan-chen/marin-pretrain-research":
                assert len(source["commit"]) == 40 and source["taken"] == "2026-10-03" and source["path"].startswith("sources/wandb/")
    sourced = pd.concat([rec.read_table(t) for t in ("lineage", "incidents", "mixture_phases", "milestones")])
    assert sourced["source"].notna().all() and sourced["source"].str.len().min() > 5  # every fact names where it comes from


@pytest.mark.parametrize("damage", ["changed", "missing", "unlisted"])
def test_a_damaged_snapshot_is_refused_by_name(tmp_path, damage):
    copy = shutil.copytree(FOLDER, tmp_path / rec.RECORD)
    if damage == "changed":
        with gzip.open(copy / "train.csv.gz", "at") as f: f.write("hero-x,1,train/loss,9.9\n")
    elif damage == "missing": (copy / "lineage.csv").unlink()
    else: (copy / "notes.txt").write_text("mine")
    with pytest.raises(rec.RecordError) as info: rec.curves(copy)
    message = str(info.value)
    assert {"changed": "train.csv.gz: SHA-256", "missing": "lineage.csv: listed in MANIFEST.json but missing",
            "unlisted": "notes.txt not in MANIFEST.json"}[damage] in message and "\n" not in message


def test_stitching_keeps_the_run_that_went_on_and_refuses_a_lineage_that_overlaps():
    lineage = pd.DataFrame({"run": ["a", "b", "side"], "first_step": [0, 100, 50], "last_step": [99, 199, 80],
                            "role": ["production", "production", "replaced"], "source": "test"})
    series = pd.DataFrame({"run": ["a"] * 4 + ["b"] * 2 + ["side"],
                           "step": [10, 99, 100, 120, 100, 150, 60],   # a logged 100-120 before it crashed; b replayed them
                           "metric": "train/cross_entropy_loss", "value": [3.0, 2.5, 2.4, 2.3, 2.41, 2.2, 9.0]})
    stitched = rec.stitch(series, lineage)
    assert stitched[["run", "step", "value"]].values.tolist() == [["a", 10, 3.0], ["a", 99, 2.5], ["b", 100, 2.41], ["b", 150, 2.2]]
    assert stitched.attrs["dropped"] == {"a": 2, "side": 1}
    with pytest.raises(rec.RecordError, match="a ends at step 120 and b starts at 100: they overlap"):
        rec.stitch(series, lineage.assign(last_step=[120, 199, 80]))
    with pytest.raises(rec.RecordError, match="steps between have no owner"):
        rec.stitch(series, lineage.assign(first_step=[0, 110, 50]))


def test_the_stitched_record_covers_the_lineage_once_in_order(curves):
    lineage = rec.production(rec.read_table("lineage"))
    assert len(lineage) == 7 and lineage["first_step"].iloc[0] == 0
    train = curves.dropna(subset=["loss"])
    assert curves["step"].is_unique and curves["step"].is_monotonic_increasing and curves["tokens"].is_monotonic_increasing
    assert (curves["tokens"] == (curves["step"] + 1) * TOKENS_PER_STEP).all()   # Marin counts steps from 0
    owner = np.searchsorted(lineage["first_step"], train["step"], side="right") - 1
    assert set(owner) == set(range(7))                        # every run of the lineage contributes its steps
    assert train["step"].iloc[0] < 200 and train["step"].iloc[-1] > 197_000
    # no stretch of the run lost: W&B sampled 1,500 points a run, so the live run's 90,000 steps are its sparsest
    assert np.diff(train["step"]).max() < 1_200 and np.median(np.diff(train["step"])) < 100
    logged = curves.dropna(subset=["logged_tokens"])
    # the logged counter agrees with tokens from the batch size, to within the nearest-step placement
    assert (abs(logged["logged_tokens"] - logged["tokens"]) <= 100 * TOKENS_PER_STEP).all()
    assert train["loss"].between(0.9, 12.0).all() and curves["mfu"].dropna().between(0, 0.4).all()


def test_the_record_reads_as_the_kit_reads_any_run(curves, tmp_path):
    "The stitched record written as a metrics.jsonl reads back through load_curves and analyze as the record itself."
    metrics = tmp_path / "metrics.jsonl"
    kit = rec.metrics()
    metrics.write_text("".join(json.dumps({k: v for k, v in row.items() if v == v}) + "\n" for row in kit.to_dict("records")))
    again = load_curves(metrics, run=rec.RECORD)
    assert again["step"].tolist() == curves["step"].tolist()
    assert np.allclose(again["loss"].fillna(-1), curves["loss"].fillna(-1))
    assert [str(f) for f in diagnose(again, 128256)] == [str(f) for f in rec.findings()]
    box = explorer([curves])
    assert len(box.lines[rec.RECORD]) == len(curves) and box.figure is not None
    table = compare([curves, again], metric="eval_bpb")
    assert set(table["run"]) == {rec.RECORD} and table["tokens"].min() > 0
    phase0 = curves[(curves["data_phase"] == 0) & curves["loss"].notna()]
    fit = fit_scaling_law(phase0["tokens"].iloc[200::50], phase0["loss"].iloc[200::50], bootstrap=20)
    assert fit.degenerate is None and 0.9 < fit.predict([18e12])[0][0] < phase0["loss"].iloc[-100:].mean()


def test_analyze_record_prints_the_findings_on_the_real_run():
    done = run(["marin-study", "analyze", "--record"], check=False)
    assert done.returncode in (0, 1) and not done.stderr.strip(), done.stderr
    head, *lines = done.stdout.strip().splitlines()
    found = rec.findings()
    kinds = {f.kind: sum(g.kind == f.kind for g in found if g.severity == "info") for f in found if f.severity == "info"}
    shown = sum(f.severity != "info" for f in found) + sum(n if n <= 2 else 1 for n in kinds.values())  # many notes of a kind: one line
    assert head.startswith(f"record/{rec.RECORD}") and f"{sum(f.severity == 'info' for f in found)} note(s)" in head
    assert len(lines) == shown and all(any(kind in line for line in lines) for kind in kinds)
    refused = run(["marin-study", "analyze"], check=False)
    assert refused.returncode == 2 and "--record" in refused.stderr and "Traceback" not in refused.stderr


def test_events_join_handoffs_mixture_switches_and_incidents():
    documented = rec.events()
    assert {"handoff", "mixture"} <= set(documented["kind"]) and documented["first_step"].is_monotonic_increasing
    assert (documented["kind"] == "handoff").sum() == 6 and 108_000 in set(documented.loc[documented["kind"] == "mixture", "first_step"])
    table, missed = rec.explain(rec.findings(), documented)
    assert len(table) == len(rec.findings()) and len(missed) < len(documented)


def test_pace_measures_goodput_below_one_and_the_planner_lands_on_it():
    p = rec.pace()
    assert p["to_step"] > 190_000 and 10 < p["steady_s_per_step"] < p["wall_s_per_step"] < 40 and 0.5 < p["goodput"] < 1
    from marin_study.parallelism import plan
    params = load_params(ROOT / "params" / f"{rec.RECORD}.yaml")
    steady = plan(params, "gb200", 704, mfu=0.25)
    slowed = plan(params, "gb200", 704, mfu=0.25, goodput=p["goodput"])
    assert slowed.days() == pytest.approx(steady.days() / p["goodput"]) and f"/ {p['goodput']:.1%} goodput" in slowed.days_in_words()


# What diagnose finds on the real run, each explained by the record (nbs/studies/marin_record.ipynb says how): the end
# of warmup, the restarts' slow first steps at the handoffs, the mixture switch, and two undocumented slow steps (the
# run saves a checkpoint every hour). A change of the analysis that adds a false alarm or loses one of these fails here.
PINNED = [("info", "schedule", 3912, 3912), ("info", "schedule", 4343, 4343), ("info", "slow_steps", 58015, 58015),
          ("info", "slow_steps", 58202, 58202), ("info", "slow_steps", 81717, 81717), ("info", "mixture", 108000, 108000),
          ("info", "slow_steps", 108000, 108000), ("info", "slow_steps", 108959, 108959), ("info", "slow_steps", 109991, 109991)]


def test_the_findings_on_the_real_run_are_pinned_and_find_what_the_record_documents():
    found = rec.findings()
    assert [(f.severity, f.kind, f.start_step, f.end_step) for f in found] == PINNED
    table, missed = rec.explain(found, rec.events())
    for kind, what in (("schedule", "warmup ends"), ("mixture", "mixture phase 1 starts"),
                       ("handoff", "hero-12d8b6f0-dee637 -> hero-wd-gate-router-p02-step58k"),
                       ("handoff", "hero-wd-gate-router-p02-step58k -> hero-ragged_a2a-nccl2307-ep-step81k"),
                       ("handoff", "hero-ragged_a2a-nccl2307-ep-step81k -> hero-mix-996f4891-step108k")):
        assert table["documented"].str.contains(f"{kind}: {what}", regex=False).any(), (kind, what)
        assert not ((missed["kind"] == kind) & missed["what"].str.startswith(what)).any(), (kind, what)


def test_the_logged_cell_weights_reproduce_the_published_topic_shares():
    "W&B logged all 200 cell weights of each stage; summed per topic they give the shares Marin published, to rounding."
    cells, published = rec.read_table("mixture"), rec.read_table("mixture_phases").dropna(subset=["cluster"])
    for phase in (0, 1):
        logged = cells[cells["stage"] == phase].drop_duplicates("component")
        assert abs(logged["weight"].sum() - 1) < 1e-5
        share = logged.groupby(logged["component"].str[:3])["weight"].sum()
        rows = published[published["phase"] == phase]
        assert len(rows) == 10 and all(abs(share[r.cluster] - r.weight) <= 0.0011 for r in rows.itertuples()), phase
    params = load_params(ROOT / "params" / f"{rec.RECORD}.yaml")
    assert [p.start_step for p in params.data.phases] == sorted(published["start_step"].unique())
    agents = [p.weights["command_line_agent_transcripts"] for p in params.data.phases]
    assert agents == published[published["cluster"] == "c13"].sort_values("phase")["weight"].tolist()  # 1.3% -> 6.0% -> 6.6%
