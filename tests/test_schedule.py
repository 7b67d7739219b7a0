import dataclasses
import math

import pytest
import torch

from conftest import ROOT
from marin_study.config import load_params
from marin_study.trainer.schedule import lr_at, make_scheduler, warmup_steps

TRAIN = dataclasses.replace(load_params(ROOT / "params/tiny.yaml").train, steps=1000, lr=1e-3, warmup_fraction=0.1,
                            min_lr_ratio=0.1, decay_fraction=0.2)


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd"])
def test_every_schedule_warms_up_to_the_peak_and_ends_at_the_floor(kind):
    cfg = dataclasses.replace(TRAIN, schedule=kind)
    assert warmup_steps(cfg) == 100
    assert lr_at(0, cfg) == pytest.approx(1e-5) and lr_at(99, cfg) == pytest.approx(1e-3)
    assert lr_at(999, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(100, 1000)]
    assert all(a >= b - 1e-15 for a, b in zip(lrs, lrs[1:])), "non-increasing after warmup"


def test_schedule_shapes():
    cosine, linear, wsd = (dataclasses.replace(TRAIN, schedule=k) for k in ("cosine", "linear", "wsd"))
    middle = 100 + (999 - 100) // 2
    assert lr_at(middle, linear) == pytest.approx(1e-3 + (1e-4 - 1e-3) * (middle - 100) / 899)
    assert lr_at(middle, cosine) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * (middle - 100) / 899)))
    assert lr_at(799, wsd) == 1e-3 and lr_at(800, wsd) == 1e-3 and lr_at(900, wsd) < 1e-3


def test_scheduler_drives_the_optimizer_and_survives_a_state_dict_round_trip():
    cfg = dataclasses.replace(TRAIN, schedule="cosine")
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=cfg.lr)
    sched = make_scheduler(opt, cfg)
    for step in range(250):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(step, cfg))
        opt.step(); sched.step()
    opt2 = torch.optim.AdamW([param], lr=cfg.lr)
    sched2 = make_scheduler(opt2, cfg)
    sched2.load_state_dict(sched.state_dict())
    assert sched2.get_last_lr() == sched.get_last_lr() == [pytest.approx(lr_at(250, cfg))]
