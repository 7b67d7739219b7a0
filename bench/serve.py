"""The server's batching against one sequence at a time, side by side in one script, on the tiny study's export.

Two `marin-study serve` processes of the same export (`dvc repro export` built it): `--max-batch 16`, where
concurrent requests with the same sampling share one generate() call, and `--max-batch 1`, where each waits for the
one before. The same batch job (`run_batch`: held-out openings, greedy, `--max-tokens` new tokens each,
`--concurrency` in flight) goes through each, `--rounds` times, alternating; the best round of each counts. Ends with
`ratio: X`, batched completion tokens/s over one-at-a-time completion tokens/s, after how many answers agree
(greedy, so all should, up to rounding in a padded batch).
"""
import argparse
import itertools
import json
import tempfile
from pathlib import Path

from marin_study.batch import BatchSettings, run_batch
from marin_study.data.corpus import read_jsonl
from marin_study.serve import ServerProcess
from marin_study.utils import write_jsonl

ROOT = Path(__file__).resolve().parents[1]


def prompts_file(clean: Path, count: int, folder: Path) -> Path:
    "Openings of held-out documents, every domain in turn (a domain with fewer documents drops out)."
    domains = [list(read_jsonl(path)) for path in sorted((clean / "heldout").glob("*.jsonl"))]
    docs = [doc for turn in itertools.zip_longest(*domains) for doc in turn if doc is not None]
    lines = [{"id": f"p{i}", "prompt": " ".join(docs[i % len(docs)]["text"].split(" ")[:12])} for i in range(count)]
    return write_jsonl(folder / "prompts.jsonl", lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", default=str(ROOT / "runs/tiny/export"))
    ap.add_argument("--clean", default=str(ROOT / "runs/data/clean"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts = prompts_file(Path(args.clean), args.prompts, work)
        best, answers = {}, {}
        servers = {"batched": ServerProcess(args.export, work / "batched.log", "--max-batch", "16"),
                   "one at a time": ServerProcess(args.export, work / "single.log", "--max-batch", "1")}
        try:
            for r in range(args.rounds):
                for name, server in servers.items():
                    out = work / f"{name}-{r}.jsonl"
                    summary = run_batch(prompts, server.url, out, BatchSettings(max_tokens=args.max_tokens),
                                        concurrency=args.concurrency)
                    assert summary["done"] == args.prompts and not summary["failed"], summary
                    best[name] = max(best.get(name, 0), summary["completion_tokens_per_s"])
                    answers[name] = {json.loads(l)["id"]: json.loads(l)["text"] for l in out.read_text().splitlines()}
                    print(f"round {r + 1}, {name}: {summary['requests_per_s']:.2f} requests/s, "
                          f"{summary['completion_tokens_per_s']:.1f} completion tokens/s")
        finally:
            for server in servers.values(): server.stop()
        same = sum(answers["batched"][k] == answers["one at a time"][k] for k in answers["batched"])
        print(f"{same} of {args.prompts} answers equal between the two servers")
        print(f"ratio: {best['batched'] / best['one at a time']:.2f}")


if __name__ == "__main__":
    main()
