"README.md's first block holds exactly two commands, CI runs both as written, every documented command parses, and nbdev cannot overwrite the README."
import configparser
import os
import re
import shutil
import shlex
import subprocess
import textwrap

from conftest import BIN, ROOT, run


def readme_commands():
    text = (ROOT / "README.md").read_text()
    block = re.match(r"# marin-study\n\n(?:[^`\n][^\n]*\n){1,4}\n```bash\n(.*?)\n```", text, re.S)
    assert block, "README.md must start with its title, at most 4 lines on what the kit is, and one bash block of commands"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines()]


def test_readme_starts_with_two_commands_each_setting_up_first():
    main_job, tests = readme_commands()
    assert (ROOT / "install.sh").stat().st_mode & 0o111
    assert main_job.startswith("./install.sh && ") and main_job.endswith("dvc repro")
    assert tests.startswith("./install.sh && ") and tests.endswith("python -m pytest")


def test_the_readme_fits_its_start_on_a_screen_and_links_what_exists():
    text = (ROOT / "README.md").read_text()
    prose = [p for p in re.sub(r"```.*?```", "", text, flags=re.S).split("\n\n") if not p.startswith("- ")]
    assert len(text.split()) < 1500 and max(p.count("\n") for p in prose) < 8  # no wall of text
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        assert (ROOT / target).exists(), f"README.md links {target}, which does not exist"
    assert "reports/index.html" in text  # what to open when the main job ends


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


def readme_commands_after_the_first_block() -> list[str]:
    """Every command in the bash and console blocks of README.md after its first (.ci/run's) and of docs/*.md, as
    written, comments dropped."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [b for k, page in enumerate(pages)
              for b in re.findall(r"^```(bash|console)\n(.*?)^```", page.read_text(), re.S | re.M)[(1 if k == 0 else 0):]]
    lines = [l.removeprefix("$ ") for kind, body in blocks for l in body.splitlines()
             if l.strip() and (kind == "bash" or l.startswith("$ "))]
    return [shlex.join(shlex.split(l, comments=True)) for l in lines]


def marin_study_part(command: str) -> list[str] | None:
    "The arguments given to marin-study in a command (itself, or under torchrun, accelerate, deepspeed), or None."
    words = shlex.split(command)
    words = words[:-1] if words[-1:] == ["&"] else words  # a server started in the background
    return words[words.index("marin-study") + 1:] if "marin-study" in words else None


CHEAP = ("plan ", "launch slurm ", "params show ")  # seconds each: these run as written


def test_every_readme_command_parses_and_the_cheap_ones_run_as_written(tmp_path):
    from marin_study.cli import parser
    commands = readme_commands_after_the_first_block()
    kit = [(c, marin_study_part(c)) for c in commands if marin_study_part(c) is not None]
    assert len(kit) >= 25, kit
    for command, args in kit:  # every flag, choice and type the README uses exists: argparse exits 2 on any other
        parsed = parser().parse_args(args)
        assert callable(parsed.run), command
    ran = 0
    for command, args in kit:
        if not " ".join(args).startswith(CHEAP): continue
        args = [str(tmp_path / "plan") if a == "runs/plan" else a for a in args]  # the test writes nothing in the clone
        submit = args[:2] == ["launch", "slurm"] and "--dry-run" not in args
        done = run([BIN / "marin-study", *args, *(["--dry-run"] if submit else [])], check=False)
        if args[0] == "params" and "top_k=40" in command:  # the README shows this one's refusal, word for word
            assert done.returncode == 2 and "model.top_k: 40 is not between 1 and n_experts (32)" in done.stderr
        else:
            assert done.returncode == 0 and "Traceback" not in done.stderr, (command, done.stderr[-2000:])
            if args[:2] == ["launch", "slurm"]: assert done.stdout.startswith("#!/bin/bash") and "srun" in done.stdout
        ran += 1
    assert ran >= 5 and (tmp_path / "plan/deepspeed.json").is_file()
    others = [c for c in commands if marin_study_part(c) is None]
    assert {shlex.split(c)[0] for c in others} <= {"dvc", "curl", "kill"}, others  # dvc's: the next test; the tour: test_studies


def test_the_readmes_dvc_experiment_overrides_run_as_written_and_leave_the_params_file_alone(tmp_path):
    "README's `dvc exp run --temp -S ...` lines, on a scratch DVC repository with the kit's tiny params and one stage."
    experiments = [c for c in readme_commands_after_the_first_block() if c.startswith("dvc exp run")]
    assert len(experiments) == 2 and all("--temp" in c for c in experiments)
    (tmp_path / "params").mkdir()
    shutil.copy(ROOT / "params/tiny.yaml", tmp_path / "params/tiny.yaml")
    (tmp_path / "dvc.yaml").write_text(textwrap.dedent("""\
        stages:
          ladder:
            cmd: python -c "import yaml; t = yaml.safe_load(open('params/tiny.yaml'))['train']; print(t['lr'], t.get('spike_sigmas'), file=open('seen.txt', 'w'))"
            params: [{params/tiny.yaml: [train]}]
            outs: [seen.txt]
        """))
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "scratch"]):
        run(cmd, cwd=tmp_path)
    before = (tmp_path / "params/tiny.yaml").read_bytes()
    for command in experiments:
        run(shlex.split(command), cwd=tmp_path)
        assert (tmp_path / "params/tiny.yaml").read_bytes() == before, command  # the workspace's file, untouched
    shown = run(["dvc", "exp", "show", "--json"], cwd=tmp_path).stdout
    assert "0.0003" in shown and "8.0" in shown  # each experiment ran with its override


def dvc_outputs() -> list[str]:
    "Every output path of dvc.yaml's stages, with ${...} filled from params/tiny.yaml as DVC fills them."
    import yaml
    stages, tiny = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"], yaml.safe_load((ROOT / "params/tiny.yaml").read_text())
    fill = lambda text: re.sub(r"\$\{([\w.]+)\}", lambda m: str(eval_dotted(tiny, m.group(1))), text)
    return [fill(next(iter(o)) if isinstance(o, dict) else o) for s in stages.values() for o in s.get("outs", [])]


def eval_dotted(tree: dict, dotted: str):
    for key in dotted.split("."): tree = tree[key]
    return tree


def test_no_documented_command_writes_into_a_dvc_output():
    "A command from README.md or docs/ that wrote into a stage's output would make `dvc status` call the pipeline stale."
    outputs = dvc_outputs()
    assert "runs/tiny/export" in outputs and "runs/data/clean" in outputs
    inside = lambda path: any(path == o or path.startswith(o.rstrip("/") + "/") for o in outputs)
    writes = {"--out", "--output", "--run-dir", "--report"}
    found = [(command, words[k + 1]) for command in readme_commands_after_the_first_block()
             if (words := marin_study_part(command)) and words[0] not in ("study",)  # `study run` is how stages run
             for k, word in enumerate(words[:-1]) if word in writes and inside(words[k + 1].replace("<hash>", "x"))]
    assert not found, found
