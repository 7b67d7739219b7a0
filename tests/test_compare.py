"Blind comparison on two real exports of one training run (steps 2 and 8): blinding, determinism, rating, unblinding."
import json
import shutil

import pytest
from scipy.stats import binomtest

from conftest import ROOT
from marin_study.compare import CompareError, Rater, compare_samples, read_sheet, unblind
from marin_study.export import export
from marin_study.generate import Sampling
from marin_study.utils import json_lines, write_jsonl

pytest.importorskip("transformers")
QUICK = Sampling(max_new_tokens=8, temperature=0.8, top_p=0.95, seed=0)


@pytest.fixture(scope="module")
def exports(reference, pipeline, tmp_path_factory):
    "The ZeRO-0 reference run exported at step 2 (early) and step 8 (late), and six prompts of the fixed set."
    root = tmp_path_factory.mktemp("compare")
    for name, step in (("early", 2), ("late", 8)):
        export(reference(0), root / f"export-{name}", step=step, tokenizer=pipeline["root"] / "out/tokenizer.json")
    write_jsonl(root / "prompts.jsonl", [r for _, r in json_lines(ROOT / "evals/prompts/blind.jsonl")][::4])
    return root


def make(exports, out, **kw):
    "A comparison of the early (A) and late (B) export into `out`, at the quick settings, batches of 4."
    return compare_samples(exports / "export-early", exports / "export-late", out, exports / "prompts.jsonl",
                           kw.pop("sampling", QUICK), batch_size=4, **kw)


@pytest.fixture(scope="module")
def sheet_dir(exports):
    return make(exports, exports / "sheet").parent


def fresh_copy(sheet_dir, tmp_path):
    "The sheet and its key, without ratings, in a folder of their own."
    for name in ("sheet.jsonl", "key.json"): shutil.copy(sheet_dir / name, tmp_path / name)
    return tmp_path


def test_the_sheet_names_neither_export_and_shows_a_on_the_left_half_the_time(exports, sheet_dir):
    key = json.loads((sheet_dir / "key.json").read_text())
    text = (sheet_dir / "sheet.jsonl").read_text()
    secrets = [str(exports), "export-early", "export-late"]
    for side in ("a", "b"):
        record = key[side]["export"]
        secrets += [key[side]["weights_sha256"], record["source_run"], record["checkpoint_manifest_sha256"]]
    assert not [s for s in secrets if s in text]
    assert (key["a"]["export"]["step"], key["b"]["export"]["step"]) == (2, 8)
    sheet = read_sheet(sheet_dir)
    assert all(set(r) == {"pair", "prompt", "left", "right"} for r in sheet) and len(sheet) == 6
    assert list(key["a_side"].values()).count("left") == 3
    samples = {side: {r["id"]: r["completion"] for _, r in json_lines(sheet_dir / f"samples-{side}.jsonl")} for side in "ab"}
    for r in sheet:  # the key tells the truth
        b_side = "right" if key["a_side"][r["pair"]] == "left" else "left"
        assert (r[key["a_side"][r["pair"]]], r[b_side]) == (samples["a"][r["pair"]], samples["b"][r["pair"]])
    assert any(r["left"] != r["right"] for r in sheet), "two checkpoints six steps apart write different text"


def test_a_rerun_generates_nothing_a_killed_one_resumes_and_the_same_settings_give_the_same_sheet(exports, sheet_dir, tmp_path):
    written = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sheet_dir.glob("samples-*.jsonl")}
    sheet = (sheet_dir / "sheet.jsonl").read_bytes()
    make(exports, sheet_dir)
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sheet_dir.glob("samples-*.jsonl")} == written
    assert (sheet_dir / "sheet.jsonl").read_bytes() == sheet
    killed = tmp_path / "killed"
    killed.mkdir()
    shutil.copy(sheet_dir / "samples-a.jsonl", killed)
    lines = (sheet_dir / "samples-b.jsonl").read_text().splitlines(keepends=True)
    (killed / "samples-b.jsonl").write_text("".join(lines[:4]) + lines[4][:30])  # B's first batch and a torn line
    assert make(exports, killed).read_bytes() == sheet
    assert make(exports, tmp_path / "again").read_bytes() == sheet
    shutil.copytree(sheet_dir, tmp_path / "reshuffled", ignore=shutil.ignore_patterns("key.json", "sheet.jsonl"))
    reshuffled = {r["pair"]: r for r in read_sheet(make(exports, tmp_path / "reshuffled", seed=1).parent)}
    assert [r["pair"] for r in read_sheet(sheet_dir)] != list(reshuffled)
    assert all({r["left"], r["right"]} == {reshuffled[r["pair"]]["left"], reshuffled[r["pair"]]["right"]}
               for r in read_sheet(sheet_dir))


def test_every_click_is_saved_and_a_new_widget_resumes_at_the_first_unrated_pair(sheet_dir, tmp_path):
    folder = fresh_copy(sheet_dir, tmp_path)
    pairs = [r["pair"] for r in read_sheet(folder)]
    rater = Rater(folder)
    assert rater.index == 0 and rater.progress.value.startswith("pair 1 of 6, rated 0 of 6")
    rater.buttons["left"].click()
    assert [r for _, r in json_lines(folder / "ratings.jsonl")] == [{"pair": pairs[0], "rating": "left"}]
    rater.buttons["skip"].click()
    rater.buttons["right"].click()
    rater.buttons["tie"].click()
    assert rater.index == 4
    resumed = Rater(folder)
    assert resumed.index == 1 and "rated 3 of 6" in resumed.progress.value
    resumed.buttons["previous"].click()
    resumed.buttons["tie"].click()  # a second verdict replaces the first
    assert [r for _, r in json_lines(folder / "ratings.jsonl")] == [
        {"pair": pairs[0], "rating": "tie"}, {"pair": pairs[2], "rating": "right"}, {"pair": pairs[3], "rating": "tie"}]
    assert unblind(folder)["unrated"] == 3


def test_unblinding_planted_ratings_gives_the_rate_and_an_interval_around_it(sheet_dir, tmp_path):
    folder = fresh_copy(sheet_dir, tmp_path)
    a_side = json.loads((folder / "key.json").read_text())["a_side"]
    other = {"left": "right", "right": "left"}
    pairs = list(a_side)
    verdicts = [a_side[p] for p in pairs[:4]] + [other[a_side[pairs[4]]], "tie"]  # A, A, A, A, B, tie
    write_jsonl(folder / "ratings.jsonl", [{"pair": p, "rating": v} for p, v in zip(pairs, verdicts)])
    result = unblind(folder)
    assert (result["a_wins"], result["b_wins"], result["ties"], result["unrated"], result["pairs"]) == (4, 1, 1, 0, 6)
    wilson = binomtest(4, 5).proportion_ci(confidence_level=0.95, method="wilson")
    assert result["a_rate"] == 0.8 and (result["ci_low"], result["ci_high"]) == pytest.approx((wilson.low, wilson.high))
    assert result["ci_low"] < 0.8 < result["ci_high"]
    assert result["summary"] == f"A preferred in 4 of 5 decided pairs (80%, 95% CI {wilson.low:.0%}-{wilson.high:.0%}), 1 tie"
    assert result["a"].endswith("export-early") and result["b"].endswith("export-late")
    json.dumps(result)  # what the CLI prints as JSON


def test_bad_inputs_are_refused_naming_the_file_and_the_fix(exports, sheet_dir, tmp_path):
    early, late = exports / "export-early", exports / "export-late"
    with pytest.raises(CompareError, match=r"not-an-export: no config.json.*marin-study export"):
        compare_samples(early, tmp_path / "not-an-export", tmp_path / "out", exports / "prompts.jsonl", QUICK)
    with pytest.raises(CompareError, match=r"none.jsonl: no such prompts file.*--prompts"):
        compare_samples(early, late, tmp_path / "out", tmp_path / "none.jsonl", QUICK)
    with pytest.raises(CompareError, match="given as both A and B"):
        compare_samples(early, exports / "export-late/../export-early", tmp_path / "out", exports / "prompts.jsonl", QUICK)
    with pytest.raises(CompareError, match=r"key.json: made for other exports or settings \(it differs in a, b\).*new --out"):
        compare_samples(late, early, sheet_dir, exports / "prompts.jsonl", QUICK, batch_size=4)
    with pytest.raises(CompareError, match="differs in sampling"):
        make(exports, sheet_dir, sampling=Sampling(max_new_tokens=8))
    folder = fresh_copy(sheet_dir, tmp_path)
    pair = read_sheet(folder)[0]["pair"]
    for lines, message in [([{"pair": pair, "rating": "left"}, {"pair": "nope", "rating": "left"}], r"ratings.jsonl:2: pair 'nope' is not in the sheet"),
                           ([{"pair": pair, "rating": "better"}], r"ratings.jsonl:1: rating 'better' .* not one of left, right, tie"),
                           ([{"pair": pair, "rating": "left"}, {"pair": pair, "rating": "tie"}], r"ratings.jsonl:2: .* rated twice")]:
        write_jsonl(folder / "ratings.jsonl", lines)
        with pytest.raises(CompareError, match=message): unblind(folder)
        with pytest.raises(CompareError, match=message): Rater(folder)
    (folder / "key.json").unlink()
    with pytest.raises(CompareError, match="no key"): unblind(folder)
