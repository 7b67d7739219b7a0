import dataclasses
import os
import stat

import pytest
import yaml

from conftest import ROOT
from marin_study.config import (ConfigError, ModelConfig, Params, YamlLoader, dump_params, load_params, params_from_dict,
                                save_params)
from marin_study.utils import atomic_write

PRESETS = sorted((ROOT / "params").glob("*.yaml"))


def write(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def tiny_dict():
    return yaml.safe_load((ROOT / "params/tiny.yaml").read_text())


def error_of(fn, *args, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kw)
    return info.value


def test_presets_are_the_ladder():
    assert [p.stem for p in PRESETS] == ["marin-535b-a23b", "node", "small", "tiny"]


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads_validates_and_round_trips(path, tmp_path):
    params = load_params(path)
    assert load_params(save_params(params, tmp_path / "again.yaml")) == params
    assert yaml.load(dump_params(params), Loader=YamlLoader) == params.to_dict()


def test_exponent_floats_load_as_floats(tmp_path):
    text = (ROOT / "params/tiny.yaml").read_text().replace("lr: 3.0e-3", "lr: 3e-4")
    params = load_params(write(tmp_path, text))
    assert params.train.lr == 3e-4 and isinstance(params.train.lr, float)


def test_overrides_use_the_yaml_types_and_nested_keys():
    params = load_params(ROOT / "params/tiny.yaml", ["train.lr=1e-3", "train.steps=7", "train.schedule=wsd",
                                                     "data.mixture.code=0.5", "launch.modules=[cuda/12, nccl]"])
    assert params.train.lr == 1e-3 and params.train.steps == 7 and params.train.schedule == "wsd"
    assert params.data.mixture["code"] == 0.5 and params.launch.modules == ["cuda/12", "nccl"]


def test_an_int_is_a_valid_float_but_not_the_other_way_round(tmp_path):
    params = load_params(ROOT / "params/tiny.yaml", ["train.lr=1"])
    assert params.train.lr == 1.0 and isinstance(params.train.lr, float)
    err = error_of(load_params, ROOT / "params/tiny.yaml", ["train.steps=2.5"])
    assert "train.steps: expected an integer, got 2.5" in str(err)


def test_unknown_key_names_file_line_and_suggests(tmp_path):
    path = write(tmp_path, (ROOT / "params/tiny.yaml").read_text().replace("  hidden_size: 128", "  hiden_size: 128"))
    err = error_of(load_params, path)
    line = next(i for i, l in enumerate(path.read_text().splitlines(), 1) if "hiden_size" in l)
    assert f"{path}:{line}: model.hiden_size: unknown key" in str(err)
    assert "did you mean 'model.hidden_size'?" in str(err)
    assert "model.hidden_size: is missing" in str(err)


def test_unknown_section_and_override_key_suggest():
    err = error_of(load_params, ROOT / "params/tiny.yaml", ["trian.lr=1e-3", "train.lrr=1", "train.lr"])
    text = str(err)
    assert "override 'trian.lr=1e-3': trian.lr: unknown section (fix: did you mean 'train'?)" in text
    assert "override 'train.lrr=1': train.lrr: unknown key (fix: did you mean 'train.lr'?)" in text
    assert "train.lr: an override must look like key=value" in text
    assert len(err.problems) == 3


@pytest.mark.parametrize("override, key, words", [
    ("model.top_k=40", "model.top_k", "not between 1 and n_experts (32)"),
    ("model.n_kv_heads=3", "model.n_heads", "cannot be shared evenly by 3 KV heads"),
    ("model.sliding_window=256", "model.sliding_window", "not shorter than max_seq_len"),
    ("train.seq_len=512", "train.seq_len", "longer than model.max_seq_len (256)"),
    ("train.seq_len=64", "model.sliding_window", "not shorter than train.seq_len (64)"),
    ("train.micro_batch=3", "train.global_batch", "not a multiple of micro_batch (3)"),
    ("parallel.tp=3", "parallel.tp", "does not divide model.n_heads (4)"),
    ("parallel.ep=5", "parallel.ep", "does not divide model.n_experts (32)"),
    ("parallel.zero_stage=4", "parallel.zero_stage", "out of range"),
    ("train.lr=0", "train.lr", "out of range"),
    ("data.mixture={a: 0, b: 0}", "data.mixture", "has no positive weight"),
    ("data.mixture.web=-1", "data.mixture.web", "is negative"),
    ("launch.time=2 days", "launch.time", "not a Slurm time limit"),
    ("launch.gpus_per_node=8", "launch.procs_per_node", "one process per GPU"),
    ("data.num_workers=-1", "data.num_workers", "out of range"),
    ("train.init_from=runs/a:last", "train.init_from", "must be followed by a step number"),
    ("train.init_from=:400", "train.init_from", "RUN_DIR is missing"),
    ("train.profile={start: 299, steps: 5}", "train.profile", "past the run's 300 steps"),
    ("train.profile.flops=true", "train.profile", "but steps is 0 (profiling off)"),
    ("train.profile.stat=3", "train.profile.stat", "did you mean 'train.profile.start'"),
    ("train.target={eval/bpb: low}", "train.target", "expected a number, got 'low'"),
    ("train.trackers=[neptune]", "train.trackers", "one of 'tensorboard', 'wandb', 'mlflow'"),
    ("train.trackers=[wandb, wandb]", "train.trackers", "names a tracker twice"),
])
def test_rules_name_the_key_the_problem_and_a_fix(override, key, words):
    err = error_of(load_params, ROOT / "params/tiny.yaml", [override])
    matching = [p for p in err.problems if p.key == key and words in f"{p.message} {p.fix}"]
    assert matching and all(p.fix for p in err.problems), str(err)
    assert f"override '{override}'" in str(err) or "params/tiny.yaml" in str(err)


def test_init_from_and_num_workers_load_with_their_defaults_and_round_trip(tmp_path):
    tiny = load_params(ROOT / "params/tiny.yaml")
    assert tiny.train.init_from == "" and tiny.data.num_workers == 0
    p = load_params(ROOT / "params/tiny.yaml", ["train.init_from=runs/tiny/run:200", "data.num_workers=2"])
    assert p.train.init_from == "runs/tiny/run:200" and p.data.num_workers == 2
    assert load_params(save_params(p, tmp_path / "again.yaml")) == p


def test_trackers_default_to_tensorboard_and_an_older_tensorboard_key_still_loads(tmp_path):
    assert load_params(ROOT / "params/tiny.yaml").train.trackers == ["tensorboard"]
    older = (ROOT / "params/tiny.yaml").read_text().replace("train:\n", "train:\n  tensorboard: false\n", 1)
    (tmp_path / "older.yaml").write_text(older)  # what a run folder's params.yaml of an older kit holds
    assert load_params(tmp_path / "older.yaml").train.trackers == []


def test_dense_model_rules():
    dense = dict(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=64)
    assert ModelConfig(**dense, dense_ffn=128).is_moe is False
    assert "needs an MLP width" in str(error_of(ModelConfig, **dense))
    assert "n_experts is 0" in str(error_of(ModelConfig, **dense, dense_ffn=128, top_k=2))


def test_all_problems_are_reported_at_once(tmp_path):
    raw = tiny_dict()
    raw["model"]["top_k"] = 99
    raw["train"]["lr"] = "fast"
    raw["launch"]["nodes"] = 0
    err = error_of(params_from_dict, raw, "x.yaml")
    assert {p.key for p in err.problems} == {"model.top_k", "train.lr", "launch.nodes"}


def test_bad_files_get_clear_errors(tmp_path):
    assert "does not exist" in str(error_of(load_params, tmp_path / "missing.yaml"))
    assert "not valid YAML" in str(error_of(load_params, write(tmp_path, "model: [1, 2\n")))
    assert f"{tmp_path / 'p.yaml'}:" in str(error_of(load_params, write(tmp_path, "model:\n  a: [1, 2\n")))
    assert "expected a mapping of sections" in str(error_of(load_params, write(tmp_path, "- 1\n- 2\n")))
    empty = error_of(load_params, write(tmp_path, ""))
    assert {p.key for p in empty.problems} == {"model", "train"}
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00garbage")
    assert "UTF-8" in str(error_of(load_params, tmp_path / "bin.yaml"))
    dup = (ROOT / "params/tiny.yaml").read_text().replace("  n_layers: 4\n", "  n_layers: 4\n  n_layers: 6\n")
    assert "model.n_layers: appears twice" in str(error_of(load_params, write(tmp_path, dup)))


def test_direct_construction_is_validated_too():
    cfg = load_params(ROOT / "params/tiny.yaml")
    with pytest.raises(ConfigError, match="model.sliding_window"):
        Params(model=cfg.model, train=dataclasses.replace(cfg.train, seq_len=64))
    with pytest.raises(ConfigError, match="hidden_size: expected an integer"):
        dataclasses.replace(cfg.model, hidden_size="128")


def test_global_layers_follow_the_535b_pattern():
    m = load_params(ROOT / "params/marin-535b-a23b.yaml").model
    assert [i for i in range(m.n_layers) if m.is_global(i)] == list(range(3, 48, 4))
    tiny = load_params(ROOT / "params/tiny.yaml").model
    assert [tiny.is_global(i) for i in range(4)] == [False, False, False, True]


def test_atomic_write_replaces_whole_files_and_keeps_the_old_one_on_failure(tmp_path):
    target = tmp_path / "deep/dir/report.txt"
    atomic_write(target, "first")
    os.chmod(target, 0o640)
    atomic_write(target, b"second")
    assert target.read_text() == "second" and stat.S_IMODE(target.stat().st_mode) == 0o640

    with pytest.raises(TypeError):
        atomic_write(target, 12345)  # fails half-way, after the temporary file exists
    assert target.read_text() == "second"
    assert [p.name for p in target.parent.iterdir()] == ["report.txt"]


def test_yaml_12_core_schema_like_dvc(tmp_path):
    text = (ROOT / "params/tiny.yaml").read_text().replace("  device: cpu", "  device: cpu\n  time: 12:00:00\n  partition: no\n  account: 1e5x")
    params = load_params(write(tmp_path, text))
    assert params.launch.time == "12:00:00" and params.launch.partition == "no"


def test_strings_that_look_like_numbers_survive_a_dump(tmp_path):
    params = load_params(ROOT / "params/tiny.yaml", ["launch.account='1e5'", "launch.env={NCCL_BUFFSIZE: '4e6', FLAG: 'null'}"])
    assert params.launch.account == "1e5"
    assert load_params(save_params(params, tmp_path / "p.yaml")) == params


def test_bad_override_values_are_clear_errors():
    err = error_of(load_params, ROOT / "params/tiny.yaml", ["train.lr=[1,", "train.lr=.inf", "train.steps=!!python/object:os.system x"])
    text = str(err)
    assert "train.lr: value '[1,' is not valid YAML" in text and "expected a finite number" in text
    assert "train.steps: value '!!python/object:os.system x' is not valid YAML" in text


def test_micro_batches_must_divide_each_ranks_share():
    err = error_of(load_params, ROOT / "params/tiny.yaml", ["launch.procs_per_node=4"])
    assert "16 sequences cannot be split into micro-batches of 8 on 4 data-parallel ranks" in str(err)
