"The kit's shape: chapters import only earlier chapters, and one rule says which layouts can run."
import ast
import json

import pytest

from conftest import BIN, ROOT, run
from marin_study.config import ConfigError, load_params
from marin_study.data.corpus import DataError
from marin_study.data.mixture import make_loader
from marin_study.launch import layout_errors
from marin_study.layout import Layout, layout_refusals


def chapter_modules() -> dict[str, str]:
    "Module -> the library notebook that exports it (nbdev's `default_exp`), for every chapter."
    out = {}
    for path in sorted((ROOT / "nbs").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and source.startswith("#| default_exp "):
                out["marin_study." + source.split()[2]] = path.name
    return out


def kit_imports(module: str) -> set[str]:
    "The marin_study modules a module imports anywhere in its file (top level or inside a function)."
    path = ROOT / (module.replace(".", "/") + ".py")
    package = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: nbdev writes `from ..config import x` for `from marin_study.config import x`
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("marin_study"): found.add(base)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("marin_study")}
    return found - {module}


def test_every_library_module_has_a_chapter_and_reading_order_is_import_order():
    chapters = chapter_modules()
    exported = {"marin_study." + str(p.relative_to(ROOT / "marin_study").with_suffix("")).replace("/", ".")
                for p in (ROOT / "marin_study").rglob("*.py") if p.name not in ("__init__.py", "_modidx.py")}
    assert exported == set(chapters), "a module without a chapter, or a chapter whose module is missing"
    later = []
    for module, notebook in chapters.items():
        for imported in kit_imports(module):
            assert imported in chapters, f"{module} imports {imported}, which no chapter exports"
            if chapters[imported] > notebook:
                later.append(f"{notebook} ({module}) imports {imported} from the later chapter {chapters[imported]}")
    assert not later, "\n".join(later)


def test_the_trainer_does_not_import_the_planner():
    chapters = chapter_modules()
    trainer = [m for m in chapters if m.startswith("marin_study.trainer")]
    assert "marin_study.trainer.train" in trainer
    for module in trainer:
        assert not {i for i in kit_imports(module) if i.startswith("marin_study.parallelism")}, module
    assert "marin_study.trainer.deepspeed" in kit_imports("marin_study.parallelism")  # the planner imports the trainer's


def train_refusal(tmp_path, sets, world_size=1) -> str:
    "stderr of `marin-study train` refusing to start (as rank 0 of `world_size` processes)."
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    out = run([BIN / "marin-study", "train", "params/tiny.yaml", *sum((["--set", s] for s in sets), []),
               "--run-dir", str(tmp_path / "run")], check=False, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    return out.stderr


def test_a_layout_that_cannot_split_the_batch_is_refused_with_one_message(tmp_path):
    tiny = load_params(ROOT / "params/tiny.yaml")
    refusals = layout_refusals(tiny.model, Layout.from_params(tiny, 3), tiny.train.global_batch, 3, trainer=True)
    assert [r.key for r in refusals] == ["train.global_batch"]
    message = str(refusals[0])
    with pytest.raises(ConfigError) as config:
        load_params(ROOT / "params/tiny.yaml", ["launch.procs_per_node=3"])
    with pytest.raises(DataError) as loader:
        make_loader(tiny, rank=0, world_size=3)
    for where, text in [("config", str(config.value)), ("loader", str(loader.value)),
                        ("trainer", train_refusal(tmp_path, [], world_size=3))]:
        assert message in text, f"{where} says something else:\n{text}"


def test_a_layout_only_the_planner_models_is_refused_by_everything_that_trains(tmp_path):
    sets = ["parallel.pp=2"]
    params = load_params(ROOT / "params/tiny.yaml", sets)  # a valid layout: the planner models it
    refusals = layout_refusals(params.model, Layout.from_params(params, 2), params.train.global_batch, 2, trainer=True)
    assert [r.key for r in refusals] == ["parallel"]
    message = str(refusals[0])
    with pytest.raises(DataError) as loader:
        make_loader(params, rank=0, world_size=2)
    for where, text in [("launch slurm", "\n".join(layout_errors(params, "params/tiny.yaml"))), ("loader", str(loader.value)),
                        ("trainer", train_refusal(tmp_path, sets, world_size=2))]:
        assert message in text, f"{where} says something else:\n{text}"


def test_the_cli_starts_without_the_heavy_libraries():
    "`marin-study --help` (and every command that runs no notebook and trains nothing) loads neither torch nor Jupyter."
    probe = ("import sys; from marin_study import cli; cli.parser(); "
             "print(sorted(m for m in ('torch', 'nbformat', 'papermill', 'nbconvert', 'deepspeed') if m in sys.modules))")
    assert run([BIN / "python", "-c", probe]).stdout.strip() == "[]"
    assert run([BIN / "marin-study", "--help"]).stdout.startswith("usage: marin-study")
