import copy
import dataclasses
import json
import math

import pytest
import torch

from conftest import ROOT
from marin_study.config import load_params
from marin_study.model import Transformer
from marin_study.trainer.optim import BadStepsError, StepGuard, make_optimizer, param_groups, peak_lr

TINY = load_params(ROOT / "params/tiny.yaml").model
TINY_TRAIN = load_params(ROOT / "params/tiny.yaml").train


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("tie", [False, True])
def test_every_parameter_in_exactly_one_group_at_the_runs_two_learning_rates(tie, optimizer):
    model = Transformer(dataclasses.replace(TINY, tie_embeddings=tie))
    t = dataclasses.replace(TINY_TRAIN, lr=3e-3, adam_lr=7e-4, weight_decay=0.1, optimizer=optimizer)
    groups = {g["name"]: g for g in param_groups(model, t)}
    assert list(groups) == (["hidden", "router", "rest"] if tie else ["hidden", "head", "router", "rest"])
    ids = [id(p) for g in groups.values() for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    def named(group): return [names[id(p)] for p in groups[group]["params"]]
    assert all(n.endswith("router.weight") for n in named("router")) and len(named("router")) == TINY.n_layers
    assert all(n.endswith("weight") and (model.get_parameter(n).dim() == 1 or n == "embed.weight")
               for n in named("rest"))
    assert any(n.endswith("gate_up_EDF") for n in named("hidden"))
    assert any(n.endswith("qkv.weight") for n in named("hidden"))
    assert [(g["lr"], peak_lr(g, t), g["weight_decay"]) for g in groups.values()] == \
        [(3e-3, 3e-3, 0.1)] * (1 if tie else 2) + [(7e-4, 7e-4, 0.1), (7e-4, 7e-4, 0.0)]
    assert [g["use_muon"] for g in groups.values()] == [optimizer == "muon"] + [False] * (len(groups) - 1)
    assert all(p.is_expert_group == (p.dim() == 3) for p in groups["hidden"]["params"])
    assert not any("balance_bias" in n for n in names.values())
    torch.optim.AdamW(list(groups.values()))  # the groups are valid AdamW groups


def muon_layer(clip: float = 0.0):
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 16))
    t = dataclasses.replace(TINY_TRAIN, optimizer="muon", grad_clip=clip)
    return layer, make_optimizer(param_groups(layer, t), StepGuard(warmup=10), t)


def muon_step(layer, opt, loss: float = 1.0, scale: float = 1.0) -> None:
    opt.zero_grad()
    opt.begin(loss)
    (scale * layer(torch.ones(4, 8)).square().sum()).backward()
    opt.step()
    opt.end()


def test_muon_skips_a_bad_step_whole_clips_only_adamw_and_continues_bit_exact_from_its_state():
    layer, opt = muon_layer()
    muon_step(layer, opt)
    before = copy.deepcopy((layer.state_dict(), opt.state_dict()))
    muon_step(layer, opt, loss=float("nan"))  # skipped: weights, momentum and Adam's moments as they were
    assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), before[0].values()))
    assert all(torch.equal(a, b) for s, t in zip(opt.state_dict()["state"].values(), before[1]["state"].values())
               for a, b in zip(s.values(), t.values()) if torch.is_tensor(a))
    copy_layer, copy_opt = muon_layer()
    copy_layer.load_state_dict(layer.state_dict()); copy_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from disk
    muon_step(layer, opt); muon_step(copy_layer, copy_opt)
    assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), copy_layer.state_dict().values()))
    # a resume takes each group's peak from the params it resumes with, not from the checkpoint's copy of the group
    faster = dataclasses.replace(TINY_TRAIN, optimizer="muon", lr=0.5, adam_lr=0.25)
    assert [peak_lr(g, faster) for g in copy_opt.param_groups] == [0.5, 0.25]
    # clipping scales every group's gradient, Muon's before it enters the momentum
    clipped, free = muon_layer(clip=1e-3), muon_layer(clip=0.0)
    muon_step(*clipped); muon_step(*free)
    norm = clipped[1].decision[0]
    assert norm > 1e-3
    momentum = [(clipped[1].state[p]["momentum_buffer"], free[1].state[q]["momentum_buffer"])
                for p, q in zip(clipped[1].param_groups[0]["params"], free[1].param_groups[0]["params"])]
    assert all(torch.allclose(a, b * 1e-3 / (norm + 1e-6)) for a, b in momentum)
    for name, p in clipped[0].named_parameters():
        if p.dim() == 1: assert torch.allclose(p.grad, free[0].get_parameter(name).grad * 1e-3 / (norm + 1e-6)), name


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
def test_guard_replays_a_healthy_tiny_run_and_skips_at_most_an_isolated_spike(run):
    steps, recorded = load_params(ROOT / "params/tiny.yaml").train.steps, HEALTHY_RUNS[run]
    assert len(HEALTHY_RUNS) == 8 and len(recorded["loss"]) == steps
    skipped = replay(tiny_guard(), recorded["loss"], recorded["grad_norm"])
    assert skipped == recorded["skipped"]  # the numbers alone decide, the same across the run's stop and resume
    assert len(skipped) <= steps // 200 and all(later - earlier > 1 for earlier, later in zip(skipped, skipped[1:]))


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
    before = sum(step <= 200 for step in HEALTHY_RUNS[run]["skipped"])  # the run's own isolated skips, if any
    assert guard.accepted == 200 - before and guard.bad_total == guard.max_bad + before  # stopped at step 205


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
