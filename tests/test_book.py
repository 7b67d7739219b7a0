"The book: library chapters executed from their folder and rendered offline, atomically, in reading order."
import re
import shutil

import nbformat
import pytest

from conftest import BIN, ROOT, run
from marin_study.studies import book_chapters, remote_references, render_book

SMALL = ["03_hardware.ipynb", "12_widgets.ipynb"]  # seconds each; the widgets chapter draws its plots in widgets


@pytest.fixture
def chapters(tmp_path):
    "Two real chapters in a folder laid out like the project's (they read ../params), and a contents page."
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    for name in ["index.ipynb", *SMALL]: shutil.copy(ROOT / "nbs" / name, nbs / name)
    shutil.copytree(ROOT / "params", tmp_path / "params")
    (nbs / "studies").mkdir()  # a sub-folder is no chapter
    shutil.copy(ROOT / "nbs/studies/ladder.ipynb", nbs / "studies/ladder.ipynb")
    return nbs


def test_the_book_links_its_chapters_in_order_embeds_plots_and_loads_nothing_remote(chapters, tmp_path):
    index = render_book(chapters, tmp_path / "book").read_text()
    pages = sorted(p.name for p in (tmp_path / "book").iterdir())
    assert pages == ["03_hardware.html", "12_widgets.html", "index.html", "introduction.html"]
    links = re.findall(r'href="([\w.]+\.html)"', index)
    assert links == ["introduction.html", "03_hardware.html", "12_widgets.html"]
    assert "Hardware: the accelerators a plan or a run can name" in index  # each chapter by its title
    widgets = (tmp_path / "book/12_widgets.html").read_text()
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', widgets)) >= 2  # the planner's and the explorer's plots
    assert "application/vnd.jupyter.widget-view+json" not in widgets  # widgets replaced by what they showed
    for page in (tmp_path / "book").iterdir():
        assert not remote_references(page.read_text()), f"{page.name} loads something from the network"
    assert 'class="jp-InputArea' in (tmp_path / "book/03_hardware.html").read_text()  # the book shows the code


def test_a_failing_chapter_is_named_and_leaves_the_previous_book_and_nothing_else(chapters, tmp_path):
    book = tmp_path / "book"
    render_book(chapters, book)
    before = {p.name: p.read_bytes() for p in book.iterdir()}
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Broken"),
                                                   nbformat.v4.new_code_cell("import json\njson.loads('{oops')")]),
                   chapters / "99_broken.ipynb")
    result = run([BIN / "marin-study", "book", "--nbs", str(chapters), "--out", str(book)], check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("marin-study: error: ") and "99_broken.ipynb: cell 2" in message and "JSONDecodeError" in message
    assert {p.name: p.read_bytes() for p in book.iterdir()} == before  # not one page of the failed run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["book", "nbs", "params"]  # no temporary folder left
    fresh = tmp_path / "fresh"
    with pytest.raises(Exception, match="99_broken.ipynb"):
        render_book(chapters, fresh)
    assert not fresh.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["book", "nbs", "params"]


def test_the_book_is_the_library_chapters_in_reading_order():
    chapters = book_chapters(ROOT / "nbs")
    assert chapters[0].name == "index.ipynb" and [c.name for c in chapters[1:]] == sorted(
        p.name for p in (ROOT / "nbs").glob("*.ipynb") if p.name != "index.ipynb")
    assert all(c.parent == ROOT / "nbs" for c in chapters)  # nbs/studies are studies, not chapters


def test_every_chapter_has_a_part_and_the_contents_table_is_the_book():
    "The parts are runs of chapter numbers (reading them in turn reads the book in order); index.ipynb's table is them."
    from marin_study.studies import BOOK_PARTS, chapter_part
    chapters = [c.stem for c in book_chapters(ROOT / "nbs")]
    parts = [chapter_part(c) for c in chapters]
    assert "More" not in parts, [c for c, p in zip(chapters, parts) if p == "More"]  # give a new chapter's number a part
    assert [p for k, p in enumerate(parts) if k == 0 or p != parts[k - 1]] == list(BOOK_PARTS)  # contiguous, in order
    index = "".join(nbformat.read(ROOT / "nbs/index.ipynb", as_version=4).cells[0].source)
    table = re.findall(r"^\| ([^|`]+?) \| `(\w+)` \|", index, re.M)
    assert table == list(zip(parts[1:], chapters[1:])), "update the contents table in nbs/index.ipynb"


def test_the_main_jobs_book_and_reports_name_no_path_of_the_machine_that_built_them():
    "CI builds them in a clone whose folder is its own: no page may carry that folder (nor this one's) into a report."
    pages = sorted((ROOT / "reports").glob("*.html")) + sorted((ROOT / "reports/book").glob("*.html"))
    if len(pages) < 10: pytest.skip("no book yet: run the main job (dvc repro) first")
    leaking = [p.name for p in pages if str(ROOT) in p.read_text(errors="replace")]
    assert not leaking, f"absolute paths of {ROOT} in {leaking}"
