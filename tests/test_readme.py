"README.md starts with exactly three commands, and CI runs all three as written."
import re
import subprocess

from conftest import ROOT


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
