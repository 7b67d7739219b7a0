"""One GPU, bf16: our trainer's step against Hugging Face's Qwen3-MoE at the same shapes, beside the planner's prediction.

Two models: the `small` preset as it is, and the `node` preset's width (hidden 1536, 128 experts top-8 in a 768-wide
latent space, vocabulary 128,256) at reduced depth (`--node-layers`, 4). Each trains `--steps` steps after
`--warmup` untimed ones on the token shards of `dvc repro pack`: ours through `Trainer` (DeepSpeed engine, guard,
bf16 autocast; ZeRO 0 and no expert parallelism on one device), Hugging Face's as a bare loop (bf16 autocast,
torch's fused AdamW) at the nearest shape Qwen3-MoE has (softmax router, QK-norm, no shared or latent experts, no
sliding window). Each prints tokens/s, achieved TFLOP/s and MFU (the kit's convention, KIT, for its own model),
peak memory, and for ours the planner's predicted step time and memory.

On a GPU machine (one job, under 8 minutes on an H100):  python bench/gpu_step.py
Where no GPU is lent, the path is checked on CPU:  python bench/gpu_step.py --device cpu --steps 3
(CPU: one sequence a step, fp32 unless the CPU has native bf16, and the node width at one layer with the shards' own
vocabulary, so that it fits in memory and a few minutes.) Ends with `ratio: X`, ours over Hugging Face's
tokens/s on the node width.
"""
import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ensure_installed() -> None:
    "Install the kit (and with it transformers and DeepSpeed) where this machine lacks it."
    if all(importlib.util.find_spec(m) for m in ("marin_study", "transformers", "deepspeed")): return
    print("installing the kit: pip install -e", ROOT, flush=True)
    if subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "-e", str(ROOT)]).returncode:
        sys.exit("gpu_step: pip install failed (no package index reachable?); install the kit first (./install.sh)")


def configs(device: str, node_layers: int, shard_vocab: int, steps: int):
    "The two models' params, set for one device."
    from marin_study.config import load_params
    from marin_study.hardware import cpu_bf16
    cpu = device == "cpu"
    dtype = "bfloat16" if not cpu or cpu_bf16() else "float32"
    common = ["parallel.ep=1", "parallel.zero_stage=0", "launch.nodes=1", "launch.procs_per_node=1",
              f"launch.gpus_per_node={0 if cpu else 1}", f"train.steps={steps}", "train.warmup_fraction=0",
              f"train.dtype={dtype}", "train.trackers=[]", "data.num_workers=0"]
    small = ["train.global_batch=1", "train.micro_batch=1"] if cpu else \
            ["train.global_batch=16", "train.micro_batch=16"]
    node = [f"model.n_layers={1 if cpu else node_layers}", "model.n_dense_layers=0", "parallel.activation_checkpointing=none"]
    node += [f"model.vocab_size={shard_vocab}", "train.global_batch=1", "train.micro_batch=1"] if cpu \
        else ["train.global_batch=4", "train.micro_batch=4"]
    return {"small": load_params(ROOT / "params/small.yaml", common + small),
            f"node width, {1 if cpu else node_layers} layer{'' if cpu else 's'}": load_params(ROOT / "params/node.yaml", common + node)}


def qwen3_like(cfg):
    "Qwen3-MoE's nearest shape to `cfg`: softmax router, QK-norm, no shared or latent experts, no sliding window."
    return dataclasses.replace(cfg, router="softmax", qk_norm=True, latent_dim=0, n_shared_experts=0, shared_ffn=0,
                               sliding_window=0, logit_z_loss_weight=0.0, n_dense_layers=0)


def hf_model(cfg):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.expert_ffn,
        intermediate_size=cfg.expert_ffn, norm_topk_prob=True, max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        decoder_sparse_step=1, mlp_only_layers=[], attn_implementation="sdpa"))


def timed(step, steps: int, warmup: int, device) -> float:
    "Median seconds of `step()` over `steps` calls after `warmup` untimed ones."
    import torch
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        step()
        if device.type == "cuda": torch.cuda.synchronize()
        if i >= warmup: times.append(time.perf_counter() - start)
    return statistics.median(times)


def ours(params, steps: int, warmup: int) -> tuple[dict, float]:
    "Our trainer's step: the figures, and the seconds it took (one per process: Accelerate allows one DeepSpeed run)."
    import torch
    from marin_study.trainer.train import Trainer
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(params, run_dir)
        try:
            accumulation = params.train.global_batch // params.train.micro_batch
            batches = iter(trainer.loader)
            def step():
                trainer.train_step([next(batches) for _ in range(accumulation)])
                trainer.step += 1
            if trainer.device.type == "cuda": torch.cuda.reset_peak_memory_stats()
            seconds = timed(step, steps, warmup, trainer.device)
            return figures(trainer.throughput, seconds, params, trainer.device), seconds
        finally: trainer.close()


def theirs(params, steps: int, warmup: int) -> tuple[dict, float]:
    "Hugging Face's Qwen3-MoE at the nearest shape, in a bare loop over the same batches."
    import torch
    from marin_study.data.mixture import make_loader
    from marin_study.trainer.metrics import Throughput, gpu_in_use
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(params.train.seed)
    like = dataclasses.replace(params, model=qwen3_like(params.model))
    model = hf_model(like.model).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=params.train.lr, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=params.train.dtype == "bfloat16")
    batches = iter(make_loader(params))
    accumulation = params.train.global_batch // params.train.micro_batch
    def step():
        for _ in range(accumulation):
            batch_BT = next(batches).to(device)
            with autocast: loss = model(input_ids=batch_BT[:, :-1], labels=batch_BT[:, :-1]).loss
            (loss / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda": torch.cuda.reset_peak_memory_stats()
    seconds = timed(step, steps, warmup, device)
    return figures(Throughput(like, 1, gpu_in_use(like)), seconds, like, device), seconds


def figures(throughput, seconds: float, params, device) -> dict:
    import torch
    from marin_study.trainer.metrics import MFU, TFLOPS_PER_DEVICE, TOKENS_PER_SEC
    keys = throughput.measure(time.perf_counter() - seconds, 0.0)
    out = {"tokens/s": keys[TOKENS_PER_SEC], "TFLOP/s": keys[TFLOPS_PER_DEVICE], "MFU": keys.get(MFU)}
    out["peak GB"] = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return out


def predicted(params, device) -> str:
    "The planner's step time and memory for this model on this GPU (none on CPU: the planner models GPUs)."
    from marin_study.layout import Layout
    from marin_study.parallelism import evaluate
    from marin_study.trainer.metrics import gpu_in_use
    gpu = gpu_in_use(params) if device == "cuda" else None
    if gpu is None: return "planner: no GPU of the catalogue here, no prediction"
    plan = evaluate(params, Layout.from_params(params, 1), gpu)
    return f"planner on {gpu.name}: {plan.time.total:.3f} s a step, {plan.memory.total / 1e9:.1f} GB"


def in_own_process(case: int) -> tuple[dict, float]:
    "`ours` on config `case`, in a child process of this script."
    child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--ours", str(case)], capture_output=True, text=True)
    if child.returncode: sys.exit(f"gpu_step: our trainer failed on config {case}:\n{child.stderr[-3000:]}")
    return tuple(json.loads(child.stdout.strip().splitlines()[-1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--node-layers", type=int, default=4)
    ap.add_argument("--ours", type=int, help=argparse.SUPPRESS)  # internal: run our trainer on config N, print JSON
    args = ap.parse_args()
    ensure_installed()
    if args.device == "cpu": os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the trainer and Hugging Face both stay on the CPU
    import torch
    from marin_study.data.mixture import shard_dir, shard_meta
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_step: no CUDA device here; run with --device cpu to check the script's path")
    from marin_study.config import load_params
    tiny = load_params(ROOT / "params/tiny.yaml")
    if not (shard_dir(tiny) / "meta.json").exists():
        sys.exit(f"gpu_step: no token shards in {shard_dir(tiny)}; run `dvc repro pack` first (or carry runs/data)")
    cases = list(configs(args.device, args.node_layers, shard_meta(shard_dir(tiny))["vocab_size"], args.warmup + args.steps).items())
    if args.ours is not None:
        print(json.dumps(ours(cases[args.ours][1], args.steps, args.warmup)))
        return
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; {args.steps} steps after {args.warmup}, median step", flush=True)
    ratio = None
    for i, (label, params) in enumerate(cases):
        t = params.train
        print(f"\n{label}: {t.global_batch} x {t.seq_len} tokens a step, {t.dtype}; {predicted(params, args.device)}")
        for who, run in (("ours", lambda *_: in_own_process(i)), ("hf qwen3-moe", theirs)):
            out, seconds = run(params, args.steps, args.warmup)
            mfu = f"{out['MFU']:.1%}" if out["MFU"] is not None else "n/a"
            memory = f"{out['peak GB']:.1f} GB" if out["peak GB"] is not None else "n/a"
            print(f"  {who:13s} {seconds:7.3f} s  {out['tokens/s']:10,.0f} tokens/s  {out['TFLOP/s']:8.2f} TFLOP/s  "
                  f"MFU {mfu:>6s}  peak {memory}", flush=True)
            if who == "ours": mine = out["tokens/s"]
            else: ratio = mine / out["tokens/s"]
    print(f"ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
