"Loss analysis: loaders, diagnosis on healthy and planted-anomaly curves, comparison, scaling fits, bad input."
import json
import math

import numpy as np
import pandas as pd
import pytest

from marin_study.analysis import (KINDS, AnalysisError, Thresholds, compare, diagnose, findings_table, fit_scaling_law,
                                  load_curves)
from marin_study.widgets import explorer

VOCAB = 8192


def healthy(seed: int, steps: int = 1000, schedule: str = "cosine", noise: float = 0.03, evals: bool = True) -> pd.DataFrame:
    "A power-law loss with warmup, one of three schedules, per-step noise and a held-out curve every 50 steps."
    rng = np.random.default_rng(seed)
    step = np.arange(1, steps + 1)
    warm = np.minimum(step / 50, 1.0)
    progress = np.clip((step - 50) / (steps - 50), 0, 1)
    decay = {"cosine": 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * progress)), "linear": 1 - 0.95 * progress,
             "wsd": np.where(step < 0.8 * steps, 1.0, 1 - 0.95 * (step - 0.8 * steps) / (0.2 * steps))}[schedule]
    alpha, scale = rng.uniform(0.3, 0.5), rng.uniform(5, 8)
    clean = 2.5 + scale * (step / 10 + 1) ** -alpha
    df = pd.DataFrame({"step": step, "tokens": step * 4096, "loss": clean + rng.normal(0, noise, steps),
                       "lr": 3e-3 * warm * np.where(step <= 50, 1.0, decay)})
    df["loss"] = df["loss"].where(step > 1, math.log(VOCAB) + rng.normal(0, 0.01))  # untrained start
    if evals:
        at = step % 50 == 0
        df.loc[at, "eval_loss"] = clean[at] + 0.05 + rng.normal(0, 0.01, at.sum())
    return df


def planted(kind: str, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(100 + seed)
    df = healthy(seed)
    n = len(df)
    if kind == "leak":
        df["loss"] = df["loss"] - df["loss"].iloc[1] + 2.0
        df.loc[0, "loss"] = 2.1
    elif kind == "plateau":
        floor = df["loss"].iloc[int(0.15 * n)]
        df["loss"] = np.maximum(df["loss"] - rng.normal(0, 0.03, n), floor) + rng.normal(0, 0.03, n)
    elif kind == "spike":
        at = int(rng.integers(200, 800))
        df.loc[at:at + 2, "loss"] += rng.uniform(1.0, 3.0)
    elif kind == "divergence":
        at = int(rng.integers(600, 900))
        if seed % 2: df.loc[at:, "loss"] = np.nan
        else: df.loc[at:, "loss"] += np.linspace(0, 3.0, n - at)
    elif kind == "overfit":
        ev = df["eval_loss"].notna() & (df["step"] > n // 2)
        df.loc[ev, "eval_loss"] += np.linspace(0.05, 0.6, ev.sum())
    elif kind == "noisy_eval":
        ev = df["eval_loss"].notna()
        df.loc[ev, "eval_loss"] += rng.normal(0, 0.5, ev.sum())
    return df


def warnings(findings):
    return [f for f in findings if f.severity != "info"]


def test_healthy_curves_raise_no_warning():
    false_positives = []
    for seed in range(30):
        for schedule in ("cosine", "linear", "wsd"):
            found = warnings(diagnose(healthy(seed, schedule=schedule, noise=[0.01, 0.03, 0.1][seed % 3]), VOCAB))
            false_positives += [(seed, schedule, str(f)) for f in found]
    assert not false_positives, f"{len(false_positives)} false positives in 90 healthy curves: {false_positives[:3]}"


@pytest.mark.parametrize("kind", ["leak", "plateau", "spike", "divergence", "overfit", "noisy_eval"])
def test_planted_anomalies_are_found_and_nothing_else(kind):
    misses, extras = [], []
    for seed in range(15):
        found = warnings(diagnose(planted(kind, seed), VOCAB))
        kinds = {f.kind for f in found}
        if kind not in kinds: misses.append(seed)
        extras += [(seed, str(f)) for f in found if f.kind != kind and not (kind == "divergence" and f.kind == "spike")]
    assert not misses, f"{kind} missed for seeds {misses}"
    assert not extras, f"{kind}: other warnings {extras[:3]}"


def test_finding_ranges_point_at_the_anomaly():
    df = healthy(3)
    df.loc[500:502, "loss"] += 2.0  # steps 501-503
    (spike,) = [f for f in diagnose(df) if f.kind == "spike"]
    assert (spike.start_step, spike.end_step) == (501, 503) and spike.evidence["recovered_at"] is not None
    assert spike.severity == "warning"
    df = healthy(3)
    df.loc[700:, "loss"] = np.nan
    (div,) = [f for f in diagnose(df) if f.kind == "divergence"]
    assert div.start_step == 701 and div.severity == "error"


def test_schedule_phase_changes_are_explained_not_warned():
    df = healthy(1, schedule="wsd")
    df["loss"] -= 0.5 * (1 - df["lr"] / df["lr"].max()) * (df["step"] > 800)  # annealing lowers the loss
    info = [f for f in diagnose(df) if f.kind == "schedule"]
    assert [f.start_step for f in info] == [50, 801]
    assert all(f.severity == "info" for f in info)
    assert info[1].evidence["loss_slope_after"] < info[1].evidence["loss_slope_before"]  # decay steepens the fall


def test_the_interface_external_checks_use():
    df = pd.DataFrame({"step": range(1, 301), "loss": [9.0 * (s ** -0.1) for s in range(1, 301)]})
    df.loc[150, "loss"] = 30.0
    found = diagnose(df)
    assert any(f.kind == "spike" and f.start_step <= 151 <= f.end_step for f in found)
    assert set(KINDS) >= {"leak", "plateau", "spike", "divergence", "overfit", "noisy_eval"}
    table = findings_table(found)
    assert list(table.columns) == ["severity", "kind", "steps", "evidence", "action"]


def test_thresholds_are_configurable():
    df = healthy(2)
    df.loc[400:401, "loss"] += 0.18  # 6 standard deviations of the noise
    assert not [f for f in diagnose(df) if f.kind == "spike"]
    assert [f for f in diagnose(df, thresholds=Thresholds(spike_mads=3.0, spike_min=0.05)) if f.kind == "spike"]


def test_loaders_read_kit_csv_and_wandb_exports(tmp_path):
    run = tmp_path / "run-a"
    run.mkdir()
    lines = [json.dumps({"step": s, "tokens": s * 10, "loss": 5.0 - s * 0.1, "lr": 0.1, "eval/loss": 5.0 if s == 2 else None,
                         "eval/bpb": 2.0 if s == 2 else None}) for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    kit = load_curves(run)
    assert kit["run"].iloc[0] == "run-a" and kit["eval_loss"].notna().sum() == 1 and kit["eval_bpb"].iloc[1] == 2.0
    pd.DataFrame({"_step": [0, 1], "train/loss": [3.0, 2.5], "_runtime": [1, 2]}).to_csv(tmp_path / "wb.csv", index=False)
    assert load_curves(tmp_path / "wb.csv")["loss"].tolist() == [3.0, 2.5]
    (tmp_path / "wb.json").write_text(json.dumps([{"_step": 0, "lm": 3.0}, {"_step": 1, "lm": 2.0}]))
    assert load_curves(tmp_path / "wb.json", mapping={"loss": "lm"})["loss"].tolist() == [3.0, 2.0]


def test_bad_input_is_a_clear_error_or_an_explicit_finding(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(AnalysisError, match="empty"): load_curves(tmp_path / "empty.jsonl")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(AnalysisError, match="empty"): load_curves(tmp_path / "empty.csv")
    (tmp_path / "torn.jsonl").write_text('{"step": 1, "loss": 3}\n{"step": 2, "loss": 2}\n{"step": 3, "lo')
    torn = load_curves(tmp_path / "torn.jsonl")
    assert len(torn) == 2 and "torn" in torn.attrs["problems"][0].action
    assert any(f.kind == "bad_input" for f in diagnose(torn))
    (tmp_path / "middle.jsonl").write_text('{"step": 1, "loss": 3}\n{"step": 2, lo\n{"step": 3, "loss": 2}\n')
    with pytest.raises(AnalysisError, match=r"middle.jsonl:2: not valid JSON"): load_curves(tmp_path / "middle.jsonl")
    pd.DataFrame({"iteration": [1, 2], "train/lm": [3.0, 2.0]}).to_csv(tmp_path / "cols.csv", index=False)
    with pytest.raises(AnalysisError, match=r"no 'step' column .*iteration.*mapping"): load_curves(tmp_path / "cols.csv")
    with pytest.raises(AnalysisError, match="not in the file"): load_curves(tmp_path / "cols.csv", mapping={"step": "iter"})
    pd.DataFrame({"step": [1, 3, 2, 3, 4], "loss": [3.0, 2.8, 2.9, 2.7, math.nan]}).to_csv(tmp_path / "messy.csv", index=False)
    messy = load_curves(tmp_path / "messy.csv")
    assert messy["step"].tolist() == [1, 2, 3, 4] and messy.loc[2, "loss"] == 2.7
    kinds = [f.kind for f in diagnose(messy)]
    assert kinds.count("bad_input") == 2 and "divergence" in kinds
    with pytest.raises(AnalysisError, match="no 'loss' column"): diagnose(pd.DataFrame({"step": [1]}))


def test_runs_with_different_tokenizers_compare_only_in_bits_per_byte():
    a, b = healthy(0).assign(run="a", eval_bpb=1.0), healthy(1).assign(run="b", eval_bpb=1.1)
    a.attrs["tokenizer"], b.attrs["tokenizer"] = "bpe-8192", "bpe-32000"
    with pytest.raises(AnalysisError, match="different tokenizers.*eval_bpb"): compare([a, b])
    table = compare([a, b], metric="eval_bpb")
    assert set(table["run"]) == {"a", "b"}


def test_scaling_law_predicts_a_held_back_budget_within_its_uncertainty():
    tokens = np.geomspace(1e7, 1e10, 40)
    loss = 1.8 + 250 * tokens ** -0.28 + np.random.default_rng(0).normal(0, 0.003, 40)
    fit = fit_scaling_law(tokens[:30], loss[:30])
    mean, sd = fit.predict(tokens[-1])
    assert abs(float(mean) - loss[-1]) < 3 * float(sd) + 0.01 and float(sd) > 0
    with pytest.raises(AnalysisError, match="at least 4 points"): fit_scaling_law([1, 2], [3, 2])


def test_explorer_widgets_redraw_the_plot():
    box = explorer([healthy(0).assign(run="a"), healthy(1).assign(run="b")])
    runs, controls = box.children[0].children
    smoothing, axis, log = controls.children
    before = box.lines["a"].copy()
    smoothing.value = 0.9
    assert not np.allclose(before, box.lines["a"])
    runs.value = ("b",)
    assert set(box.lines) == {"b"}
    axis.value = "tokens"
    log.value = True
    assert box.figure.axes[0].get_xscale() == "log" and box.figure.axes[0].get_xlabel() == "tokens"


def test_a_collapsed_router_is_a_finding():
    df = healthy(0)
    df["moe/max_load"], df["moe/min_load"] = 1.3, 0.7
    assert not warnings(diagnose(df))
    df.loc[df["step"] > 100, ["moe/max_load", "moe/min_load"]] = [7.5, 0.0]
    (collapse,) = warnings(diagnose(df))
    assert collapse.kind == "router_collapse" and collapse.evidence["share_of_steps_with_idle_experts"] == 1.0
