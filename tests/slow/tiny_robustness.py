"""The tiny study under perturbation: seeds x (the corpus as built here, the same corpus less a random 2% of its
documents). Each run is the real study notebook (nbs/studies/train_tiny.ipynb, with its own asserts: stop half-way,
reload, continue, loss and bits per byte fall, at most an isolated skipped step in 200) under papermill, followed by
the loss report's findings, which must have no warning or error beyond those conftest.unexpected_in_tiny expects.
Prints one row per run and the spread of the final numbers, and
writes every run's loss and gradient-norm sequence to tests/data/tiny_healthy_runs.json, which
tests/test_optim.py replays through the bad-step guard.

    python tests/slow/tiny_robustness.py                       # 4 seeds x 2 corpora, about 80 minutes on 2 cores
    python tests/slow/tiny_robustness.py --seeds 0 --corpora here
"""
import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from conftest import unexpected_in_tiny
from marin_study.analysis import diagnose, load_curves
from marin_study.config import load_params
from marin_study.data.corpus import read_jsonl
from marin_study.utils import atomic_write, write_jsonl
from marin_study.studies import run_study

PARAMS = "params/tiny.yaml"
SEQUENCES = ROOT / "tests/data/tiny_healthy_runs.json"


def drop_documents(source: Path, dest: Path, fraction: float, seed: int) -> None:
    "A copy of the raw corpus without a random `fraction` of the documents of every file."
    rng = random.Random(seed)
    shutil.rmtree(dest, ignore_errors=True)
    for path in sorted(source.rglob("*.jsonl")):
        kept = [d for d in read_jsonl(path) if rng.random() >= fraction]
        write_jsonl(dest / path.relative_to(source), kept)
    shutil.copy(source / "SOURCES.json", dest / "SOURCES.json")


def build_data(data_dir: Path, out_dir: Path) -> list[str]:
    "clean, tokenizer and pack of the tiny preset on `data_dir`; the overrides that point a run at the result."
    overrides = [f"data.dir={data_dir}", f"data.out_dir={out_dir}"]
    if not (out_dir / "shards").exists():
        for stage in ("clean", "tokenizer", "pack"):
            sets = [a for o in overrides for a in ("--set", o)]
            subprocess.run([str(Path(sys.executable).parent / "marin-study"), "data", stage, PARAMS, *sets],
                           cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return overrides


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--corpora", nargs="+", default=["here", "drop2pct"], choices=["here", "drop2pct"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/tiny-robustness"))
    args = ap.parse_args()
    data = ROOT / load_params(ROOT / PARAMS).data.dir
    corpora = {}
    for corpus in args.corpora:
        raw = data
        if corpus == "drop2pct":
            raw = args.work / "data-drop2pct"
            if not raw.exists(): drop_documents(data, raw, 0.02, seed=0)
        corpora[corpus] = build_data(raw, args.work / corpus / "data")
    rows, sequences, failures = [], {}, []
    for seed in args.seeds:
        for corpus, data_overrides in corpora.items():
            name, out = f"{corpus}-seed{seed}", args.work / f"{corpus}-seed{seed}"
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            row = {"run": name}
            try:
                run_study(ROOT / "nbs/studies/train_tiny.ipynb", out / "train_tiny.ipynb", cwd=ROOT, parameters={
                    "params_path": PARAMS, "overrides": data_overrides + [f"train.seed={seed}", f"data.seed={seed}"],
                    "runs_root": str(out / "run"), "summary_json": str(out / "summary.json"),
                    "loss_plot": str(out / "loss.png"), "metrics_copy": str(out / "metrics.jsonl"),
                    "curve_csv": str(out / "curve.csv"), "run_card_copy": str(out / "run_card.json")})
            except Exception as e:  # a failed study is a result here: report it with the others
                failures.append(f"{name}: {e}")
                rows.append({**row, "status": "study failed"})
                continue
            summary = json.loads((out / "summary.json").read_text())
            curves = load_curves(out / "metrics.jsonl")
            findings = diagnose(curves, vocab_size=load_params(ROOT / PARAMS).model.vocab_size)
            bad = unexpected_in_tiny(findings)
            failures += [f"{name}: {f}" for f in bad]
            skipped = curves["skipped"].eq(True) if "skipped" in curves else curves["step"] < 0
            sequences[name] = {"loss": [round(v, 6) for v in curves["loss"]],
                               "grad_norm": [round(v, 6) for v in curves["grad_norm"]],
                               "skipped": [int(s) for s in curves.loc[skipped, "step"]]}
            rows.append({**row, "status": "ok" if not bad else "report warns",
                         "final_train_loss_last20_mean": summary["final_train_loss_last20_mean"],
                         "heldout_sample_bpb": summary["heldout_sample_bpb"],
                         "max_grad_norm_after_50": float(curves["grad_norm"][curves["step"] > 50].max()),
                         "late_max_load": float(curves["moe/max_load"][curves["step"] > 150].median()),
                         "skipped": " ".join(map(str, sequences[name]["skipped"])) or "-",
                         "minutes": (time.perf_counter() - start) / 60})
            print(pd.DataFrame(rows[-1:]).to_string(index=False, header=len(rows) == 1), flush=True)
    table = pd.DataFrame(rows)
    print("\n" + table.round(4).to_string(index=False))
    ok = table[table["status"] == "ok"]
    for column in ("final_train_loss_last20_mean", "heldout_sample_bpb"):
        if len(ok): print(f"{column}: mean {ok[column].mean():.4f}, std {ok[column].std():.4f}, "
                          f"range {ok[column].min():.4f}-{ok[column].max():.4f} over {len(ok)} runs")
    if sequences and args.seeds == [0, 1, 2, 3] and len(args.corpora) == 2:
        atomic_write(SEQUENCES, json.dumps(sequences, separators=(",", ":")) + "\n")
        print(f"guard sequences of {len(sequences)} runs in {SEQUENCES.relative_to(ROOT)}")
    for failure in failures: print("FAIL", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
