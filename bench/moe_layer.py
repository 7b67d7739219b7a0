"""Forward+backward tokens per second: marin_study's MoE block and whole model against Hugging Face's Qwen3-MoE.

Both are built from a config at identical shapes (the tiny preset's: hidden 128, 4 layers, 4 heads, 1 KV head,
head size 32, 32 experts top-4 of width 64, vocab 8192), random weights, no download; same batch (B=8, T=256),
same thread count, same dtype, in one process. Qwen3-MoE has a softmax router, QK-norm, no shared or latent
experts and no sliding window, so our model is configured the same way for the comparison. Transformers 5 runs its
experts through torch._grouped_mm by default ("grouped_mm"); "eager" is its per-expert loop.

Rounds alternate between the contenders so that both see the same machine state; the figure is the median.
Ends with `ratio: X`, ours over Hugging Face's default, whole model, fp32.
"""
import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from marin_study.config import load_params
from marin_study.model import MoE, Transformer


def qwen3_config(cfg, experts_implementation):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.expert_ffn,
        intermediate_size=cfg.expert_ffn, norm_topk_prob=True, max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False, use_sliding_window=False,
        attn_implementation="sdpa", experts_implementation=experts_implementation)


def contenders(cfg, level):
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    out = {}
    for impl in ("grouped_mm", "eager"):
        hf_cfg = qwen3_config(cfg, impl)
        out[f"hf-{impl}"] = Qwen3MoeForCausalLM(hf_cfg) if level == "model" else Qwen3MoeSparseMoeBlock(hf_cfg)
    out["ours"] = Transformer(cfg) if level == "model" else MoE(cfg)
    if level == "block":
        for p in out["ours"].parameters(): torch.nn.init.normal_(p, 0, 0.02)
        for name in ("hf-grouped_mm", "hf-eager"):
            for p in out[name].parameters(): torch.nn.init.normal_(p, 0, 0.02)
    return out


def step_fn(name, module, level, B, T, vocab, hidden):
    tokens = torch.randint(0, vocab, (B, T + 1))
    x = torch.randn(B, T, hidden)
    def step():
        if level == "model":
            if name == "ours": loss = module(tokens[:, :-1], tokens[:, 1:]).loss
            else: loss = module(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
        else:
            y = module(x)
            loss = (y[0] if isinstance(y, tuple) else y).float().square().mean()
        loss.backward()
        module.zero_grad(set_to_none=True)
    return step


def measure(level, dtype, B, T, rounds, steps):
    cfg = dataclasses.replace(load_params(Path(__file__).resolve().parents[1] / "params/tiny.yaml").model, router="softmax", qk_norm=True, latent_dim=0,
                              n_shared_experts=0, shared_ffn=0, sliding_window=0, logit_z_loss_weight=0.0)
    torch.manual_seed(0)
    mods = contenders(cfg, level)
    steps_by = {n: step_fn(n, m.train(), level, B, T, cfg.vocab_size, cfg.hidden_size) for n, m in mods.items()}
    times = {n: [] for n in mods}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        for fn in steps_by.values():
            for _ in range(3): fn()
        for _ in range(rounds):
            for name, fn in steps_by.items():
                start = time.perf_counter()
                for _ in range(steps): fn()
                times[name].append((time.perf_counter() - start) / steps)
    return {n: B * T / statistics.median(t) for n, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, "
          f"B={args.batch} T={args.seq}; forward+backward tokens/s (median of {args.rounds} rounds)")
    ratio = None
    for level in ("block", "model"):
        for dtype in ("fp32", "bf16"):
            tps = measure(level, dtype, args.batch, args.seq, args.rounds, args.steps)
            base = tps["hf-grouped_mm"]
            print(f"{level:5s} {dtype}: ours {tps['ours']:9,.0f}  hf grouped_mm {base:9,.0f}  hf eager "
                  f"{tps['hf-eager']:9,.0f}  ours/hf {tps['ours'] / base:.2f}x  ours/hf-eager {tps['ours'] / tps['hf-eager']:.2f}x")
            if (level, dtype) == ("model", "fp32"): ratio = tps["ours"] / base
    print(f"ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
