"The marin-study command: real output on good input, a clear error and exit 2 (never a traceback) on bad input."
import yaml

from conftest import ROOT, run
from marin_study.config import load_params


def test_params_show_prints_the_validated_config_and_accounting():
    out = run(["marin-study", "params", "show", "params/marin-535b-a23b.yaml"]).stdout
    assert yaml.safe_load(out)["model"]["n_experts"] == 384
    assert "535.31B total" in out and "22.76B without embedding and head" in out and "18.01T" in out


def test_params_show_applies_overrides_and_round_trips(tmp_path):
    out = run(["marin-study", "params", "show", "params/tiny.yaml", "--set", "train.lr=3e-4", "--set", "train.steps=9"]).stdout
    (tmp_path / "shown.yaml").write_text(out)
    shown = load_params(tmp_path / "shown.yaml")
    assert shown.train.lr == 3e-4 and shown.train.steps == 9
    assert shown == load_params(ROOT / "params/tiny.yaml", ["train.lr=3e-4", "train.steps=9"])


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path):
    cases = {
        ("params/tiny.yaml", "--set", "train.stpes=9"): "did you mean 'train.steps'?",
        ("params/tiny.yaml", "--set", "model.top_k=99"): "model.top_k: 99 is not between 1 and n_experts",
        ("no/such.yaml",): "no/such.yaml: (file): does not exist",
    }
    (tmp_path / "broken.yaml").write_text("model:\n  vocab_size: [1\n")
    cases[(str(tmp_path / "broken.yaml"),)] = "not valid YAML"
    for args, words in cases.items():
        result = run(["marin-study", "params", "show", *args], check=False)
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""


def test_usage_errors_from_argparse():
    result = run(["marin-study", "params"], check=False)
    assert result.returncode == 2 and "usage: marin-study params" in result.stderr
