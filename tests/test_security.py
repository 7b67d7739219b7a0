"""Nothing the kit reads can run code: checkpoints and exports load weights-only, YAML through a safe loader, and no
pickle, eval or exec anywhere in the library."""
import ast
import shutil
import textwrap

import pytest
import torch
import yaml

from conftest import ROOT, command, run
from marin_study.config import YamlLoader

SAFE_LOADERS = {"YamlLoader", "SafeLoader", "CSafeLoader"}  # YamlLoader is checked to be a SafeLoader below
UNPICKLERS = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib", "_pickle"}


def _dotted(node) -> str:
    "'torch.load' for the call target `torch.load`, '' for anything that is not a plain dotted name."
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def unsafe_calls(source: str, filename: str = "<planted>") -> list[str]:
    "Every call in `source` that could run code from a file or a string: 'file:line: what'."
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNPICKLERS:
            found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
        if not isinstance(node, ast.Call): continue
        name, where = _dotted(node.func), f"{filename}:{node.lineno}"
        weights_only = _keyword(node, "weights_only")
        if name == "torch.load" and not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
            found.append(f"{where}: torch.load without weights_only=True")
        loader = _keyword(node, "Loader")
        if name == "yaml.load" and _dotted(loader).split(".")[-1] not in SAFE_LOADERS:
            found.append(f"{where}: yaml.load without a safe Loader")
        if name in ("yaml.unsafe_load", "yaml.full_load", "yaml.load_all") or name.startswith("yaml.Unsafe"):
            found.append(f"{where}: {name}")
        if name.split(".")[0] in UNPICKLERS and name.split(".")[-1] in ("load", "loads", "Unpickler", "open"):
            found.append(f"{where}: {name}")
        allow_pickle = _keyword(node, "allow_pickle")
        if name in ("np.load", "numpy.load") and not (allow_pickle is None or getattr(allow_pickle, "value", True) is False):
            found.append(f"{where}: {name} with allow_pickle")
        if isinstance(node.func, ast.Name) and node.func.id in ("eval", "exec", "compile", "__import__"):
            found.append(f"{where}: {node.func.id}()")
    return found


def test_the_checker_finds_every_planted_pattern_and_passes_the_safe_ones():
    planted = textwrap.dedent("""
        import pickle, torch, yaml, numpy as np
        from dill import loads
        torch.load(path)
        torch.load(path, weights_only=False)
        yaml.load(text)
        yaml.load(text, Loader=yaml.Loader)
        yaml.unsafe_load(text)
        pickle.load(f)
        pickle.loads(data)
        np.load(path, allow_pickle=True)
        eval(params["lr"])
        exec(source)
    """)
    assert len(unsafe_calls(planted)) == 11, unsafe_calls(planted)
    safe = textwrap.dedent("""
        import torch, yaml, ast, numpy as np
        torch.load(path, map_location="cpu", weights_only=True)
        yaml.load(text, Loader=YamlLoader)
        yaml.safe_load(text)
        model.eval()
        ast.literal_eval(source)
        np.load(path)
        except pickle.UnpicklingError: pass
    """).replace("except pickle.UnpicklingError: pass", "pickle.UnpicklingError")
    assert unsafe_calls(safe) == []


def test_the_library_loads_nothing_that_could_run_code():
    assert issubclass(YamlLoader, yaml.SafeLoader)
    files = sorted((ROOT / "marin_study").rglob("*.py"))
    assert len(files) > 30
    found = [hit for path in files for hit in unsafe_calls(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "\n".join(found)


class RunsCode:
    "A pickle that would create `marker` when loaded: what a hostile checkpoint carries."
    def __init__(self, marker): self.marker = marker
    def __reduce__(self): return (open, (str(self.marker), "w"))


def test_a_resume_refuses_an_rng_file_that_would_run_code(params_file, tmp_path):
    "rng-0.pt is loaded after DeepSpeed's files: a payload there, under a regenerated manifest, is refused too."
    from marin_study.trainer.checkpoint import write_manifest
    run_dir, marker = tmp_path / "run", tmp_path / "code-ran"
    run(command("alone", params_file, run_dir, until=2))
    step = run_dir / "checkpoints/step-00000002"
    state = torch.load(step / "rng-0.pt", weights_only=False)  # the test's own file, written by the trainer just now
    torch.save({**state, "payload": RunsCode(marker)}, step / "rng-0.pt")
    write_manifest(step)
    result = run(command("alone", params_file, run_dir, until=3), check=False)
    assert result.returncode == 2 and "refusing to unpickle" in result.stderr and "rng-0.pt" in result.stderr
    assert "Traceback" not in result.stderr and not marker.exists()
