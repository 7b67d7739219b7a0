"""A training step's tokens per second: marin_study's MoE block and whole model against Hugging Face's Qwen3-MoE.

Both are built from a config at identical shapes (the tiny preset's: hidden 128, 4 layers, 4 heads, 1 KV head,
head size 32, 32 experts top-4 of width 64, vocab 8192), random weights, no download; same batch (B=8, T=256),
same thread count, same dtype, in one process. Qwen3-MoE has a softmax router, QK-norm, no shared or latent
experts and no sliding window, so our model is configured the same way for the comparison. Transformers 5 runs its
experts through torch._grouped_mm by default ("grouped_mm", the baseline); "eager" is its per-expert loop.

A step is what training does: forward, backward and torch's fused AdamW step, on both sides (Hugging Face Trainer's
default optimizer since torch 2.8). Rounds alternate between the contenders so that both see the same machine state;
each figure is the median of the rounds. bf16 (autocast) is measured only where the CPU runs it natively (AMX,
AVX512_BF16, Arm BF16): elsewhere it is emulated and says nothing about either model. `--profile` prints the
operators where each model's step spends its time. Ends with `ratio: X`, ours over Hugging Face's default, whole
model, fp32.
"""
import argparse
import dataclasses
import platform
import statistics
import time
from pathlib import Path

import torch

from marin_study.config import load_params
from marin_study.hardware import cpu_bf16
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


def comparable_config():
    "The tiny preset's model, configured as Qwen3-MoE is: softmax router, QK-norm, no shared or latent experts."
    tiny = load_params(Path(__file__).resolve().parents[1] / "params/tiny.yaml").model
    return dataclasses.replace(tiny, router="softmax", qk_norm=True, latent_dim=0, n_shared_experts=0, shared_ffn=0,
                               sliding_window=0, logit_z_loss_weight=0.0)


def contenders(cfg, level, names):
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    out = {}
    for name in names:
        if name == "ours": out[name] = Transformer(cfg) if level == "model" else MoE(cfg)
        else:
            hf_cfg = qwen3_config(cfg, name.removeprefix("hf-"))
            out[name] = Qwen3MoeForCausalLM(hf_cfg) if level == "model" else Qwen3MoeSparseMoeBlock(hf_cfg)
        if level == "block":
            for p in out[name].parameters(): torch.nn.init.normal_(p, 0, 0.02)
    return out


def step_fn(name, module, level, B, T, cfg):
    "One training step of `module`: forward, backward, AdamW."
    tokens = torch.randint(0, cfg.vocab_size, (B, T + 1))
    x = torch.randn(B, T, cfg.hidden_size)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
    def step():
        if level == "model":
            if name == "ours": loss = module(tokens[:, :-1], tokens[:, 1:]).loss
            else: loss = module(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss  # HF shifts the labels itself
        else:
            y = module(x)
            loss = (y[0] if isinstance(y, tuple) else y).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def measure(level, dtype, names, B, T, rounds, steps):
    "Tokens per second of each contender: the median over `rounds` interleaved rounds of `steps` steps."
    cfg = comparable_config()
    torch.manual_seed(0)
    steps_by = {n: step_fn(n, m.train(), level, B, T, cfg) for n, m in contenders(cfg, level, names).items()}
    times = {n: [] for n in steps_by}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        for fn in steps_by.values():
            for _ in range(2): fn()
        for _ in range(rounds):
            for name, fn in steps_by.items():
                start = time.perf_counter()
                for _ in range(steps): fn()
                times[name].append((time.perf_counter() - start) / steps)
    return {n: B * T / statistics.median(t) for n, t in times.items()}


def profile(names, B, T, steps=3):
    "The operators that take each whole model's fp32 step, by their own CPU time."
    from torch.profiler import ProfilerActivity, profile as torch_profile
    cfg = comparable_config()
    for name, module in contenders(cfg, "model", names).items():
        fn = step_fn(name, module.train(), "model", B, T, cfg)
        fn()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps): fn()
        print(f"\n{name}: {steps} steps, top operators by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="also Hugging Face's per-expert loop (experts_implementation=eager)")
    ap.add_argument("--profile", action="store_true", help="print each whole model's top operators, then measure")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    names = ["ours", "hf-grouped_mm"] + (["hf-eager"] if args.eager else [])
    native = cpu_bf16()
    print(f"{platform.processor() or platform.machine()}, {torch.backends.cpu.get_cpu_capability()}, native bf16: "
          f"{native or 'no (emulated: not measured)'}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.threads} threads, B={args.batch} T={args.seq}; training-step tokens/s, median of {args.rounds} rounds")
    if args.profile: profile(names, args.batch, args.seq)
    ratio = None
    for level in ("block", "model"):
        for dtype in ("fp32", "bf16") if native else ("fp32",):
            tps = measure(level, dtype, names, args.batch, args.seq, args.rounds, args.steps)
            base = tps["hf-grouped_mm"]
            eager = f"  hf eager {tps['hf-eager']:9,.0f}" if args.eager else ""
            print(f"{level:5s} {dtype}: ours {tps['ours']:9,.0f}  hf {base:9,.0f}{eager}  ours/hf {tps['ours'] / base:.2f}x")
            if (level, dtype) == ("model", "fp32"): ratio = tps["ours"] / base
    print(f"ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
