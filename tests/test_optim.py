import dataclasses
import json
import math

import pytest
import torch

from conftest import ROOT
from marin_study.config import load_params
from marin_study.model import Transformer
from marin_study.trainer.optim import BadStepsError, StepGuard, param_groups

TINY = load_params(ROOT / "params/tiny.yaml").model


@pytest.mark.parametrize("tie", [False, True])
def test_every_parameter_in_exactly_one_group_and_no_decay_on_norms_or_embeddings(tie):
    model = Transformer(dataclasses.replace(TINY, tie_embeddings=tie))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith("weight") and (p.dim() == 1 or names[id(p)] == "embed.weight") for p in no_decay["params"])
    assert any(names[id(p)].endswith("gate_up_EDF") for p in decay["params"])
    assert not any("balance_bias" in n for n in names.values())
    torch.optim.AdamW([decay, no_decay], lr=1e-3)  # the groups are valid AdamW groups


def test_guard_accepts_noise_and_rejects_spikes_and_nans():
    guard = StepGuard(window=30, sigmas=6, max_bad_in_a_row=3, warmup=10)
    for step in range(30): assert guard.check(2.0 + 0.01 * math.sin(step), 1.0 + 0.01 * math.cos(step)) is None
    assert "loss" in guard.check(3.0, 1.0)
    assert "grad_norm" in guard.check(2.0, 5.0)
    assert guard.check(2.0, 1.0) is None and guard.bad_in_a_row == 0 and guard.bad_total == 2
    assert guard.check(float("inf"), 1.0) == "loss is inf"
    assert guard.check(2.0, float("nan")) == "grad_norm is nan"


HEALTHY_RUNS = json.loads((ROOT / "tests/data/tiny_healthy_runs.json").read_text())  # tests/slow/tiny_robustness.py wrote it


def replay(guard: StepGuard, loss: list[float], grad_norm: list[float]) -> list[int]:
    "Feed a run's sequences to the guard as the trainer does; the steps it would skip (raises when it stops the run)."
    return [step for step, (l, g) in enumerate(zip(loss, grad_norm), 1) if guard.check(l, g) is not None]


def tiny_guard() -> StepGuard:
    t = load_params(ROOT / "params/tiny.yaml").train
    return StepGuard(t.spike_window, t.spike_sigmas, t.max_bad_steps, t.spike_warmup)


@pytest.mark.parametrize("run", sorted(HEALTHY_RUNS))
def test_guard_never_skips_a_step_of_a_healthy_tiny_run(run):
    assert len(HEALTHY_RUNS) == 8 and len(HEALTHY_RUNS[run]["loss"]) == 300
    assert replay(tiny_guard(), HEALTHY_RUNS[run]["loss"], HEALTHY_RUNS[run]["grad_norm"]) == []


@pytest.mark.parametrize("run", sorted(HEALTHY_RUNS)[:2])
def test_guard_stops_a_planted_blow_up_and_lets_a_warmup_transient_through(run):
    loss, grad_norm = list(HEALTHY_RUNS[run]["loss"]), list(HEALTHY_RUNS[run]["grad_norm"])
    grad_norm[21] *= 100  # a routing flip in the first steps: one step's gradient norm jumps, the next is normal
    for k in range(200, 300):  # from step 201 the loss climbs away and the gradient norm grows by orders of magnitude
        loss[k] = loss[199] + 0.5 * (k - 199)
        grad_norm[k] = grad_norm[199] * 10 ** (1 + (k - 200) / 10)
    guard = tiny_guard()
    with pytest.raises(BadStepsError, match=f"{guard.max_bad} bad steps in a row"):
        replay(guard, loss, grad_norm)
    assert guard.accepted == 200 and guard.bad_total == guard.max_bad  # stopped at step 205, nothing before skipped


def test_guard_judges_nothing_but_non_finite_values_during_its_warmup():
    guard = StepGuard(window=10, warmup=20)
    assert [guard.check(9.0 - 0.1 * s, 50.0 if s == 7 else 1.0) for s in range(20)] == [None] * 20
    assert not guard.history["loss"] and guard.check(float("nan"), 1.0) == "loss is nan"
    for s in range(5): assert guard.check(7.0, 1.0) is None  # the window is half full after these
    assert "grad_norm" in guard.check(7.0, 50.0)


def test_guard_stops_after_too_many_bad_steps_in_a_row():
    guard = StepGuard(max_bad_in_a_row=2, warmup=0)
    guard.check(2.0, 1.0)
    guard.check(float("nan"), 1.0)
    with pytest.raises(BadStepsError, match="2 bad steps in a row"):
        guard.check(float("nan"), 1.0)


def test_guard_state_survives_a_checkpoint():
    guard = StepGuard(window=20, warmup=5)
    for step in range(25): guard.check(1.0 + 0.001 * step, 1.0)
    guard.check(float("nan"), 1.0)
    restored = StepGuard(window=20, warmup=5)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()
    assert restored.check(100.0, 1.0) == guard.check(100.0, 1.0)
