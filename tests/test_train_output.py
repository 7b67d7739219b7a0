"What `marin-study train` shows a person: progress on a terminal (not in logs), and one clear error with its status."
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time

import pytest

from conftest import BIN, ROOT, command, run

ERROR = "marin-study: error:"


@pytest.mark.parametrize("launcher", ["alone", "torchrun"])
@pytest.mark.parametrize("setting, says", [("train.lr=-1", "train.lr: -1.0 is out of range"),
                                           ("data.out_dir={tmp}/nowhere", f"no meta.json; run `marin-study data pack {ROOT / 'params/tiny.yaml'}` first")])
def test_a_failing_run_says_why_once_and_exits_with_the_status_of_an_error(launcher, setting, says, tmp_path):
    result = run(command(launcher, ROOT / "params/tiny.yaml", tmp_path / "run", setting.format(tmp=tmp_path)),
                 check=False, timeout=300)
    err = result.stderr
    assert err.count(ERROR) == 1 and err.count(says) == 1, err[-3000:]  # once, not once per process
    assert not re.search(r'File ".*marin_study', err), err[-3000:]  # no traceback of the kit's, from any rank
    if launcher == "alone":
        assert result.returncode == 2 and "Traceback" not in err, err[-3000:]
    else:  # torchrun exits 1 whenever a worker fails, and its report gives the worker's own status: 2, an error
        assert result.returncode == 1 and re.search(r"Root Cause.*?exitcode\s*:\s*2\b", err, re.S), err[-3000:]


def on_a_terminal(cmd: list[str], columns: int = 120, timeout: float = 300) -> tuple[int, str]:
    "Run `cmd` with stdout and stderr on a pseudo-terminal `columns` wide: its exit status and all it wrote."
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))  # a new pty is 0 columns wide
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    out, deadline = b"", time.time() + timeout
    try:
        while time.time() < deadline:
            if select.select([leader], [], [], 1)[0]:
                try: chunk = os.read(leader, 1 << 16)
                except OSError: break  # EIO: every process that held the terminal has exited
                if not chunk: break
                out += chunk
        else: proc.kill()
    finally: os.close(leader)
    return proc.wait(timeout=60), out.decode(errors="replace")


def test_progress_shows_on_a_terminal_from_the_first_step_and_not_when_piped(params_file, tmp_path):
    sets = ("train.steps=3", "train.checkpoint_every=0")
    status, shown = on_a_terminal(command("alone", params_file, tmp_path / "tty", *sets))
    assert status == 0, shown[-3000:]
    assert shown.index("starting:") < shown.index("train:"), shown[-3000:]  # said before the start-up, not after it
    bars = re.findall(r"train: +\d+%\|[^|]*\| (\d)/3 \[\d\d:\d\d<[\d:?]+, [^,\]]+, loss=[\d.]+, tok/s=[\d,]+\]", shown)
    assert bars[0] == "1" and bars[-1] == "3", shown[-3000:]  # step/total, elapsed<ETA, rate, loss and tokens/s
    piped = run(command("alone", params_file, tmp_path / "piped", *sets))
    assert "starting:" in piped.stderr and "train:" not in piped.stderr and "\r" not in piped.stderr, piped.stderr
    assert piped.stdout.strip().splitlines()[-1].startswith("step 3: loss")
