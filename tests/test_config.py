import dataclasses
import json
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
    text = (ROOT / "params/tiny.yaml").read_text().replace("adam_lr: 3.0e-3", "adam_lr: 3e-4")
    params = load_params(write(tmp_path, text))
    assert params.train.adam_lr == 3e-4 and isinstance(params.train.adam_lr, float)


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
    assert "override 'train.lr': train.lr: has no '='" in text
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
    ("train.profile={start: 799, steps: 5}", "train.profile", "past the run's 800 steps"),
    ("train.profile.flops=true", "train.profile", "but steps is 0 (profiling off)"),
    ("train.profile.stat=3", "train.profile.stat", "did you mean 'train.profile.start'"),
    ("train.target={eval/bpb: low}", "train.target.eval/bpb", "expected a number, got 'low'"),
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
    assert "capacity_factor" in str(error_of(ModelConfig, **dense, dense_ffn=128, capacity_factor=1.25))  # no experts to drop


def test_document_mask_is_off_by_default_and_its_end_of_document_id_must_be_a_token():
    raw = tiny_dict()
    del raw["model"]["document_mask"]  # the tiny study masks; a params file that says nothing does not
    assert params_from_dict(raw).model.document_mask is False  # every existing run stays what it was
    raw["model"] |= {"document_mask": True, "eod_id": raw["model"]["vocab_size"]}
    message = str(error_of(params_from_dict, raw))
    assert "model.eod_id" in message and "below vocab_size" in message


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


def test_one_problem_is_one_line_naming_the_file_line_and_key(tmp_path):
    path = write(tmp_path, (ROOT / "params/tiny.yaml").read_text().replace("  steps: 800", "  steps: many"))
    line = next(i for i, l in enumerate(path.read_text().splitlines(), 1) if "steps: many" in l)
    assert str(error_of(load_params, path)) == (f"{path}:{line}: train.steps: expected an integer, got 'many' "
                                                "(fix: write steps as an integer)")
    two = str(error_of(load_params, path, ["train.lr=0"]))
    assert two.splitlines()[0] == f"{path}: 2 problems in the params" and len(two.splitlines()) == 3


def test_a_tab_in_the_indentation_is_named_with_its_line(tmp_path):
    path = write(tmp_path, (ROOT / "params/tiny.yaml").read_text().replace("  hidden_size: 128", "\thidden_size: 128"))
    line = next(i for i, l in enumerate(path.read_text().splitlines(), 1) if "hidden_size" in l)
    text = str(error_of(load_params, path))
    assert text.startswith(f"{path}:{line}: ") and "tab" in text and "YAML forbids tabs" in text and "spaces" in text
    assert "\n" not in text
    syntax = str(error_of(load_params, write(tmp_path, "model:\n  a: [1, 2\n")))
    assert "\n" not in syntax and "column" in syntax and "fix:" in syntax


def test_a_folder_or_a_missing_file_is_named_as_such(tmp_path):
    (tmp_path / "tiny.yaml").write_text("")
    folder = str(error_of(load_params, tmp_path))
    assert "is a folder" in folder and f"{tmp_path / 'tiny.yaml'}" in folder and "\n" not in folder
    assert "does not exist" in str(error_of(load_params, tmp_path / "nope.yaml"))


@pytest.mark.parametrize("name", ["with space/my params.yaml", "ünïcödé/pärams.yaml"])
def test_paths_with_spaces_and_non_ascii_load_and_are_named_in_errors(tmp_path, name):
    path = tmp_path / name
    path.parent.mkdir()
    path.write_text((ROOT / "params/tiny.yaml").read_text())
    assert load_params(path) == load_params(ROOT / "params/tiny.yaml")
    path.write_text(path.read_text().replace("  adam_lr: 3.0e-3", "  adam_lr: -1"))
    assert str(error_of(load_params, path)).startswith(f"{path}:")


def test_an_override_without_equals_names_the_override_not_the_files_line():
    text = str(error_of(load_params, ROOT / "params/tiny.yaml", ["train.lr"]))
    assert text.startswith("params/tiny.yaml: override 'train.lr': ") or text.startswith(f"{ROOT}/params/tiny.yaml: override 'train.lr': ")
    assert "no '='" in text and "train.lr=VALUE" in text


def test_a_bad_value_inside_a_mapping_names_its_own_key():
    err = error_of(load_params, ROOT / "params/tiny.yaml", ["data.mixture.web=abc"])
    assert [p.key for p in err.problems] == ["data.mixture.web"]
    assert "override 'data.mixture.web=abc': data.mixture.web: expected a number, got 'abc'" in str(err)
    nested = error_of(load_params, ROOT / "params/tiny.yaml", ["data.filter_overrides.code.max_symbol_ratio=x"])
    assert [p.key for p in nested.problems] == ["data.filter_overrides.code.max_symbol_ratio"]
    assert "numberss" not in str(nested)


def corpus(tmp_path, domains=("web", "books", "code", "docs", "math")):
    "Overrides pointing data.dir at a collected corpus of these domains (tiny's filter overrides name code, docs, math)."
    (tmp_path / "data").mkdir()
    (tmp_path / "data/SOURCES.json").write_text(json.dumps([{"name": d + "-src", "domain": d} for d in domains]))
    return [f"data.dir={tmp_path / 'data'}", "data.mixture={web: 1, books: 1, code: 1}"]


def test_a_mixture_domain_the_corpus_lacks_is_refused_with_a_suggestion(tmp_path):
    sets = corpus(tmp_path)
    assert load_params(ROOT / "params/tiny.yaml", sets).data.mixture == {"web": 1.0, "books": 1.0, "code": 1.0}
    err = error_of(load_params, ROOT / "params/tiny.yaml", sets + ["data.mixture.webz=0.5"])
    assert [p.key for p in err.problems] == ["data.mixture.webz"]
    assert "not in the corpus" in str(err) and "did you mean 'web'?" in str(err) and "SOURCES.json" in str(err)
    phases = error_of(load_params, ROOT / "params/tiny.yaml", sets + ["data.mixture=[{start_step: 0, weights: {cod: 1}}]"])
    assert "cod" in str(phases) and "did you mean 'code'?" in str(phases)
    no_corpus = [f"data.dir={tmp_path / 'none'}", "data.mixture={anything: 1}"]  # nothing collected yet: not judged
    assert load_params(ROOT / "params/tiny.yaml", no_corpus).data.mixture == {"anything": 1.0}


@pytest.mark.parametrize("override, key", [
    ("launch.partition=gpu; rm -rf ~", "launch.partition"),
    ('launch.partition="gpu\\n#SBATCH --qos=top"', "launch.partition"),
    ("launch.account=my account", "launch.account"),
    ("launch.qos=$(whoami)", "launch.qos"),
    ("launch.device=`id`", "launch.device"),
    ("launch.modules=[cuda/12, 'nccl && curl x']", "launch.modules"),
    ("launch.env={BAD-NAME: x}", "launch.env"),
    ("launch.env={1X: x}", "launch.env"),
    ('launch.env={X: "a\\nb"}', "launch.env.X"),
    ('launch.env={X: "a\\0b"}', "launch.env.X"),
    ('launch.time="01:00:00\\n"', "launch.time"),
])
def test_names_written_into_a_shell_script_are_refused_at_validation(override, key):
    err = error_of(load_params, ROOT / "params/tiny.yaml", [override])
    assert [p.key for p in err.problems] == [key], str(err)
    assert "\n" not in str(err) and "fix:" in str(err)


def test_safe_launch_names_and_any_printable_env_value_load():
    p = load_params(ROOT / "params/tiny.yaml", ["launch.partition=gpu,gpu-large", "launch.account=proj_01@site",
                                                "launch.qos=high+1", "launch.modules=[cuda/12.4, nccl=2.21%x:y]",
                                                "launch.env={NCCL_DEBUG: INFO, _X1: 'a b $HOME \"q\" ; | & é'}"])
    assert p.launch.partition == "gpu,gpu-large" and p.launch.env["_X1"] == 'a b $HOME "q" ; | & é'
