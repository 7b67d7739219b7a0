"Export to Hugging Face and generation, on checkpoints the real trainer wrote: parity, round trips, bad input."
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import BIN, ROOT, command, run
from marin_study.accounting import param_counts
from marin_study.config import load_params, save_params
from marin_study.data.corpus import read_jsonl
from marin_study.export import (ExportError, choose_architecture, export, export_layout, load_export, read_export,
                                write_export)
from marin_study.generate import greedy_reference
from marin_study.hf_model import document_ids
from marin_study.model import Transformer
from marin_study.trainer.checkpoint import safe_loading, write_manifest
from marin_study.trainer.checkpointer import load_weights

transformers = pytest.importorskip("transformers")


def marin(*args: str, check: bool = True):
    return run([str(BIN / "marin-study"), *map(str, args)], check=check)


def heldout_ids(pipeline, tokenizer, length: int) -> torch.Tensor:
    "A (1, length) batch of real held-out text, several documents of the small corpus end to end."
    clean = pipeline["root"] / "out/clean/heldout"
    text = "\n".join(d["text"] for path in sorted(clean.glob("*.jsonl")) for d in read_jsonl(path))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :length]
    assert ids.shape[1] == length
    return ids


def tokenizer_of(pipeline) -> Path:
    return pipeline["root"] / "out/tokenizer.json"


@pytest.fixture(scope="module")
def exported(reference, pipeline, tmp_path_factory):
    "The ZeRO-0 reference run (the tiny model's shape, trained 8 steps on 2 processes) exported by the CLI."
    out = tmp_path_factory.mktemp("exports") / "tiny"
    marin("export", reference(0), "--out", out, "--tokenizer", tokenizer_of(pipeline))
    return out


@pytest.fixture(scope="module")
def native_run(params_file, tmp_path_factory) -> Path:
    "A plain softmax MoE with QK-norm (no shared or latent experts, no balancing bias): Qwen3-MoE, trained 4 steps."
    p = load_params(params_file)
    model = dataclasses.replace(p.model, router="softmax", balance_rate=0.0, n_shared_experts=0, shared_ffn=0,
                                latent_dim=0, qk_norm=True, sliding_window=0, n_dense_layers=1, dense_ffn=96)
    path = save_params(dataclasses.replace(p, model=model, train=dataclasses.replace(p.train, steps=4)),
                       tmp_path_factory.mktemp("native") / "params.yaml")
    run_dir = path.parent / "run"
    run(command("alone", path, run_dir))
    return run_dir


def test_the_export_folder_is_complete_and_records_where_it_came_from(exported, reference):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "modeling_marin.py", "marin_export.json"} <= names
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {n for n in names if n.endswith(".safetensors")}
    record = json.loads((exported / "marin_export.json").read_text())
    checkpoint = reference(0) / "checkpoints/step-00000008"
    assert record["step"] == 8 and record["source_run"] == str(reference(0).resolve())
    assert record["checkpoint_manifest_sha256"] == hashlib.sha256((checkpoint / "MANIFEST.json").read_bytes()).hexdigest()
    assert record["architecture"] == "MarinForCausalLM" and "sigmoid" in record["why"]
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "marin" and config["auto_map"]["AutoModelForCausalLM"] == "modeling_marin.MarinForCausalLM"


def test_the_custom_export_has_our_logits_greedy_tokens_and_cache_on_real_text(exported, reference, pipeline):
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    ours = Transformer(load_params(reference(0) / "params.yaml").model).eval()
    ours.load_state_dict(load_weights(reference(0) / "checkpoints/step-00000008"))
    assert any(m.balance_bias.any() for m in ours.moe_layers()), "the bias must be trained, so that it changes choices"
    ids = heldout_ids(pipeline, tokenizer, ours.cfg.max_seq_len)
    assert ids.shape[1] > ours.cfg.sliding_window  # the sliding-window layers slide
    with torch.no_grad(): gap = (hf(ids).logits - ours(ids).logits).abs().max().item()
    assert gap < 1e-5
    prompt = ids[:, :120]  # 120 + 32 tokens: the cache of the sliding layers drops keys as decoding passes the window
    cached = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    uncached = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    assert cached[0, 120:].tolist() == greedy_reference(ours, prompt[0].tolist(), 32)


def test_the_native_export_is_qwen3_moe_with_our_logits_and_greedy_tokens(native_run, pipeline, tmp_path):
    result = marin("export", native_run, "--out", tmp_path / "native", "--tokenizer", tokenizer_of(pipeline))
    assert "Qwen3MoeForCausalLM" in result.stdout
    index = json.loads((tmp_path / "native/model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in index["weight_map"]  # the Hub layout vLLM reads
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ours = load_export(tmp_path / "native").eval()
    ids = heldout_ids(pipeline, transformers.AutoTokenizer.from_pretrained(tmp_path / "native"), 200)
    with torch.no_grad(): gap = (hf(ids).logits - ours(ids).logits).abs().max().item()
    assert gap < 1e-5
    generated = hf.generate(ids[:, :24], max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert generated[0, 24:].tolist() == greedy_reference(ours, ids[0, :24].tolist(), 32)
    custom = marin("export", native_run, "--out", tmp_path / "custom", "--tokenizer", tokenizer_of(pipeline), "--custom")
    assert "MarinForCausalLM" in custom.stdout


@pytest.mark.parametrize("arch, change", [
    ("LlamaForCausalLM", dict(n_experts=0, top_k=0, expert_ffn=0, n_shared_experts=0, shared_ffn=0, latent_dim=0,
                              dense_ffn=192, sliding_window=0, tie_embeddings=True)),
    ("Qwen3ForCausalLM", dict(n_experts=0, top_k=0, expert_ffn=0, n_shared_experts=0, shared_ffn=0, latent_dim=0,
                              dense_ffn=192, qk_norm=True)),
    ("MixtralForCausalLM", dict(router="softmax", n_shared_experts=0, shared_ffn=0, latent_dim=0, sliding_window=0)),
])
def test_every_native_class_computes_our_model(arch, change, pipeline, tmp_path):
    "Random weights for the other native classes (no training needed to check a layout), sliding windows included."
    cfg = dataclasses.replace(pipeline["params"].model, vocab_size=2048, **change)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    record = write_export(cfg, model.state_dict(), tmp_path / "export", tokenizer_of(pipeline))
    assert record["architecture"] == arch
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(hf).__name__ == arch
    ids = torch.randint(0, 2048, (2, cfg.max_seq_len))
    with torch.no_grad(): assert (hf(ids).logits - model(ids).logits).abs().max() < 1e-5


def test_global_layers_that_attend_with_fewer_kv_heads_export_with_our_logits_and_cache(pipeline, tmp_path):
    "The 535B's global layers use the first 6 of their 12 stored KV heads: the export does the same, in its cache too."
    cfg = dataclasses.replace(pipeline["params"].model, vocab_size=2048, n_kv_heads=2, n_kv_heads_global=1)
    assert cfg.kv_heads(cfg.n_layers - 1) == 1 and cfg.kv_heads(0) == 2
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    record = write_export(cfg, model.state_dict(), tmp_path / "export", tokenizer_of(pipeline))
    assert record["architecture"] == "MarinForCausalLM"  # no native class attends with fewer KV heads on some layers
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    ids = torch.randint(0, 2048, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(): assert (hf(ids).logits - model(ids).logits).abs().max() < 1e-5
    prompt = ids[:1, :120]
    cached = hf.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert cached[0, 120:].tolist() == greedy_reference(model, prompt[0].tolist(), 24)
    dense = dataclasses.replace(cfg, n_experts=0, top_k=0, expert_ffn=0, n_shared_experts=0, shared_ffn=0, latent_dim=0,
                                dense_ffn=192, sliding_window=0, tie_embeddings=True)
    assert "its global layers use fewer KV heads" in choose_architecture(dense)[1]


def test_a_bf16_router_exports_as_ours_and_picks_the_same_experts(pipeline, tmp_path):
    "model.router_dtype: bfloat16 travels with the export: a native class would route in fp32 and pick other experts."
    cfg = dataclasses.replace(pipeline["params"].model, vocab_size=2048, router_dtype="bfloat16", router="softmax",
                              n_shared_experts=0, shared_ffn=0, latent_dim=0, sliding_window=0)  # else Mixtral's shape
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    record = write_export(cfg, model.state_dict(), tmp_path / "export", tokenizer_of(pipeline))
    assert record["architecture"] == "MarinForCausalLM" and "router's dot product is in bf16" in record["why"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert hf.config.router_dtype == "bfloat16"
    ids = torch.randint(0, 2048, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    fp32 = Transformer(dataclasses.replace(cfg, router_dtype="float32")).eval()
    fp32.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max() < 1e-5
        assert (fp32(ids).logits - model(ids).logits).abs().max() > 1e-5  # some token's experts do change


def test_a_document_masked_model_exports_with_our_logits_and_generates_across_documents(pipeline, tmp_path):
    "Issue 36: model.document_mask in the export, on windows of several documents, in a full forward and with a cache."
    cfg = dataclasses.replace(pipeline["params"].model, vocab_size=2048, document_mask=True)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    record = write_export(cfg, model.state_dict(), tmp_path / "export", tokenizer_of(pipeline))
    assert record["architecture"] == "MarinForCausalLM" and "keeps to documents" in record["why"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert hf.config.document_mask and hf.config.eod_token_id == cfg.eod_id == 0
    ids = torch.randint(1, 2048, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    ids[0, [40, 120]] = 0
    ids[1, [100, 101, 200]] = 0  # an empty document too
    plain = Transformer(dataclasses.replace(cfg, document_mask=False)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max() < 1e-5
        assert (plain(ids).logits - model(ids).logits).abs().max() > 1e-2  # so the windows do hold several documents
        # a cache across an end token: each step gets the documents of everything so far, cached tokens included
        cache = transformers.DynamicCache(config=hf.config)
        hf(ids[:1, :116], cache=cache, use_cache=True)
        ours = model(ids[:1, :126]).logits
        for t in range(116, 126):
            step = hf(ids[:1, t:t + 1], cache=cache, use_cache=True, document_ids=document_ids(ids[:1, :t + 1], 0))
            assert (step.logits[0, -1] - ours[0, t]).abs().max() < 1e-5, t
        with pytest.raises(ValueError, match="needs document_ids"): hf(ids[:1, 126:127], cache=cache, use_cache=True)
    for end in (121, 135):  # a prompt that ends with the end token (the new text is a new document), one that does not
        prompt = ids[:1, :end]  # past the sliding window of 128 as it decodes, so sliding layers drop cached keys
        cached = hf.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert cached[0, end:].tolist() == greedy_reference(model, prompt[0].tolist(), 12)


def test_every_zero_stage_and_world_size_exports_the_same_model_and_round_trips_bit_exact(reference, pipeline, tmp_path):
    for zero in (0, 3):
        export(reference(zero), tmp_path / f"zero{zero}", tokenizer=tokenizer_of(pipeline))
        saved = load_weights(reference(zero) / "checkpoints/step-00000008")
        back = load_export(tmp_path / f"zero{zero}").state_dict()
        assert back.keys() == saved.keys() and all(torch.equal(back[k], saved[k].float()) for k in saved)
    zero0, zero3 = (load_export(tmp_path / f"zero{z}").state_dict() for z in (0, 3))
    # the same training sharded differently: sums in another order differ in the last bits, and Adam makes any such
    # difference in a rarely seen embedding row a step of up to the learning rate (3e-3)
    assert max((zero0[k] - zero3[k]).abs().max().item() for k in zero0) < 3e-3


def test_bf16_exports_shard_and_keep_the_balancing_bias_in_fp32(reference, pipeline, tmp_path):
    marin("export", reference(0), "--out", tmp_path / "bf16", "--dtype", "bf16", "--max-shard-size", "1MB",
          "--tokenizer", tokenizer_of(pipeline))
    index = json.loads((tmp_path / "bf16/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    _, tensors = read_export(tmp_path / "bf16")
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.mlp.balance_bias"].dtype == torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert hf.model.layers[0].mlp.balance_bias.dtype == torch.float32


def test_the_535b_export_is_planned_on_the_meta_device_with_the_accountings_parameters():
    cfg = load_params(ROOT / "params/marin-535b-a23b.yaml").model
    config, index = export_layout(cfg, dtype="bf16", max_shard_size="5GB")
    assert config.architectures == ["MarinForCausalLM"] and config.num_experts == 384 and config.latent_dim == 3072
    assert index["metadata"]["total_parameters"] == param_counts(cfg).total == 535_305_984_000
    assert index["metadata"]["total_size"] == 2 * 535_305_984_000 + 4 * 384 * 48  # bf16 weights, fp32 biases
    with torch.device("meta"): state = Transformer(cfg).state_dict()
    from marin_study.export import to_hf
    sizes = {n: t.numel() * (4 if n.endswith("balance_bias") else 2) for n, t in to_hf(cfg, state, "MarinForCausalLM").items()}
    shards = {}
    for name, file in index["weight_map"].items(): shards[file] = shards.get(file, 0) + sizes[name]
    alone = {f for f in shards if list(index["weight_map"].values()).count(f) == 1}
    assert all(size <= 5e9 for f, size in shards.items() if f not in alone)  # a tensor over 5 GB gets a file of its own
    assert len(shards) > 100 and sum(shards.values()) == index["metadata"]["total_size"]


def test_generate_prints_a_continuation_and_batch_jobs_resume_after_a_kill(exported, tmp_path):
    single = marin("generate", exported, "--prompt", "The history of", "--max-new-tokens", "8")
    assert single.stdout.startswith("The history of") and len(single.stdout) > len("The history of")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"Chapter {i}. The"}) + "\n" for i in range(12))
                       + json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hello"}]}) + "\n")
    sampled = ["--max-new-tokens", "24", "--temperature", "0.9", "--top-p", "0.9", "--top-k", "50",
               "--repetition-penalty", "1.2", "--seed", "7", "--batch-size", "4"]
    full = tmp_path / "full.jsonl"
    marin("generate", exported, "--prompts", prompts, "--out", full, *sampled)
    records = [json.loads(l) for l in full.read_text().splitlines()]
    assert [r["id"] for r in records] == [str(i) for i in range(12)] + ["chat"]
    assert records[-1]["prompt"] == "A: hello\nB:" and all(r["finish_reason"] in ("stop", "length") for r in records)

    out = tmp_path / "killed.jsonl"
    proc = subprocess.Popen([str(BIN / "marin-study"), "generate", str(exported), "--prompts", str(prompts), "--out", str(out),
                             *sampled], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 4):
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    finished = len(out.read_text().splitlines())
    assert 4 <= finished < 13, "the kill should land after the first batch and before the last"
    with open(out, "a") as f: f.write('{"id": "torn')  # as if killed mid-write
    resumed = marin("generate", exported, "--prompts", prompts, "--out", out, *sampled)
    assert f"{finished} were already there" in resumed.stdout
    assert out.read_text() == full.read_text()  # the same seeded samples as the uninterrupted job
    other = marin("generate", exported, "--prompts", prompts, "--out", out, *sampled[:-1], "8", check=False)
    assert other.returncode == 2 and "another model, sampling or batch size" in other.stderr


def test_without_the_kit_the_folder_loads_with_trust_remote_code_and_offline(exported):
    code = f"""
import sys
sys.modules["marin_study"] = None  # as on a machine without the kit
from transformers import AutoModelForCausalLM, AutoTokenizer
try: AutoModelForCausalLM.from_pretrained({str(exported)!r})
except ValueError as e: assert "trust_remote_code" in str(e)
else: raise AssertionError("custom code must need trust_remote_code")
model = AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained({str(exported)!r}, trust_remote_code=True)
assert type(model).__module__.endswith("modeling_marin")
ids = tokenizer("The history of", return_tensors="pt")
print("generated:", tokenizer.decode(model.generate(**ids, max_new_tokens=8, do_sample=False)[0]))
"""
    result = run([sys.executable, "-c", code], env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, stdin=subprocess.DEVNULL)
    assert "generated: The history of" in result.stdout


def test_bad_input_is_one_line_naming_the_path_and_nothing_half_written_is_left(reference, exported, pipeline, tmp_path):
    def refused(*args, expect):
        with pytest.raises(ExportError) as error: export(*args)
        message = str(error.value)
        assert message.count("\n") == 0 and expect in message, message
    empty = tmp_path / "no-checkpoints"
    empty.mkdir()
    cli = marin("export", empty, "--out", tmp_path / "a", check=False)  # the command prints the same line, exit 2
    assert cli.returncode == 2 and "Traceback" not in cli.stderr and cli.stderr.count("\n") == 1
    assert f"marin-study: error: {empty}: no checkpoints" in cli.stderr
    refused(reference(0), tmp_path / "a", None, "fp16", expect="--dtype 'fp16' is not one of fp32, bf16")
    refused(reference(0), tmp_path / "a", 5, expect="no checkpoint of step 5")
    refused(reference(0), exported, expect=f"{exported}: already exists and is not empty")
    big = tmp_path / "tokenizer.json"
    vocab = json.loads(tokenizer_of(pipeline).read_text())
    size = len(vocab["model"]["vocab"])  # 2048 here, for a model of 8192: grow it past the model's vocabulary
    vocab["model"]["vocab"] |= {f"extra{i}": size + i for i in range(8192)}
    big.write_text(json.dumps(vocab))
    refused(reference(0), tmp_path / "a", None, "fp32", "5GB", big, expect="do not fit the model's vocab_size")
    no_eod = json.loads(tokenizer_of(pipeline).read_text())
    no_eod["added_tokens"], no_eod["model"]["vocab"] = [], {k: v for k, v in no_eod["model"]["vocab"].items() if k != "<|endoftext|>"}
    (tmp_path / "no_eod.json").write_text(json.dumps(no_eod))
    refused(reference(0), tmp_path / "a", None, "fp32", "5GB", tmp_path / "no_eod.json", expect="has no <|endoftext|> token")
    damaged = tmp_path / "damaged"
    shutil.copytree(reference(0), damaged)
    shard = damaged / "checkpoints/step-00000008/deepspeed/mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")
    refused(damaged, tmp_path / "a", 8, expect="does not match its sha256")
    assert not any(p.name.startswith(".a.partial") or p.name == "a" for p in tmp_path.iterdir())

    broken = tmp_path / "broken-export"
    shutil.copytree(exported, broken)
    (next(broken.glob("*.safetensors"))).write_bytes(b"not a safetensors file")
    with pytest.raises(ExportError, match="unreadable shard"): load_export(broken)
    result = marin("generate", tmp_path / "nothing-here", "--prompt", "x", check=False)
    assert result.returncode == 2 and "no config.json" in result.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "a"}\n{"prompt": "no id"}\n')
    result = marin("generate", exported, "--prompts", bad, "--out", tmp_path / "o.jsonl", check=False)
    assert result.returncode == 2 and f"{bad}:2" in result.stderr and not (tmp_path / "o.jsonl").exists()


class RunsCode:
    "A pickled object that runs a shell command when unpickled."
    def __init__(self, marker: Path): self.marker = marker
    def __reduce__(self): return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_by_export_and_by_resume(reference, params_file, pipeline, tmp_path):
    evil = tmp_path / "evil"
    shutil.copytree(reference(0), evil)
    marker = tmp_path / "code-ran"
    step = evil / "checkpoints/step-00000008"
    state = torch.load(step / "deepspeed/mp_rank_00_model_states.pt", weights_only=True)
    state["payload"] = RunsCode(marker)
    torch.save(state, step / "deepspeed/mp_rank_00_model_states.pt")
    write_manifest(step)  # a well-formed checkpoint from someone else
    result = marin("export", evil, "--out", tmp_path / "out", "--tokenizer", tokenizer_of(pipeline), check=False)
    assert result.returncode == 2 and "refusing to unpickle" in result.stderr and not marker.exists()
    result = run(command("alone", params_file, evil, "train.steps=10"), check=False)
    assert result.returncode == 2 and "refusing to unpickle" in result.stderr and not marker.exists()
    # ZeRO 2 on 2 processes resumed on 1 goes through DeepSpeed's universal converter, in a process of its own
    evil = tmp_path / "evil-zero2"
    shutil.copytree(reference(2), evil)
    step = evil / "checkpoints/step-00000008"
    optim = step / "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with safe_loading(): state = torch.load(optim)
    state["payload"] = RunsCode(marker)
    torch.save(state, optim)
    write_manifest(step)
    result = run(command("alone", params_file, evil, "train.steps=10", "parallel.zero_stage=2"), check=False)
    assert result.returncode == 2 and "refusing to unpickle" in result.stderr and not marker.exists()
