"The planner against the formulas, DeepSpeed's estimators and config classes, the 535B run and its own widget."
import dataclasses
import json
import re
import textwrap

import pytest

from conftest import BIN, ROOT, quick_params, run
from conftest import free_port
from marin_study.config import ModelConfig, load_params
from marin_study.hardware import GB, HARDWARE, HardwareError
from marin_study.layout import Layout, layout_refusals
from marin_study.parallelism import (PRECISION_BYTES, PlanError, activation_bytes, evaluate, fullest_gpu_bytes,
                                     inference_plan, kv_bytes_per_layer, layer_activation_terms, measure_activations,
                                     plan, tensor_parallel_degrees, with_layout, write_launch_configs)
from marin_study.trainer.deepspeed import largest_layer_params, model_state_memory
from marin_study.widgets import PlannerWidget

PARAMS = {name: load_params(ROOT / f"params/{name}.yaml") for name in ("tiny", "small", "node", "marin-535b-a23b")}


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("gpus", [1, 8, 64, 704])
def test_zero2_and_zero3_model_states_equal_deepspeeds_estimators(name, gpus, capsys):
    from deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,
                                               estimate_zero3_model_states_mem_needs_all_cold)
    from deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,
                                                      estimate_zero2_model_states_mem_needs_all_cold)
    model = PARAMS[name].model
    total = sum(model_state_memory(model, Layout(dp=1), "bf16", "paper")) / 16  # 16 bytes per parameter at ZeRO-0
    largest = largest_layer_params(model)
    nodes, per_node = (gpus // 8, 8) if gpus >= 8 else (1, gpus)
    ours2 = sum(model_state_memory(model, Layout(dp=gpus, zero_stage=2), "bf16", "deepspeed"))
    ours3 = sum(model_state_memory(model, Layout(dp=gpus, zero_stage=3), "bf16", "deepspeed"))
    _, ds2 = estimate_zero2_model_states_mem_needs(int(total), per_node, nodes, cpu_offload=False)
    _, ds3, _ = estimate_zero3_model_states_mem_needs(int(total), largest, per_node, nodes, cpu_offload=False,
                                                      cpu_offload_params=False)
    assert ours2 == pytest.approx(ds2, abs=1) and ours3 == pytest.approx(ds3, abs=1)
    # and the figures the _all_cold functions print (GiB, two decimals), for the no-offload row
    capsys.readouterr()
    estimate_zero2_model_states_mem_needs_all_cold(int(total), per_node, nodes)
    estimate_zero3_model_states_mem_needs_all_cold(int(total), largest, per_node, nodes)
    rows = [line for line in capsys.readouterr().out.splitlines() if "offload_optimizer=none" in line]
    printed = [float(re.findall(r"([\d.]+)GB", line)[1]) for line in rows]
    assert printed == [round(ours2 / 2**30, 2), round(ours3 / 2**30, 2), round(ours3 / 2**30, 2)]


def test_the_largest_layer_and_total_match_deepspeeds_count_of_a_real_model(capsys):
    from deepspeed.runtime.zero.stage3 import model_to_params
    from marin_study.model import Transformer
    for name in ("tiny", "small"):
        model = PARAMS[name].model
        total, largest = model_to_params(Transformer(model))
        assert largest == largest_layer_params(model)
        assert total == sum(model_state_memory(model, Layout(), "bf16", "paper")) / 16


def _gpt(h=1024, a=16, layers=2, s=2048) -> ModelConfig:
    "A dense multi-head model whose SwiGLU of width 2h stores what Korthikanti's GELU of width 4h stores."
    return ModelConfig(vocab_size=512, hidden_size=h, n_layers=layers, n_heads=a, n_kv_heads=a, head_dim=h // a,
                       max_seq_len=s, dense_ffn=2 * h)


@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (4, False), (8, False), (2, True), (8, True)])
def test_activation_terms_add_up_to_korthikanti_table_2(t, sp):
    s, b, h, a = 2048, 4, 1024, 16
    def paper(terms):  # less what this model keeps beyond the paper's GPT: RoPE's rotated q and k, fp32 norm inputs
        return sum(terms.values()) - terms["rotated_q_k"] - terms["norm_inputs"] + 2 * 2 * s * b * h / (t if sp else 1)
    terms = layer_activation_terms(_gpt(h, a, s=s), 0, s, b, tp=t, sp=sp, flash=False, dropout=True)
    if sp: expected = s * b * h / t * (34 + 5 * a * s / h)
    else: expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert paper(terms) == pytest.approx(expected, rel=1e-12)
    flash = layer_activation_terms(_gpt(h, a, s=s), 0, s, b, tp=t, sp=sp, flash=True, dropout=True)
    assert paper(flash) - flash["softmax_stats"] == pytest.approx(expected - 5 * a * s * s * b / t, rel=1e-12)
    selective = layer_activation_terms(_gpt(h, a, s=s), 0, s, b, tp=t, sp=sp, flash=False, dropout=True,
                                       recompute="selective")  # the paper's selective recompute: the scores go
    assert paper(selective) == pytest.approx(expected - 5 * a * s * s * b / t, rel=1e-12)


def test_recomputation_and_sequence_parallel_shrink_activations_as_the_paper_says():
    p = PARAMS["marin-535b-a23b"]
    runs = {r: evaluate(p, Layout(ep=64, dp=704, zero_stage=1, recompute=r), HARDWARE["gb200"])
            for r in ("none", "selective", "full")}
    act = {r: c.memory.activations for r, c in runs.items()}
    assert act["full"] < act["none"] / 3 and act["full"] < act["selective"] < act["none"]
    assert runs["none"].time.compute < runs["selective"].time.compute < runs["full"].time.compute
    assert {c.layout.recompute for c in plan(PARAMS["tiny"], "h100", 8).candidates} == {"none", "selective", "full"}
    tp1 = evaluate(p, Layout(tp=4, dp=176, sequence_parallel=False), HARDWARE["gb200"]).memory.activations
    tp4 = evaluate(p, Layout(tp=4, dp=176), HARDWARE["gb200"]).memory.activations
    assert tp4 < tp1



def test_the_activation_model_predicts_what_the_model_keeps_on_cpu():
    "Issues 18, 20: each recompute mode of the tiny model, run on CPU in fp32, kept no more than the planner says, peaked within 25%."
    import torch
    model = PARAMS["tiny"].model
    measured = measure_activations(model, batch=4, seq=256)
    predicted = {mode: activation_bytes(model, Layout(micro_batch=4, recompute=mode), 256, 1, act_bytes=4, on_gpu=False)
                 for mode in measured}
    for mode, got in measured.items():
        assert got.saved <= predicted[mode] and predicted[mode] == pytest.approx(got.peak, rel=0.25)
        assert got.loss == measured["none"].loss, "recomputation changed the loss"
        assert all(map(torch.equal, got.grads, measured["none"].grads)), "recomputation changed a gradient"
    for figures in (predicted, {m: g.saved for m, g in measured.items()}, {m: g.peak for m, g in measured.items()}):
        assert figures["full"] < figures["selective"] < figures["none"], figures

def test_the_535b_run_on_11_gb200_racks_matches_the_published_numbers():
    p = PARAMS["marin-535b-a23b"]
    result = plan(p, "gb200", 792, mfu=0.229)
    assert result.train_flops == pytest.approx(2.7e24, rel=0.05)
    assert 60 <= result.days() <= 90
    run_layout = evaluate(p, Layout(ep=64, dp=704, zero_stage=1, recompute="full"), HARDWARE["gb200"])
    assert run_layout.fits and run_layout.layout.ep * run_layout.layout.tp <= HARDWARE["gb200"].nvlink_domain
    assert "training FLOPs" in result.explain(3) and result.explain(3).count("\n") == 3


def test_layouts_that_do_not_fit_name_the_term_that_overflows():
    p = PARAMS["marin-535b-a23b"]
    result = plan(p, "h100", 8)
    assert result.best is None and not any(c.fits for c in result.candidates)
    assert {c.overflow for c in result.candidates} <= {"params", "grads", "optimizer", "activations", "buffers", "margin"}
    assert "no layout fits" in result.explain() and "overflows" in result.explain()
    with pytest.raises(HardwareError, match="unknown device 'tpu-v5'.*h100"):
        plan(p, "tpu-v5", 8)
    assert [str(r) for r in layout_refusals(p.model, Layout(tp=5, ep=7, dp=700), 11264)] == [
        "parallel.tp: 5 does not divide model.n_heads (48) (fix: set parallel.tp to a divisor of 48)",
        "parallel.tp: 5 does not divide model.n_kv_heads (12) (fix: set parallel.tp to a divisor of 12)",
        "parallel.ep: 7 does not divide model.n_experts (384) (fix: set parallel.ep to a divisor of 384)",
        "train.global_batch: 11264 sequences cannot be split into micro-batches of 1 on 700 data-parallel ranks (fix: make "
        "it a multiple of micro_batch x 700 (700), or change train.micro_batch or the process count)"]


def test_plan_json_interface():
    out = run([BIN / "marin-study", "plan", "params/marin-535b-a23b.yaml", "--gpu", "gb200", "--gpus", "792",
               "--mfu", "0.229", "--json"]).stdout
    result = json.loads(out)
    assert result["train_flops"] == pytest.approx(2.65e24, rel=0.02) and 60 <= result["days"] <= 90
    best = result["best_layout"]
    assert {"tp", "pp", "ep", "dp", "zero_stage", "fits", "memory_per_gpu_bytes"} <= set(best)
    assert best["fits"] and best["memory_per_gpu_bytes"] <= HARDWARE["gb200"].memory
    assert best["tp"] * best["pp"] * best["dp"] <= 792 and best["dp"] % best["ep"] == 0
    half = json.loads(run([BIN / "marin-study", "plan", "params/marin-535b-a23b.yaml", "--gpu", "gb200", "--gpus", "792",
                           "--mfu", "0.229", "--tokens", "9e12", "--json"]).stdout)
    assert half["days"] == pytest.approx(result["days"] / 2, rel=1e-3) and half["tokens"] == pytest.approx(9e12, rel=1e-4)
    bad = run([BIN / "marin-study", "plan", "params/tiny.yaml"], check=False)
    assert bad.returncode == 2 and "--gpu h100 --gpus" in bad.stderr and "Traceback" not in bad.stderr


def test_launch_configs_load_in_deepspeed_and_accelerate_and_launch_the_trainer(pipeline, tmp_path):
    p535 = PARAMS["marin-535b-a23b"]
    best = plan(p535, "gb200", 792).best
    _, ds_path, acc_path = write_launch_configs(with_layout(p535, best.layout, HARDWARE["gb200"]), tmp_path / "535b")
    check = textwrap.dedent(f"""
        import os
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig
        from accelerate.commands.config.config_args import load_config_from_file
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
        deepspeed.init_distributed("gloo")
        class DataParallelGroup:  # how DeepSpeed is told the data-parallel size of a layout bigger than this machine
            def get_data_parallel_world_size(self): return {best.layout.dp}
        ds = DeepSpeedConfig("{ds_path}", mpu=DataParallelGroup())
        acc = load_config_from_file("{acc_path}")
        print(ds.train_batch_size, ds.gradient_accumulation_steps, ds.zero_optimization_stage,
              acc.distributed_type.value, acc.num_processes, acc.num_machines)
        deepspeed.comm.destroy_process_group()
    """)
    printed = run([BIN / "python", "-c", check]).stdout.splitlines()[-1].split()
    assert printed == ["11264", str(11264 // best.layout.dp), str(best.layout.zero_stage), "DEEPSPEED",
                       str(best.layout.world), str(best.layout.world // 4)]
    # the tiny layout's configs start the trainer through `accelerate launch --config_file`
    params = quick_params(pipeline["params"], steps=2, global_batch=4, eval_samples=2)
    tiny = with_layout(params, Layout(dp=2, zero_stage=2, micro_batch=2))
    params_path, ds_path, acc_path = write_launch_configs(tiny, tmp_path / "tiny")
    launch = [BIN / "accelerate", "launch", "--config_file", acc_path, "--main_process_port", str(free_port()),
              "--no_python", BIN / "marin-study", "train", params_path, "--run-dir", tmp_path / "run"]
    assert "step 2: loss" in run(launch).stdout
    assert json.loads(ds_path.read_text())["zero_optimization"]["stage"] == 2
    # a JSON that no longer matches the params is refused by name, before any training
    ds_path.write_text(json.dumps(dict(json.loads(ds_path.read_text()), train_micro_batch_size_per_gpu=1)))
    refused = run(launch[:-1] + [tmp_path / "run2"], check=False)
    assert refused.returncode != 0 and "differs from what 2 processes of these params need at train_micro_batch_size_per_gpu" in refused.stderr


def test_the_widget_redraws_and_explains_bad_combinations():
    w = PlannerWidget(ROOT / "params")
    c = w.controls
    assert c["preset"].value == "marin-535b-a23b"
    c["gpu"].value, c["gpus"].value, c["dp"].value, c["ep"].value = "gb200", 704, 704, 64
    c["zero_stage"].value, c["recompute"].value = 1, "full"
    text = w.render()
    assert "GB per GPU" in text and "days" in text and "does not fit" not in text
    bars = sum(p.get_height() for p in w.figure.axes[0].patches)
    assert bars == pytest.approx(w.candidate.memory.total / GB)
    c["gpu"].value = "a100-40gb"
    assert "does not fit" in w.message.value
    c["tp"].value = 5
    assert w.message.value.startswith("<b>cannot run: parallel.tp: 5 does not divide model.n_heads")
    c["tp"].value, c["gpus"].value = 1, 8
    assert "more than the 8 GPUs" in w.message.value


def test_serving_the_535b_takes_the_published_weight_bytes_and_a_kv_cache_that_stops_at_the_window():
    p = PARAMS["marin-535b-a23b"]
    m = p.model
    bf16, int4 = (inference_plan(p, "h100", weights, batch=32) for weights in ("bf16", "int4"))
    assert bf16.weight_bytes == pytest.approx(1070e9, rel=0.05) and int4.weight_bytes == pytest.approx(268e9, rel=0.05)
    layer_token = [2 * m.kv_heads(i) * m.head_dim * 2 for i in range(m.n_layers)]  # a key and a value per KV head used, bf16
    assert sorted(set(layer_token)) == [2 * 6 * 128 * 2, 2 * 12 * 128 * 2]  # global layers attend with 6 of the 12 heads
    assert bf16.kv_bytes_per_token == sum(layer_token)
    # within the window every layer holds the whole context; past it, only the global layers keep growing
    assert inference_plan(p, "h100", context=1024).kv_bytes_per_sequence == 1024 * sum(layer_token)
    n_global = sum(m.is_global(i) for i in range(m.n_layers))
    assert 0 < n_global < m.n_layers
    assert bf16.kv_bytes_per_sequence == sum(t * (4096 if m.is_global(i) else m.sliding_window) for i, t in enumerate(layer_token))
    no_window = inference_plan(dataclasses.replace(m, sliding_window=0, n_kv_heads_global=0), "h100", batch=32)
    assert no_window.kv_bytes == 32 * 4096 * m.n_layers * 2 * 12 * 128 * 2 > bf16.kv_bytes
    assert inference_plan(p, "h100", kv_precision="fp8", batch=32).kv_bytes == bf16.kv_bytes / 2


@pytest.mark.parametrize("weights", list(PRECISION_BYTES))
def test_serving_layout_is_the_smallest_that_fits_tensor_parallel_first(weights):
    p, h100 = PARAMS["marin-535b-a23b"], HARDWARE["h100"]
    assert tensor_parallel_degrees(p.model, h100) == [1, 2, 4]   # 8 splits the 48 heads, not the 12 KV heads
    served = inference_plan(p, "h100", weights, batch=32)
    budget, kv = 0.9 * h100.memory, kv_bytes_per_layer(p.model, 4096, served.kv_precision)
    assert served.gpu_bytes == fullest_gpu_bytes(p.model, weights, kv, 32, served.tp, served.pp) <= budget
    assert served.gpu_bytes * served.gpus >= served.total_bytes and served.gpus >= served.gpus_min
    # the step before it in the search does not fit: one stage fewer at the widest TP, or half the TP on one stage
    if served.pp > 1:
        fewer = max(d for d in range(1, served.pp) if p.model.n_layers % d == 0)
        assert fullest_gpu_bytes(p.model, weights, kv, 32, served.tp, fewer) > budget
        assert served.tp == 4
    elif served.tp > 1:
        assert fullest_gpu_bytes(p.model, weights, kv, 32, served.tp // 2, 1) > budget
    assert served.nodes == -(-served.gpus // h100.gpus_per_node)
    assert inference_plan(p, "h200", weights, batch=32).gpus <= served.gpus


def _flags(command: str) -> dict:
    "The flags of a launch command (its comment lines apart), a flag without a value mapped to True."
    words = [w for line in command.splitlines() if not line.startswith("#") for w in line.split() if w != "\\"]
    return {w: (words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else True)
            for i, w in enumerate(words) if w.startswith("--")}


def test_serving_commands_carry_the_layout_and_only_honest_quantization_flags():
    p = PARAMS["marin-535b-a23b"]
    bf16 = inference_plan(p, "h100", batch=32)
    assert (bf16.tp, bf16.pp, bf16.nodes) == (4, 4, 2)
    vllm, sglang = bf16.vllm_command("exports/m", "m535"), bf16.sglang_command("exports/m", "m535")
    assert vllm.splitlines()[1].startswith("vllm serve exports/m") and "ray start --head" in vllm.splitlines()[0]
    assert {"--tensor-parallel-size": "4", "--pipeline-parallel-size": "4", "--max-model-len": "4096",
            "--max-num-seqs": "32", "--gpu-memory-utilization": "0.9", "--dtype": "bfloat16", "--served-model-name": "m535",
            "--trust-remote-code": True, "--distributed-executor-backend": "ray"}.items() <= _flags(vllm).items()
    assert {"--model-path": "exports/m", "--tp-size": "4", "--pp-size": "4", "--context-length": "4096",
            "--max-running-requests": "32", "--mem-fraction-static": "0.9", "--nnodes": "2", "--node-rank": "NODE_RANK",
            "--dtype": "bfloat16"}.items() <= _flags(sglang).items()
    assert "--quantization" not in _flags(vllm) and "--kv-cache-dtype" not in _flags(sglang)
    fp8 = inference_plan(p, "h200", "fp8", kv_precision="fp8", batch=32)
    for command in (fp8.vllm_command(), fp8.sglang_command()):
        assert {"--quantization": "fp8", "--kv-cache-dtype": "fp8_e4m3", "--dtype": "bfloat16"}.items() <= _flags(command).items()
        assert "--nnodes" not in command and "--distributed-executor-backend" not in command   # one node
    int4 = inference_plan(p, "h100", "int4")
    assert "--quantization" not in _flags(int4.vllm_command()) and int4.sglang_command().startswith("# int4: serve an int4 copy")
    assert _flags(inference_plan(PARAMS["tiny"], "h100", "fp32").vllm_command())["--dtype"] == "float32"
    out = json.loads(json.dumps(bf16.to_json("exports/m", "m535")))
    assert out["vllm_command"] == vllm and out["gpus"] == 16 and out["weight_bytes"] == bf16.weight_bytes
    assert "8 would not split the 12 KV heads evenly" in bf16.explain() and "36 sliding-window layers" in bf16.explain()


@pytest.mark.parametrize("asked,refusal", [
    (dict(precision="int3"), "--weights-precision 'int3' is not one of fp32, bf16, fp8, int8, int4"),
    (dict(kv_precision="int4"), "--kv-precision 'int4': with bf16 weights vLLM and SGLang keep the KV cache in bf16 or fp8"),
    (dict(precision="fp32", kv_precision="bf16"), "keep the KV cache in fp32 or fp8"),
    (dict(batch=0), "--batch must be at least 1 sequence, got 0"),
    (dict(context=0), "--context 0 is outside 1 to 4096 (model.max_seq_len"),
    (dict(context=8192), "--context 8192 is outside 1 to 4096 (model.max_seq_len"),
    (dict(util=1.5), "util must be in (0, 1], got 1.5"),
    (dict(gpu="CPU"), "the device is cpu (--gpu, or the params' launch.device): serving is sized for GPUs; "
                         "name one of a100-40gb, a100-80gb, h100"),
    (dict(batch=10**5), "do not fit even one layer a stage on 192 x h100"),
])
def test_serving_inputs_that_cannot_be_sized_are_refused_by_name(asked, refusal):
    with pytest.raises(PlanError, match=re.escape(refusal)):
        inference_plan(PARAMS["marin-535b-a23b"], **{"gpu": "h100", **asked})


def test_the_configs_written_are_for_the_fastest_layout_the_trainer_runs(tmp_path):
    from marin_study.layout import layout_refusals
    marin = load_params(ROOT / "params/marin-535b-a23b.yaml")
    result = plan(marin, "gb200", 704)
    assert result.best.layout.pp > 1  # the planner's fastest pipelines the layers, which the trainer refuses
    chosen = result.trainable
    assert chosen.fits and chosen.layout.tp == chosen.layout.pp == 1 and chosen.layout.ep > 1
    assert not layout_refusals(marin.model, chosen.layout, marin.train.global_batch, chosen.layout.world, trainer=True)
    written = run([BIN / "marin-study", "plan", "params/marin-535b-a23b.yaml", "--gpu", "gb200", "--gpus", "704",
                   "--write-configs", str(tmp_path)])
    assert "uses parallelism the trainer does not run" in written.stderr
    assert load_params(tmp_path / "params.yaml").parallel.ep == chosen.layout.ep


def test_the_535b_runs_days_are_one_number_with_its_assumptions_everywhere():
    "The plan CLI's first line, its JSON, the launch report's metrics and the docs give the same days for the run."
    text = run([BIN / "marin-study", "plan", "params/marin-535b-a23b.yaml", "--mfu", "0.229"]).stdout.splitlines()[0]
    days = re.search(r"([\d.]+) days = ([\d.e+]+) FLOPs / \((\d+) GPUs x ([\d.]+) PFLOP/s x ([\d.]+)% MFU, given\)", text)
    assert days and days.group(3) == "704" and days.group(5) == "22.9", text
    own = json.loads(run([BIN / "marin-study", "plan", "params/marin-535b-a23b.yaml", "--mfu", "0.229", "--json"]).stdout)
    assert own["params_layout"]["days_in_words"] in text and own["params_layout"]["ep"] == 64
    assert float(days.group(2)) == pytest.approx(own["train_flops"], rel=1e-2)
    assert float(days.group(1)) == pytest.approx(float(days.group(2)) / (704 * float(days.group(4)) * 1e15 * 0.229) / 86400, rel=2e-3)
    report = json.loads((ROOT / "reports/cluster_launch.json").read_text())
    assert f"{report['days']:.1f}" == days.group(1) and report["gpus"] == 704
    assert f"**{days.group(1)} days**" in (ROOT / "docs/planning-and-launch.md").read_text()


def test_goodput_stretches_the_days_by_the_wall_clock_that_does_not_train():
    p = PARAMS["marin-535b-a23b"]
    steady, real = plan(p, "gb200", 704, mfu=0.2675), plan(p, "gb200", 704, mfu=0.2675, goodput=0.8)
    assert real.days() == pytest.approx(steady.days() / 0.8) and real.to_json()["goodput"] == 0.8
    assert "/ 80.0% goodput" in real.days_in_words() and "goodput" not in steady.days_in_words()
    for bad in (0, 1.2):
        with pytest.raises(PlanError, match=f"goodput must be in \\(0, 1\\], got {bad}"): plan(p, "gb200", 704, goodput=bad)


def test_the_535b_global_layers_keep_6_kv_heads_in_the_cache():
    m = PARAMS["marin-535b-a23b"].model
    per_layer = kv_bytes_per_layer(m, 4096)
    glob, local = [i for i in range(m.n_layers) if m.is_global(i)], [i for i in range(m.n_layers) if not m.is_global(i)]
    assert {per_layer[i] for i in glob} == {2 * 6 * 128 * 2 * 4096} and {per_layer[i] for i in local} == {2 * 12 * 128 * 2 * 2048}


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_the_planner_counts_muons_one_momentum_for_the_hidden_matrices(zero):
    from marin_study.trainer.deepspeed import hidden_params
    hero = PARAMS["marin-535b-a23b"]
    layout = Layout(ep=64, dp=704, zero_stage=zero, recompute="full")
    muon = dataclasses.replace(hero, train=dataclasses.replace(hero.train, optimizer="muon"))
    adam_plan, muon_plan = evaluate(hero, layout, HARDWARE["h100"]), evaluate(muon, layout, HARDWARE["h100"])
    dense, expert = hidden_params(hero.model)
    sharded = (dense / 704 + expert / 64 / (704 // 64)) if zero else dense + expert / 64
    assert adam_plan.memory.optimizer - muon_plan.memory.optimizer == pytest.approx(4 * sharded)
    assert (adam_plan.memory.params, adam_plan.memory.grads) == (muon_plan.memory.params, muon_plan.memory.grads)
