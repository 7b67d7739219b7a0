"README.md starts with exactly three commands, CI runs all three as written, and nbdev cannot overwrite it."
import configparser
import os
import re
import shutil
import subprocess

from conftest import BIN, ROOT, run


def readme_commands():
    text = (ROOT / "README.md").read_text()
    block = re.match(r"# marin-study\n+```bash\n(.*?)\n```", text, re.S)
    assert block, "README.md must start with its title and one bash block of commands"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines()]


def test_readme_starts_with_install_main_job_and_tests():
    install, main_job, tests = readme_commands()
    assert install == "./install.sh" and (ROOT / "install.sh").stat().st_mode & 0o111
    assert main_job.endswith("dvc repro")
    assert "pytest" in tests


def test_ci_runs_the_readme_commands_verbatim():
    listed = subprocess.run([ROOT / ".ci/run", "--list"], capture_output=True, text=True, check=True).stdout
    assert listed.splitlines() == readme_commands()


# What Quarto does for nbdev_readme: `quarto render NOTEBOOK -o README.md` writes _docs/README.md, which nbdev then
# moves over the project's README.md. There is no Quarto here, so this stand-in plays its part.
FAKE_QUARTO = """#!/bin/sh
[ "$1" = render ] || exit 0
[ -f "$2" ] || { echo "quarto: no such file: $2" >&2; exit 1; }
mkdir -p _docs && echo "rendered from $2" > _docs/README.md
"""


def nbdev_readme_in_a_copy(tmp_path, readme_nb: str, *flags: str) -> str:
    "README.md after `nbdev_readme` in a copy of the project's settings, README and index, with readme_nb set."
    bin_dir, dest = tmp_path / "bin", tmp_path / readme_nb.replace(".", "-")
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "quarto").write_text(FAKE_QUARTO)
    (bin_dir / "quarto").chmod(0o755)
    (dest / "nbs").mkdir(parents=True)
    settings = re.sub(r"(?m)^readme_nb = .*$", f"readme_nb = {readme_nb}", (ROOT / "settings.ini").read_text())
    (dest / "settings.ini").write_text(settings)
    shutil.copy(ROOT / "README.md", dest / "README.md")
    shutil.copy(ROOT / "nbs/index.ipynb", dest / "nbs/index.ipynb")
    run(["nbdev_readme", *flags], cwd=dest, check=False, timeout=300,
        env={"PATH": os.pathsep.join([str(bin_dir), str(BIN), os.environ["PATH"]])})
    return (dest / "README.md").read_text()


def test_nbdev_cannot_overwrite_the_hand_written_readme(tmp_path):
    settings = configparser.ConfigParser()
    settings.read(ROOT / "settings.ini")
    readme_nb = settings["DEFAULT"]["readme_nb"]  # nbdev falls back to index.ipynb when the key is absent
    assert not (ROOT / "nbs" / readme_nb).exists(), f"readme_nb = {readme_nb} would let nbdev_readme overwrite README.md"
    readme = (ROOT / "README.md").read_text()
    assert nbdev_readme_in_a_copy(tmp_path, "index.ipynb").startswith("rendered from")  # the stand-in overwrites
    assert nbdev_readme_in_a_copy(tmp_path, readme_nb) == readme
    assert nbdev_readme_in_a_copy(tmp_path / "chk", readme_nb, "--chk_time") == readme  # what nbdev_docs/prepare call


def test_no_chapter_cites_a_file_outside_the_repository():
    outside = re.compile(r"\.\./\.\./|(?<![\w-])shared/|/work/")
    cited = [f"{path.relative_to(ROOT)}: {match.group(0)!r} in {line.strip()[:120]!r}"
             for path in sorted((ROOT / "nbs").rglob("*.ipynb"))
             for line in path.read_text().splitlines() for match in [outside.search(line)] if match]
    assert not cited, "chapters must stand alone in the repository; bring what they cite into their prose:\n" + "\n".join(cited)
