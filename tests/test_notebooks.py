"Every library notebook runs under nbdev_test, and notebooks and library never drift."
import pytest

from conftest import ROOT, run

LIBRARY_NOTEBOOKS = sorted(p.name for p in (ROOT / "nbs").glob("*.ipynb"))


def test_library_notebooks_found():
    assert {"index.ipynb", "00_utils.ipynb", "01_layout.ipynb", "02_config.ipynb"} <= set(LIBRARY_NOTEBOOKS)


@pytest.mark.parametrize("notebook", LIBRARY_NOTEBOOKS)
def test_notebook_runs_under_nbdev_test(notebook):
    result = run(["nbdev_test", "--path", f"nbs/{notebook}", "--n_workers", "1"], check=False)
    assert result.returncode == 0 and "Success." in result.stdout, result.stderr[-4000:]


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
