"Loss analysis: loaders, diagnosis on healthy and planted-anomaly curves, router health, comparison, scaling fits, bad input."
import json
import math

import numpy as np
import pandas as pd
import pytest

from marin_study.analysis import (KINDS, SANE_EXPONENT, AnalysisError, Thresholds, compare, diagnose, findings_table,
                                  fit_scaling_law, load_curves, plot_router_load, router_health_frame)
from marin_study.trainer.metrics import ROUTER_HEALTH_METRICS, moe_layer_key, router_health
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
    assert fit.degenerate is None
    with pytest.raises(AnalysisError, match="at least 4 points"): fit_scaling_law([1, 2], [3, 2])


@pytest.mark.parametrize("seed", range(5))
def test_a_scaling_fit_without_a_trend_is_degenerate_not_a_target(seed):
    rng, tokens = np.random.default_rng(seed), np.geomspace(1e6, 4e6, 12)
    flat = fit_scaling_law(tokens, 3.0 + rng.normal(0, 0.01, 12), bootstrap=10)  # noise only: the fit's exponent means nothing
    steep = fit_scaling_law(tokens, 2.0 + 1e9 * tokens ** -2.5 + rng.normal(0, 1e-4, 12), bootstrap=10)  # an exponent no LM has
    for fit in (flat, steep):
        assert fit.degenerate, (fit.E, fit.A, fit.alpha)
    assert not SANE_EXPONENT[0] <= steep.alpha <= SANE_EXPONENT[1] and "exponent" in steep.degenerate


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


def test_a_loss_that_does_not_fall_is_no_progress_not_plateau():
    rng = np.random.default_rng(7)
    base = healthy(0)
    flat = base.assign(loss=math.log(VOCAB) + rng.normal(0, 0.03, len(base)))
    barely = base.assign(loss=math.log(VOCAB) - 0.6 * base["step"] / len(base) + rng.normal(0, 0.03, len(base)))
    frozen = flat.assign(lr=0.0)
    for name, df in [("flat", flat), ("barely", barely), ("frozen", frozen)]:
        found = warnings(diagnose(df.drop(columns="eval_loss"), VOCAB))
        assert [f.kind for f in found] == ["no_progress"], (name, [str(f) for f in found])
        (stuck,) = found
        assert stuck.severity == "warning" and (stuck.start_step, stuck.end_step) == (1, 200), name
        assert stuck.evidence["early_drop"] < Thresholds().min_early_drop
        assert all(word in stuck.action for word in ("learning rate", "labels", "shifted by one", "requires_grad", "optimizer"))
    assert [f for f in diagnose(frozen) if f.kind == "no_progress"][0].evidence["peak_lr"] == 0.0
    assert not [f for f in diagnose(barely, thresholds=Thresholds(min_early_drop=0.05)) if f.kind == "no_progress"]


def test_a_long_warmup_is_judged_over_twice_its_length():
    df = healthy(1)
    warm = 300  # the loss waits for the learning rate, then falls
    df["lr"] = 3e-3 * np.minimum(df["step"] / warm, 1.0)
    df["loss"] = np.where(df["step"] < 250, math.log(VOCAB), df["loss"].shift(249)).astype(float)
    df["loss"] += np.random.default_rng(1).normal(0, 0.03, len(df))
    assert not [f for f in diagnose(df, VOCAB) if f.kind == "no_progress"]
    assert [f for f in diagnose(df.drop(columns="lr"), VOCAB) if f.kind == "no_progress"]  # without the lr: 20% of the run


def test_a_flat_kit_log_gives_no_progress_through_the_external_interface(tmp_path):
    rng = np.random.default_rng(3)
    lines = [json.dumps({"step": s, "tokens": s * 4096, "loss": 9.01 + float(rng.normal(0, 0.02)), "lr": 1e-3,
                         "grad_norm": 0.0, "moe/max_load": 1.1, "moe/min_load": 0.9}) for s in range(1, 301)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    found = warnings(diagnose(load_curves(tmp_path), vocab_size=VOCAB))
    assert [f.kind for f in found] == ["no_progress"] and "no_progress" in KINDS


def blown_up(seed: int, running_count: bool = True) -> pd.DataFrame:
    "A healthy run whose gradient norm jumps 0.4 -> 65-95 for four steps that the guard skips, as in a real blow-up."
    rng, df = np.random.default_rng(200 + seed), healthy(seed)
    df["grad_norm"] = 0.4 * np.exp(rng.normal(0, 0.1, len(df)))
    at = int(rng.integers(200, 800))
    df.loc[at:at + 3, "grad_norm"] = rng.uniform(65, 95, 4)
    skipped = (df.index >= at) & (df.index <= at + 3)
    df["bad_steps"] = np.cumsum(skipped) if running_count else skipped.astype(int)
    return df


@pytest.mark.parametrize("running_count", [True, False])
def test_gradient_spikes_and_skipped_steps_are_findings(running_count):
    misses = []
    for seed in range(10):
        df = blown_up(seed, running_count)
        at = int(df["step"][df["grad_norm"] > 10].iloc[0])
        found = {f.kind: f for f in warnings(diagnose(df, VOCAB))}
        if set(found) != {"grad_spike", "skipped_steps"}: misses.append((seed, sorted(found))); continue
        assert (found["grad_spike"].start_step, found["grad_spike"].end_step) == (at, at + 3)
        assert found["grad_spike"].evidence["ratio"] > 100
        assert found["skipped_steps"].evidence == {"skipped": 4, "steps": f"{at}-{at + 3}"}
    assert not misses, misses
    noisy = blown_up(0).assign(bad_steps=0)
    noisy["grad_norm"] = 0.4 * np.exp(np.random.default_rng(9).normal(0, 0.3, len(noisy)))  # noisy, never 5x
    assert not warnings(diagnose(noisy, VOCAB))


def test_the_interface_external_checks_use_for_gradients_and_skips():
    "A short frame with only step, loss, grad_norm and bad_steps: the spike and the skips are found, even early on."
    steps = np.arange(1, 41)
    df = pd.DataFrame({"step": steps, "loss": 9.0 * steps ** -0.1, "grad_norm": np.where(steps == 8, 60.0, 0.5),
                       "bad_steps": np.cumsum(np.isin(steps, [8, 9]))})
    found = {f.kind: f for f in diagnose(df)}
    assert found["grad_spike"].start_step == 8 and found["skipped_steps"].evidence["steps"] == "8-9"


def test_one_skipped_step_is_a_warning_naming_it_with_the_guards_reason():
    df = healthy(4)
    df["skipped"] = None
    df.loc[[99, 100, 499], "skipped"] = True
    df.loc[99, "skip_reason"] = "grad_norm 12.5 > 3.1 (mean 1.2 + 6 std)"
    (skips,) = warnings(diagnose(df, VOCAB))
    assert skips.kind == "skipped_steps" and skips.severity == "warning"
    assert skips.evidence == {"skipped": 3, "steps": "100-101, 500", "first_reason": "grad_norm 12.5 > 3.1 (mean 1.2 + 6 std)"}
    assert "skipped 3" in findings_table([skips])["evidence"][0]


def test_skipped_steps_read_from_the_trainers_own_columns_the_flag_and_the_running_count(tmp_path):
    from marin_study.trainer.metrics import MetricsLog
    df = healthy(4)
    skipped = df["step"].isin([100, 101, 500])
    records = [{"step": int(r.step), "loss": float(r.loss), "bad_steps": int(n), **({"skipped": True} if s else {})}
               for r, n, s in zip(df.itertuples(), skipped.cumsum(), skipped)]
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for record in records: log.write(record)
    (skips,) = [f for f in diagnose(load_curves(tmp_path / "metrics.jsonl"), VOCAB) if f.kind == "skipped_steps"]
    assert skips.evidence == {"skipped": 3, "steps": "100-101, 500"}


def test_router_imbalance_early_or_idle_is_a_finding_beside_collapse():
    df = routed({2: (6.0, 0.5)})
    df[moe_layer_key(0, "max_load")] = np.where(df["step"].between(10, 120), 8.0, 1.3)  # overloaded early, then recovers
    df[moe_layer_key(3, "idle")] = np.where(df["step"] % 3 == 0, 0.0, 1 / 32)  # an idle expert on 2 steps of 3
    found = warnings(diagnose(df, VOCAB))
    assert [(f.kind, f.evidence.get("layers") or f.evidence.get("layers_with_idle_experts")) for f in found] == [
        ("router_imbalance", "3"), ("router_imbalance", "0"), ("router_collapse", "2")]
    idle, early = found[0], found[1]
    assert 0.6 < idle.evidence["share_of_steps_with_idle_experts"] < 0.7 and (idle.start_step, idle.end_step) == (1, 1000)
    assert early.evidence["peak_median_max_load"] == 8.0 and abs(early.start_step - 10) <= 12 and abs(early.end_step - 120) <= 12  # a window of 25
    aggregate = healthy(0).assign(**{"moe/max_load": np.where(healthy(0)["step"] < 200, 9.0, 1.2), "moe/min_load": 0.5})
    assert [f.kind for f in warnings(diagnose(aggregate, VOCAB))] == ["router_imbalance"]


def test_the_real_tiny_run_makes_progress():
    from conftest import ROOT
    path = ROOT / "reports/train_tiny_metrics.jsonl"
    if not path.exists(): pytest.skip("no tiny run yet (dvc repro train_tiny)")
    from conftest import unexpected_in_tiny
    found = diagnose(load_curves(path), vocab_size=VOCAB)
    assert not unexpected_in_tiny(found)


def routed(collapsed: dict[int, tuple[float, float]], layers: int = 4, seed: int = 0) -> pd.DataFrame:
    "A healthy run with per-layer router keys; `collapsed` maps a layer to its (max_load, idle) after step 100."
    rng, df = np.random.default_rng(seed), healthy(seed)
    for layer in range(layers):
        load, idle = collapsed.get(layer, (1.3, 0.0))
        late = df["step"] > 100
        df[moe_layer_key(layer, "max_load")] = np.where(late, load, 1.3) + rng.normal(0, 0.05, len(df))
        df[moe_layer_key(layer, "idle")] = np.where(late, idle, 0.0)
        df[moe_layer_key(layer, "entropy")] = np.where(late & (layer in collapsed), 0.5, 0.98)
        df[moe_layer_key(layer, "bias_norm")] = 1e-3 * np.sqrt(df["step"])
    return df


def test_router_collapse_is_judged_per_layer_and_names_the_layers():
    assert not warnings(diagnose(routed({}), VOCAB))
    (one,) = warnings(diagnose(routed({1: (7.0, 0.0), 3: (5.0, 0.0)}), VOCAB))
    assert one.kind == "router_collapse" and one.evidence["layers"] == "1, 3" and one.evidence["worst_layer"] == 1
    assert "MoE layers 1, 3:" in one.action and "moe/layer1/max_load" in one.action
    (idle,) = warnings(diagnose(routed({0: (1.6, 0.4)}), VOCAB))  # experts starved, the busiest not yet 4x the mean
    assert idle.evidence["layers"] == "0" and idle.evidence["median_idle_share"] == 0.4 and "MoE layer 0:" in idle.action
    both = routed({2: (6.0, 0.5)}).assign(**{"moe/max_load": 6.0, "moe/min_load": 0.0})  # per-layer keys win, once
    assert [f.evidence["layers"] for f in warnings(diagnose(both, VOCAB))] == ["2"]
    assert not warnings(diagnose(routed({}).assign(**{"moe/max_load": 1.3, "moe/min_load": 0.7}), VOCAB))


def test_router_health_of_a_planted_skew():
    import torch
    load_LE = torch.tensor([[64.0] * 8,                          # layer 0: perfectly even
                            [512.0] + [0.0] * 7,                 # layer 1: everything on one expert
                            [200.0, 200.0, 112.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    bias_LE = torch.zeros(3, 8)
    bias_LE[1] = torch.tensor([-0.004] + [0.001] * 7)
    health = router_health(load_LE, bias_LE)
    assert list(health) == [moe_layer_key(l, n) for l in range(3) for n in ROUTER_HEALTH_METRICS]
    assert list(health) == ["moe/layer0/max_load", "moe/layer0/idle", "moe/layer0/entropy", "moe/layer0/bias_norm"] + list(health)[4:]
    assert health["moe/layer0/max_load"] == 1.0 and health["moe/layer0/idle"] == 0.0
    assert health["moe/layer0/entropy"] == pytest.approx(1.0) and health["moe/layer0/bias_norm"] == 0.0
    assert health["moe/layer1/max_load"] == 8.0 and health["moe/layer1/idle"] == 0.875 and health["moe/layer1/entropy"] == 0.0
    assert health["moe/layer1/bias_norm"] == pytest.approx(math.sqrt(0.004 ** 2 + 7 * 0.001 ** 2))
    p = np.array([200, 200, 112]) / 512
    assert health["moe/layer2/max_load"] == pytest.approx(200 / 64) and health["moe/layer2/idle"] == 0.625
    assert health["moe/layer2/entropy"] == pytest.approx(-(p * np.log(p)).sum() / math.log(8))
    with pytest.raises(ValueError, match="unknown MoE layer metric"): moe_layer_key(0, "max")


def test_router_health_frame_and_plot():
    df = routed({2: (6.0, 0.5)}, layers=3)
    long = router_health_frame(df)
    assert list(long.columns) == ["step", "layer", "metric", "value"] and len(long) == 1000 * 3 * 4
    assert long[(long.layer == 2) & (long.metric == "idle") & (long.step == 1000)]["value"].item() == 0.5
    assert router_health_frame(healthy(0)).empty
    fig = plot_router_load(df, bins=50)
    heat = fig.axes[0].collections[0].get_array()
    assert heat.shape == (3, 50) and heat[2, -1] > 5 and heat[0, -1] < 2
    with pytest.raises(AnalysisError, match="no per-layer router keys"): plot_router_load(healthy(0))


def test_drops_past_capacity_are_named_per_layer_and_warned_past_one_percent(tmp_path):
    "Issue 36: a run with model.capacity_factor logs moe/layer<i>/drop_fraction; the report names them, through a file."
    df = routed({}, layers=3)
    for layer, share in enumerate([0.0002, 0.0005, 0.003]):
        df[moe_layer_key(layer, "drop_fraction")] = share
    df.to_json(tmp_path / "metrics.jsonl", orient="records", lines=True)
    curves = load_curves(tmp_path / "metrics.jsonl")
    (note,) = [f for f in diagnose(curves, VOCAB) if f.kind == "router_drops"]
    assert note.severity == "info" and note.evidence["worst_layer"] == 2
    assert note.evidence["mean_drop_fraction"] == pytest.approx((0.0002 + 0.0005 + 0.003) / 3)
    df[moe_layer_key(1, "drop_fraction")] = np.where(df["step"] > 500, 0.05, 0.0)  # layer 1 drops 5% late in the run
    (warned,) = [f for f in warnings(diagnose(df, VOCAB)) if f.kind == "router_drops"]
    assert warned.evidence["worst_layer"] == 1 and "model.capacity_factor" in warned.action
    assert not [f for f in diagnose(routed({}), VOCAB) if f.kind == "router_drops"]  # dropless runs say nothing
    assert plot_router_load(df).axes[3].get_title() == "share of routed rows dropped"


def test_text_where_a_number_belongs_names_the_file_line_and_column(tmp_path):
    (tmp_path / "text.csv").write_text("step,loss\n1,abc\n2,def\n")
    with pytest.raises(AnalysisError, match=r"text.csv:2: 'loss' is 'abc', not a number"): load_curves(tmp_path / "text.csv")
    (tmp_path / "one.csv").write_text("step,loss\n1,3.0\n\n2,oops\n3,2.5\n")  # a blank line still counts as a line
    with pytest.raises(AnalysisError, match=r"one.csv:4: 'loss' is 'oops'"): load_curves(tmp_path / "one.csv")
    (tmp_path / "renamed.csv").write_text("_step,train/loss\n1,3.0\n2,x\n")
    with pytest.raises(AnalysisError, match=r"renamed.csv:3: 'train/loss' is 'x'"): load_curves(tmp_path / "renamed.csv")
    (tmp_path / "text.jsonl").write_text('{"step": 1, "loss": 3.0}\n\n{"step": 2, "loss": "high"}\n')
    with pytest.raises(AnalysisError, match=r"text.jsonl:3: 'loss' is 'high'"): load_curves(tmp_path / "text.jsonl")
    (tmp_path / "step.csv").write_text("step,loss\n1,3.0\ntwo,2.0\n")
    with pytest.raises(AnalysisError, match=r"step.csv:3: 'step' is 'two'"): load_curves(tmp_path / "step.csv")
    (tmp_path / "nan.csv").write_text("step,loss\n1,3.0\n2,NaN\n3,inf\n4,\n5,2.0\n")  # spelled-out non-finite numbers are numbers
    assert load_curves(tmp_path / "nan.csv")["loss"].isna().sum() == 2


def test_unreadable_files_and_non_object_lines_are_clear_errors(tmp_path):
    (tmp_path / "bin.csv").write_bytes(b"step,loss\n\xff,1\n")
    with pytest.raises(AnalysisError, match=r"bin.csv: not UTF-8 text"): load_curves(tmp_path / "bin.csv")
    (tmp_path / "bin.jsonl").write_bytes(b'{"step": 1, "loss": 3}\n\xff\xfe\n')
    with pytest.raises(AnalysisError, match=r"bin.jsonl(:2)?: .*UTF-8"): load_curves(tmp_path / "bin.jsonl")
    (tmp_path / "list.jsonl").write_text('{"step": 1, "loss": 3}\n[2, 2.5]\n')
    with pytest.raises(AnalysisError, match=r"list.jsonl:2: not a JSON object"): load_curves(tmp_path / "list.jsonl")
    (tmp_path / "ragged.csv").write_text("step,loss\n1,3.0\n2,2.5,9,9\n")
    with pytest.raises(AnalysisError, match=r"ragged.csv: not a CSV table"): load_curves(tmp_path / "ragged.csv")
    with pytest.raises(AnalysisError, match="no such file"): load_curves(tmp_path / "nope.csv")


def test_a_loss_column_of_nans_names_the_file_and_the_fix(tmp_path):
    (tmp_path / "nans.csv").write_text("step,loss\n1,nan\n2,\n")
    with pytest.raises(AnalysisError) as info: diagnose(load_curves(tmp_path / "nans.csv"))
    assert str(info.value).startswith(f"{tmp_path / 'nans.csv'}: every 'loss' is empty or NaN (2 rows)")
    assert "mapping={'loss'" in str(info.value) and "\n" not in str(info.value)
    (tmp_path / "cols.csv").write_text("step,lr\n1,0.1\n")
    with pytest.raises(AnalysisError) as info: load_curves(tmp_path / "cols.csv")
    assert "--map" not in str(info.value) and "rename" in str(info.value)  # no command has a --map option


def test_a_mixture_switch_is_a_note_that_explains_the_step_in_the_loss_not_a_spike():
    "The loss steps up where the data gets harder (the Marin run's switch at step 108,000): a note at that step."
    df = healthy(3)
    df["data_phase"] = (df["step"] >= 600).astype(int)
    df.loc[df["step"] >= 600, "loss"] += 0.04
    found = diagnose(df, vocab_size=VOCAB)
    switch = [f for f in found if f.kind == "mixture"]
    assert len(switch) == 1 and switch[0].start_step == 600 and switch[0].severity == "info"
    assert switch[0].evidence["loss_after"] > switch[0].evidence["loss_before"] and "mixture" in KINDS
    assert not [f for f in found if f.severity != "info"]
    assert not [f for f in diagnose(healthy(3), vocab_size=VOCAB) if f.kind == "mixture"]  # no phase column, no note


def test_the_final_loss_and_held_out_bpb_have_one_definition_that_card_summary_and_reports_share(tmp_path):
    "Chapter 08's functions make the run card's, train_tiny.json's and the reports' numbers, which agree on one log."
    from conftest import ROOT
    from marin_study.analysis import FINAL_LOSS_KEY, final_heldout, final_train_loss, run_summary
    from marin_study.config import load_params
    from marin_study.run_card import outcome
    from marin_study.utils import write_jsonl
    losses = {s: 9.0 - s / 10 + (0.3 if s % 2 else -0.3) for s in range(1, 41)}  # one step's loss swings with its batch
    write_jsonl(tmp_path / "metrics.jsonl", [
        {"step": s, "tokens": s * 4096, "loss": losses[s], **({"skipped": True} if s == 35 else {}),
         **({"eval/loss": 7.0 - s / 100, "eval/bpb": 3.0 - s / 100, "eval/web/bpb": 2.9 - s / 100} if s % 20 == 0 else {})}
        for s in range(1, 41)])
    params = load_params(ROOT / "params/tiny.yaml")
    card, curves = outcome(tmp_path, params), load_curves(tmp_path / "metrics.jsonl")
    summary = run_summary(curves, params.train.eval_samples)
    kept = [losses[s] for s in range(1, 41) if s != 35][-20:]  # the last 20 steps the guard did not skip
    assert card["final"]["loss"]["value"] == summary[FINAL_LOSS_KEY] == final_train_loss(curves)["value"] == pytest.approx(np.mean(kept))
    assert card["final"]["loss"]["mean_of_last_steps"] == 20 and FINAL_LOSS_KEY == "final_train_loss_last20_mean"
    assert card["final"]["eval/bpb"]["value"] == summary["heldout_sample_bpb"] == final_heldout(curves)["bpb"] == pytest.approx(2.6)
    assert card["final"]["eval/bpb"]["heldout_sample_windows_per_domain"] == summary["heldout_sample_windows_per_domain"]
    assert summary["heldout_sample_bpb_web"] == pytest.approx(2.5)
    # the studies take these functions instead of a window of their own
    train, report = ((ROOT / f"nbs/studies/{n}.ipynb").read_text() for n in ("train_tiny", "loss_report"))
    assert "run_summary(" in train and "final_train_loss(" in report and "final_heldout(" in report
    assert "iloc[-20:]" not in train and "ewm(alpha=0.05).mean().iloc[-1]" not in report
