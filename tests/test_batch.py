"""Batch inference: a real `marin-study serve` of the tiny export answers, is killed and resumed, and runs as a Slurm
array; a stand-in server plays what a real one does not do on demand (a 500, a hang, dying in the middle)."""
import json
import os
import re
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from conftest import BIN, ROOT, free_port, run
from marin_study.batch import NOT_SENT, BatchError, BatchSettings, run_batch, side_file
from test_launch import wait_for


def write_prompts(path, count: int, extra: str = "") -> list[str]:
    "`count` prompts, every third a chat, then the lines of `extra`; the good ids."
    lines = [json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Tell me about {i}."}]} if i % 3 == 2
                        else {"id": f"p{i}", "prompt": f"Chapter {i}. The river"}) for i in range(count)]
    path.write_text("\n".join(lines) + "\n" + extra)
    return [f"p{i}" for i in range(count)]


def ids_in(out) -> list[str]:
    return [json.loads(line)["id"] for line in out.read_text().splitlines()]


def batch(*args, check=False, **kw):
    "`marin-study batch` with the session server's key in its environment."
    return run([BIN / "marin-study", "batch", *map(str, args)], check=check, env={"MARIN_STUDY_API_KEY": "test-key"}, **kw)


def test_a_batch_refuses_a_file_naming_every_bad_line_answers_each_line_once_and_a_rerun_sends_nothing(server, tiny_export, tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out/answers.jsonl"
    write_prompts(prompts, 6, '{"id": "p1", "prompt": "again"}\nnot json\n{"id": "x", "text": "no prompt"}\n')
    refused = batch(prompts, "--endpoint", server.url, "--out", out, "--max-tokens", 4, "--concurrency", 3)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and not out.parent.exists(), refused.stderr
    assert f"marin-study: error: {prompts}: 3 bad lines" in refused.stderr and f"{prompts}:7: id 'p1' already used on line 2" in refused.stderr
    assert f"{prompts}:8: not valid JSON" in refused.stderr and f"{prompts}:9: give either" in refused.stderr
    good = write_prompts(prompts, 6)  # fixed: the whole file is answered
    result = batch(prompts, "--endpoint", server.url, "--out", out, "--max-tokens", 4, "--concurrency", 3)
    assert result.returncode == 0 and "6 answered now, 0 already there, 0 failed" in result.stdout, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(good)
    assert {r["model"] for r in records} == {str(tiny_export)} and len({r["job"] for r in records}) == 1
    assert all(r["finish_reason"] in ("stop", "length") and 1 <= r["completion_tokens"] <= 4 for r in records)
    summary = json.loads(side_file(out, "summary.json").read_text())
    assert (summary["done"], summary["failed"]) == (6, 0)
    assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in records) and summary["requests_per_s"] > 0
    # the answer is the model's: the same greedy request, sent by hand, gets the same text
    direct = openai.OpenAI(base_url=server.url, api_key="test-key").completions.create(
        model=str(tiny_export), prompt="Chapter 0. The river", max_tokens=4, temperature=0)
    assert next(r for r in records if r["id"] == "p0")["text"] == direct.choices[0].text
    before = out.read_bytes()
    again = run_batch(prompts, server.url, out, BatchSettings(max_tokens=4), api_key="test-key")
    assert (again["done"], again["skipped"], again["failed"]) == (0, 6, 0) and out.read_bytes() == before
    with pytest.raises(BatchError, match="answered HTTP 401 .*; check --api-key or MARIN_STUDY_API_KEY"):
        run_batch(prompts, server.url, out, BatchSettings(max_tokens=4), api_key="wrong-key")
    with pytest.raises(BatchError, match="another model or sampling"):
        run_batch(prompts, server.url, out, BatchSettings(max_tokens=4, temperature=0.7), api_key="test-key")
    assert out.read_bytes() == before


def test_killed_with_sigkill_mid_run_a_rerun_leaves_every_id_exactly_once(server, tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    good = write_prompts(prompts, 40)  # enough that no machine answers them all between two looks at the file
    command = [BIN / "marin-study", "batch", prompts, "--endpoint", server.url, "--out", out, "--max-tokens", 8,
               "--concurrency", 2]
    proc = subprocess.Popen(list(map(str, command)), env={**os.environ, "MARIN_STUDY_API_KEY": "test-key"},
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    end = time.time() + 120
    while not (out.exists() and len(out.read_bytes().splitlines()) >= 2):
        assert proc.poll() is None and time.time() < end, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(out.read_bytes().splitlines())
    assert killed_at < len(good), "the job finished before the kill; give it more to do"
    with open(out, "a") as f: f.write('{"id": "p7", "text": "half a li')  # as a kill in the middle of a write leaves it
    result = batch(*command[2:], check=True)
    assert "Traceback" not in result.stderr
    assert sorted(ids_in(out)) == sorted(good)  # each exactly once, the torn line gone
    summary = json.loads(side_file(out, "summary.json").read_text())
    assert summary["skipped"] + summary["done"] == len(good) and summary["skipped"] >= killed_at - 1


def test_an_unreachable_endpoint_is_one_line_after_the_retries_and_leaves_the_results_untouched(tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    write_prompts(prompts, 3)
    out.write_text('{"id": "p0", "text": "x", "job": "abc"}\n{"id": "p1", "te')  # even its torn tail stays
    url = f"http://127.0.0.1:{free_port()}/v1"
    result = batch(prompts, "--endpoint", url, "--out", out, "--retries", 2)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"marin-study: error: {url}: no answer after 3 tries (All connection attempts failed); check that the server is "
        "running and that the URL names its host, port and /v1"]
    assert out.read_text() == '{"id": "p0", "text": "x", "job": "abc"}\n{"id": "p1", "te'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answers.jsonl", "prompts.jsonl"]


class StandIn(ThreadingHTTPServer):
    """An OpenAI-shaped server for failures on demand: 'flaky' gets a 500 the first time, 'hang' no answer for 3 s,
    'refused' a 400, 'die' a dropped connection and a closed port. Once `healed`, it answers every prompt."""
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), StandInHandler)
        self.seen, self.healed = [], False
        self.url = f"http://127.0.0.1:{self.server_address[1]}/v1"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self):
        self.shutdown()
        self.server_close()


class StandInHandler(BaseHTTPRequestHandler):
    def log_message(self, *args): pass

    def reply(self, status: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply(200, {"object": "list", "data": [{"id": "stand-in", "object": "model", "created": 0, "owned_by": "t"}]})

    def do_POST(self):
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        server = self.server
        server.seen.append(prompt)
        if prompt == "die" and not server.healed:
            server.close()  # the port closes; this request ends without an answer
            self.close_connection = True
            return
        if not server.healed and (prompt == "refused" or prompt == "flaky" and server.seen.count("flaky") == 1):
            return self.reply(400 if prompt == "refused" else 500, {"error": {"message": f"no {prompt}", "type": "x"}})
        if prompt == "hang" and not server.healed: time.sleep(3)
        self.reply(200, {"id": "c", "object": "text_completion", "created": 0, "model": "stand-in",
                         "choices": [{"index": 0, "text": prompt.upper(), "finish_reason": "length", "logprobs": None}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}})


def stand_in_prompts(path, prompts: list[str]):
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))


def test_a_500_is_retried_a_hang_times_out_and_failures_are_retried_by_the_rerun_never_duplicated(tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    stand_in_prompts(prompts, ["a", "flaky", "hang", "refused", "b"])
    server = StandIn()
    try:
        first = run_batch(prompts, server.url, out, timeout=1, retries=1, concurrency=5)
        assert server.seen.count("flaky") == 2 and server.seen.count("hang") == 2 and server.seen.count("refused") == 1
        assert sorted(ids_in(out)) == [0, 1, 4] and (first["done"], first["failed"]) == (3, 2)
        assert first["failed_by_reason"] == {"no answer within 1 s (2 tries)": 1, "HTTP 400": 1}
        failed = [json.loads(line) for line in side_file(out, "failed.jsonl").read_text().splitlines()]
        assert sorted((f["id"], f["line"]) for f in failed) == [(2, 3), (3, 4)] and "no refused" in str(failed)
        server.healed = True
        again = run_batch(prompts, server.url, out, timeout=1, retries=1)
        assert (again["done"], again["skipped"], again["failed"]) == (2, 3, 0)
        assert sorted(ids_in(out)) == [0, 1, 2, 3, 4] and not side_file(out, "failed.jsonl").exists()
        assert json.loads(out.read_text().splitlines()[-1])["text"] in ("HANG", "REFUSED")
    finally: server.close()


def test_an_endpoint_that_dies_mid_run_is_not_sent_the_rest_and_a_rerun_finishes(tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    stand_in_prompts(prompts, ["a", "b", "die", "c", "d", "e"])
    server = StandIn()
    try: summary = run_batch(prompts, server.url, out, retries=1, concurrency=1)
    finally: server.close()
    assert server.seen == ["a", "b", "die"] and ids_in(out) == [0, 1]  # nothing after the endpoint went away
    assert summary["failed_by_reason"] == {"connection failed (2 tries)": 1, NOT_SENT: 3}
    server = StandIn()  # back, on another port: the same job
    try:
        server.healed = True
        again = run_batch(prompts, server.url, out, retries=1)
        assert (again["done"], again["skipped"]) == (4, 2) and sorted(ids_in(out)) == [0, 1, 2, 3, 4, 5]  # each once, in the order answered
    finally: server.close()


def test_the_slurm_dry_run_prints_a_valid_array_script_and_writes_nothing(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 3)
    result = batch(prompts, "--endpoint", "http://gpu-7:8000/v1", "--out", tmp_path / "answers.jsonl", "--slurm", 3,
                   "--temperature", 0.5, "--seed", 1, "--dry-run", check=True)
    script = result.stdout
    assert "#SBATCH --array=0-2\n" in script and "test-key" not in script
    assert script.rstrip().endswith("--temperature 0.5 --top-p 1.0 --seed 1 --shard $SLURM_ARRAY_TASK_ID/3")
    (tmp_path / "script.sh").write_text(script)
    run(["bash", "-n", tmp_path / "script.sh"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl", "script.sh"]


def test_a_slurm_array_of_three_shards_and_its_merge_answer_each_id_once(slurm, server, tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    good = write_prompts(prompts, 10)
    result = batch(prompts, "--endpoint", server.url, "--out", out, "--slurm", 3, "--max-tokens", 4, check=True)
    array, merge = re.search(r"submitted array (\d+) and merge job (\d+)", result.stdout).groups()
    logs = side_file(out, "slurm")
    assert wait_for(merge) == "COMPLETED", "\n".join(p.read_text() for p in logs.glob("*.out"))
    assert wait_for(array) == "COMPLETED"
    shards = sorted(p.name for p in tmp_path.glob("answers.shard-*-of-003.jsonl"))
    assert shards == [f"answers.shard-00{k}-of-003.jsonl" for k in range(3)]
    assert sorted(ids_in(tmp_path / shards[1])) == ["p1", "p4", "p7"]  # lines 2, 5 and 8
    assert sorted(ids_in(out)) == sorted(good)
    summary = json.loads(side_file(out, "summary.json").read_text())
    assert (summary["merged"], summary["done"], summary["failed"]) == (10, 0, 0)
    assert "10 merged from shard files" in next(logs.glob("merge-*.out")).read_text()
