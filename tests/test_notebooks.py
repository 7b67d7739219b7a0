"Every library notebook runs under nbdev_test, is written in nbdev's rhythm, and notebooks and library never drift."
import ast
import re

import nbformat
import pytest

from conftest import ROOT, run

LIBRARY_NOTEBOOKS = sorted(p.name for p in (ROOT / "nbs").glob("*.ipynb"))


def test_library_notebooks_found():
    assert {"index.ipynb", "00_utils.ipynb", "01_layout.ipynb", "02_config.ipynb"} <= set(LIBRARY_NOTEBOOKS)


def book_is_current() -> bool:
    "Whether `dvc repro`'s book stage, which executes every chapter, ran on exactly these notebooks, library, params and data."
    status = run(["dvc", "status", "book", "--json"], check=False)
    return status.returncode == 0 and status.stdout.strip() == "{}"


def test_every_library_notebook_runs_under_nbdev_test():
    if book_is_current():  # CI runs the README's main job first: running every chapter again would prove nothing new
        pytest.skip("dvc repro's book stage executed every chapter on exactly these files (dvc status book: up to date)")
    # one nbdev_test over them all, as nbdev's own CI runs it: each notebook in a fresh namespace, the imports paid
    # once (94 s here against 166 s for one nbdev_test a notebook); a failure names its notebooks and their tracebacks
    result = run(["nbdev_test", "--n_workers", "1"], check=False)
    assert result.returncode == 0 and "Success." in result.stdout, result.stderr[-8000:]


def test_nbdev_clean_and_export_change_nothing(project_copy):
    run(["nbdev_clean"], cwd=project_copy)
    run(["nbdev_export"], cwd=project_copy)
    changed = run(["git", "status", "--porcelain"], cwd=project_copy).stdout
    assert changed == "", f"notebooks and library drifted; run nbdev_clean and nbdev_export and commit:\n{changed}"


def test_study_notebooks_are_kept_out_of_nbdev_test_and_export_nothing():
    import nbformat
    assert (ROOT / "nbs/studies/.notest").exists()
    for path in (ROOT / "nbs/studies").glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert "parameters" in code[0].metadata.get("tags", []), f"{path.name}: first code cell must be tagged parameters"
        assert sum("parameters" in c.metadata.get("tags", []) for c in nb.cells) == 1
        assert not any("#| export" in c.source or "default_exp" in c.source for c in code), f"{path.name} exports"


MAX_EXPORTED_LINES = 50
EXPORTED = re.compile(r"^#\|\s*export", re.M)  # export, exporti, exports
# A cell that holds one class or function longer than MAX_EXPORTED_LINES: a definition cannot span cells without
# rewriting it, and these are restructured only, never rewritten. (notebook, name) -> why it stays whole.
LONG_DEFINITIONS = {
    ("02_config.ipynb", "ModelConfig"): "one dataclass: 30 typed fields, then the cross-field rules that read them",
    ("05_model.ipynb", "MoE"): "one nn.Module: route, dispatch, combine and the balancing bias share its buffers",
    ("05_model.ipynb", "Transformer"): "one nn.Module: init, ZeRO-3's borrowed weights, the bias update, the forward",
    ("06d_mixture.ipynb", "Mixture"): "one class: the block cache and the phase counts are its state",
    ("07g_evaluation.ipynb", "HeldOut"): "one class: its windows, their weighted sums and the macro averages share the domains",
    ("07h_checkpointer.ipynb", "Checkpointer"): "one class: save, find and restore share the staging and rank protocol",
    ("07j_train.ipynb", "Trainer"): "one class: the components it wires, the step and the loop that reads as a screen",
    ("09_parallelism.ipynb", "Plan"): "one dataclass: days, table, explanation and JSON of the same candidates",
    ("09_parallelism.ipynb", "InferencePlan"): "one dataclass: the explanation, JSON and launch commands of its fields",
    ("12_widgets.ipynb", "PlannerWidget"): "one class: its controls, their callbacks and the redraw",
    ("13d_evaluate.ipynb", "_lm_class"): "one class, lm-eval's model interface, inside a function: lm_eval loads on use",
    ("90_cli.ipynb", "parser"): "one function: the argparse tree of every subcommand",
}


def exported_cells(notebook: str):
    "(index, cell, the cells up to the next exported one) for each exported code cell."
    cells = nbformat.read(ROOT / "nbs" / notebook, as_version=4).cells
    marks = [i for i, c in enumerate(cells) if c.cell_type == "code" and EXPORTED.search(c.source)]
    for k, i in enumerate(marks):
        yield i, cells[i], cells[i + 1:marks[k + 1] if k + 1 < len(marks) else len(cells)]


def top_level(source: str) -> list:
    "The cell's top-level statements (nbdev's `#|` directives are comments)."
    return ast.parse(source).body


def test_the_long_definitions_are_still_whole_and_long():
    for (notebook, name), why in LONG_DEFINITIONS.items():
        found = [cell for _, cell, _ in exported_cells(notebook)
                 if [getattr(n, "name", None) for n in top_level(cell.source)] == [name]]
        assert found and len(found[0].source.splitlines()) > MAX_EXPORTED_LINES, \
            f"{notebook}: {name} no longer needs its exception ({why}); remove it from LONG_DEFINITIONS"


@pytest.mark.parametrize("notebook", LIBRARY_NOTEBOOKS)
def test_exported_cells_are_short_and_each_is_followed_by_an_example(notebook):
    problems = []
    for i, cell, following in exported_cells(notebook):
        body = top_level(cell.source)
        names = [getattr(n, "name", None) for n in body]
        lines = len(cell.source.splitlines())
        if lines > MAX_EXPORTED_LINES and not (len(names) == 1 and (notebook, names[0]) in LONG_DEFINITIONS):
            problems.append(f"cell {i} ({', '.join(filter(None, names))}) has {lines} lines, more than "
                            f"{MAX_EXPORTED_LINES}: split it at a class or a group of functions")
        imports_only = all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in body)  # shown by what uses them
        if not imports_only and not any(c.cell_type == "code" for c in following):
            problems.append(f"cell {i} ({', '.join(filter(None, names))}) has no example: add a non-exported code "
                            "cell (an example or an assert) after it, before the next exported cell")
    assert not problems, f"{notebook}:\n  " + "\n  ".join(problems)
