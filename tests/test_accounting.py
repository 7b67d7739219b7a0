import dataclasses

import pytest

from conftest import ROOT
from marin_study.accounting import flops_per_token, mean_keys_per_query, param_counts, train_compute
from marin_study.config import ModelConfig, load_params

HERO = load_params(ROOT / "params/marin-535b-a23b.yaml")
MIXTRAL = ModelConfig(vocab_size=32000, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                      max_seq_len=32768, n_experts=8, top_k=2, expert_ffn=14336, rope_theta=1e6)
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                        max_seq_len=8192, dense_ffn=14336, rope_theta=500000.0)


def close(x, target, tol=0.005): return abs(x / target - 1) < tol


def test_535b_a23b_matches_the_card():
    c = param_counts(HERO.model)
    assert c.total == 535_305_984_000
    assert close(c.total, 535.3e9) and close(c.active_body, 22.76e9)
    assert c.active == c.active_body + c.embedding + c.head
    assert c.embedding == c.head == 128256 * 6144
    assert round(HERO.train.tokens / c.active_body) == 791  # Marin's hero ladder: 791 tokens per active parameter


def test_535b_compute_is_about_2_7e24():
    assert close(HERO.train.tokens, 18.0e12, 0.001)
    assert 2.6e24 < train_compute(HERO.model, HERO.train.tokens, HERO.train.seq_len) < 2.8e24


def test_mixtral_counts_embedding_and_head_as_active():
    c = param_counts(MIXTRAL)
    assert close(c.total, 46.7e9) and close(c.active, 12.9e9)
    assert not close(c.active_body, 12.9e9, 0.01)


def test_dense_llama3_8b_exact():
    c = param_counts(LLAMA3_8B)
    assert c.total == c.active == 8_030_261_248


def test_tied_embeddings_count_once_but_the_head_matmul_still_costs():
    tied = dataclasses.replace(LLAMA3_8B, tie_embeddings=True)
    assert param_counts(LLAMA3_8B).total - param_counts(tied).total == 128256 * 4096
    assert param_counts(tied).head == 0
    assert flops_per_token(tied, 2048) == flops_per_token(LLAMA3_8B, 2048)


def test_qk_norm_latent_and_dense_layers_each_add_their_weights():
    m = HERO.model
    assert param_counts(dataclasses.replace(m, qk_norm=True)).total - param_counts(m).total == 48 * 2 * 128
    no_latent = dataclasses.replace(m, latent_dim=0)
    assert param_counts(no_latent).breakdown["routed_experts"][0] == 48 * 384 * 3 * 6144 * 3072
    first_dense = dataclasses.replace(m, n_dense_layers=1, dense_ffn=12288)
    b = param_counts(first_dense).breakdown
    assert b["dense_mlp"][0] == 3 * 6144 * 12288 and b["router"][0] == 47 * 6144 * 384


@pytest.mark.parametrize("seq_len, window", [(16, 0), (16, 5), (17, 16), (9, 1), (64, 64)])
def test_mean_keys_per_query_matches_brute_force(seq_len, window):
    w = window or seq_len
    brute = sum(min(t + 1, w) for t in range(seq_len)) / seq_len
    assert mean_keys_per_query(seq_len, window) == pytest.approx(brute)


def test_non_causal_flops_are_palms_6n_plus_12lhs():
    m, s = LLAMA3_8B, 4096
    n = param_counts(m).active_body + m.vocab_size * m.hidden_size
    assert flops_per_token(m, s, causal=False) == 6 * n + 12 * m.n_layers * m.hidden_size * s
    causal = flops_per_token(m, s)
    assert causal == pytest.approx(6 * n + 12 * m.n_layers * m.hidden_size * (s + 1) / 2)


def test_sliding_windows_reduce_attention_flops_on_local_layers_only():
    m, s = HERO.model, 4096
    full = dataclasses.replace(m, sliding_window=0)
    assert flops_per_token(m, s) < flops_per_token(full, s)
    saved = flops_per_token(full, s) - flops_per_token(m, s)
    local_layers = sum(not m.is_global(i) for i in range(m.n_layers))
    per_key = 12 * m.n_heads * m.head_dim
    assert saved == pytest.approx(local_layers * per_key * (mean_keys_per_query(s) - mean_keys_per_query(s, 2048)))
