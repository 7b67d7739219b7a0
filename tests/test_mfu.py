import dataclasses

import pytest

from conftest import ROOT
from marin_study.accounting import (KIT, LEVANTER, MARIN_535B, PALM, REFERENCE_RUNS, TORCHTITAN_2024_04, MFUError,
                                    FlopsConvention, flops_per_token, mean_keys_per_query, mfu, model_flops_per_token,
                                    param_counts, reproduce)
from marin_study.config import load_params
from marin_study.hardware import device

HERO = load_params(ROOT / "params/marin-535b-a23b.yaml")
RUNS = {r.name: r for r in REFERENCE_RUNS}


@pytest.mark.parametrize("run", REFERENCE_RUNS, ids=lambda r: r.name)
def test_each_reference_run_reproduces_its_published_mfu_from_its_throughput(run):
    assert abs(reproduce(run) - run.published_mfu) <= run.tolerance
    assert run.source and run.tolerance <= 0.01
    assert run.peak_flops == pytest.approx(device(run.device).peak_flops, rel=0.001)  # the dense peak, as catalogued


def test_the_table_has_marin_and_three_more_runs_and_marins_row_is_the_hero_shape():
    assert len({r.source.split()[0] for r in REFERENCE_RUNS}) >= 2 and len(REFERENCE_RUNS) >= 3
    assert MARIN_535B == dataclasses.replace(HERO.model, qk_norm=False, rope_theta=MARIN_535B.rope_theta,
                                             logit_z_loss_weight=MARIN_535B.logit_z_loss_weight,
                                             aux_loss_weight=MARIN_535B.aux_loss_weight)


def test_sliding_windows_counted_as_full_attention_miss_marins_mfu():
    run = next(r for r in REFERENCE_RUNS if r.convention == LEVANTER)
    full = dataclasses.replace(LEVANTER, window=False)
    assert abs(reproduce(run, full) - run.published_mfu) > run.tolerance
    m, s = MARIN_535B, 4096
    local = sum(not m.is_global(i) for i in range(m.n_layers))
    extra = model_flops_per_token(m, s, full) - model_flops_per_token(m, s, LEVANTER)
    assert extra == local * (s - m.sliding_window) * (12 * m.n_heads * m.head_dim + 9 * m.n_heads)


def test_the_sparse_h100_peak_halves_the_mfu_and_misses():
    assert device("h100").peak_flops == 989.5e12  # dense bf16; 1979 is the 2:4-sparse datasheet figure
    for run in (r for r in REFERENCE_RUNS if r.device == "h100"):
        assert reproduce(run, peak_flops=1979e12) == pytest.approx(reproduce(run) / 2, rel=0.001)
        assert abs(reproduce(run, peak_flops=1979e12) - run.published_mfu) > run.tolerance


def test_causal_halving_and_the_embedding_are_what_separate_the_conventions():
    h100 = RUNS["torchtitan Llama 3.1 8B, 8 H100, FSDP + torch.compile"]
    assert abs(reproduce(h100, KIT) - h100.published_mfu) > 0.03  # the kit's causal discount: 34.7%, not 39%
    a100 = next(r for r in REFERENCE_RUNS if r.convention == TORCHTITAN_2024_04)
    assert abs(reproduce(a100, PALM) - a100.published_mfu) > 0.03  # embedding left out: 53.9%, not 58.2%
    m = a100.model
    assert (model_flops_per_token(m, 8192, TORCHTITAN_2024_04) - model_flops_per_token(m, 8192, PALM)
            == 6 * param_counts(m).embedding)


def test_mfu_above_one_or_from_nonsense_is_refused():
    run = RUNS["torchtitan Llama 3.1 8B, 8 H100, FSDP"]
    flops = model_flops_per_token(run.model, run.seq_len, run.convention)
    with pytest.raises(MFUError, match="above the peak"):
        mfu(flops, run.tokens_per_sec_per_device * 8, run.peak_flops, devices=1)  # 8 GPUs' tokens over one GPU's peak
    assert mfu(flops, run.tokens_per_sec_per_device * 8, run.peak_flops, devices=8) == pytest.approx(reproduce(run))
    for bad in [(0, 1, 1, 1), (1, -1, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0)]:
        with pytest.raises(MFUError): mfu(*bad)


def test_the_kit_default_is_flops_per_token_and_named():
    m, s = HERO.model, HERO.train.seq_len
    assert flops_per_token(m, s) == model_flops_per_token(m, s, KIT)
    assert flops_per_token(m, s, causal=False) == model_flops_per_token(m, s, PALM)
    assert KIT.causal and KIT.window and KIT.head and not KIT.embedding and KIT.name.startswith("kit")
    n = param_counts(m).active_body + m.vocab_size * m.hidden_size
    keys = sum(mean_keys_per_query(s, 0 if m.is_global(i) else m.sliding_window) for i in range(m.n_layers))
    assert model_flops_per_token(m, s) == 6 * n + 12 * m.n_heads * m.head_dim * keys
    assert model_flops_per_token(m, s, FlopsConvention("6N", attention=False)) == 6 * n


def test_the_hero_cards_22_9_percent_is_per_training_step_not_per_wall_clock_step():
    tokens, flops = 11264 * 4096, model_flops_per_token(MARIN_535B, 4096, LEVANTER)
    assert mfu(flops, tokens / 19.8, 2.5e15, 704) == pytest.approx(0.198, abs=0.005)  # the card's 19.8 s/step
    one_rack = RUNS["Marin 535B-A23B shape, one GB200 NVL72 rack (64 GPUs), ragged EP64"]
    step_at_22_9 = flops * tokens / (0.229 * 2.5e15 * 704)
    assert step_at_22_9 == pytest.approx(tokens / (one_rack.tokens_per_sec_per_device * 704), rel=0.03)
