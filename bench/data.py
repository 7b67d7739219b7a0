"""Data pipeline speed, side by side in one process, on the corpus `dvc repro pack` built (runs/data).

1. tokenize+pack (read the cleaned JSON lines, encode in parallel batches, append end tokens, write the shards)
   against the bare `tokenizers` batch encoding of the same texts: the library is the limit, target >= 0.8x;
2. loader samples per second against what the tiny training run consumes (its forward+backward+AdamW step on one
   global batch, measured here): target >= 50x;
3. MinHash + LSH near-dedup, documents per second.

Ends with `ratio: X`, tokenize+pack throughput over raw batch encoding.
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from datasketch import MinHashLSH

from marin_study.config import load_params
from marin_study.data.clean import minhash
from marin_study.data.corpus import read_jsonl
from marin_study.data.mixture import make_loader
from marin_study.data.tokens import clean_files, load_tokenizer, pack_split, token_dtype
from marin_study.model import Transformer

ROOT = Path(__file__).resolve().parents[1]


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default=str(ROOT / "params/tiny.yaml"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out-dir", help="the data pipeline's output folder (default: the params' data.out_dir)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a params key")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = load_params(args.params, args.set)
    out = Path(args.out_dir or params.data.out_dir)
    if not out.is_absolute(): out = ROOT / out
    clean = out / "clean"
    tokenizer = load_tokenizer(out / "tokenizer.json")
    texts = [d["text"] for p in clean_files(clean, "train").values() for d in read_jsonl(p)]
    size = sum(len(t.encode()) for t in texts)
    print(f"corpus: {len(texts):,} training documents, {size / 1e6:.1f} MB; {args.threads} threads; median of {args.repeats}")

    raw = best_of(lambda: [tokenizer.encode_batch(texts[i:i + 512]) for i in range(0, len(texts), 512)], args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        ours = best_of(lambda: pack_split(clean, tokenizer, tmp, "train", token_dtype(tokenizer.get_vocab_size())), args.repeats)
    print(f"tokenize+pack {size / ours / 1e6:6.2f} MB/s   raw encode_batch {size / raw / 1e6:6.2f} MB/s   "
          f"ours/raw {raw / ours:.2f}x (target >= 0.8)")

    t = params.train
    params.data.out_dir = str(out)
    loader = make_loader(params)
    start, samples = time.perf_counter(), 0
    for k, batch in enumerate(loader):
        samples += len(batch)
        if samples >= 4000: break
    loader_rate = samples / (time.perf_counter() - start)
    model = Transformer(params.model)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr)
    batch = next(iter(make_loader(params)))
    def train_step():
        for _ in range(t.global_batch // t.micro_batch):
            model(batch[:, :-1], batch[:, 1:]).loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
    train_step()
    step = best_of(train_step, args.repeats)
    consumed = t.global_batch / step
    print(f"loader {loader_rate:9,.0f} samples/s   tiny training consumes {consumed:6,.1f} samples/s   "
          f"ratio {loader_rate / consumed:,.0f}x (target >= 50)")

    docs = texts[:3000]
    def dedup():
        lsh = MinHashLSH(threshold=params.data.dedup_threshold, num_perm=params.data.dedup_num_perm)
        for i, text in enumerate(docs):
            signature = minhash(text, params.data)
            if not lsh.query(signature): lsh.insert(str(i), signature)
    seconds = best_of(dedup, 1)
    print(f"MinHash+LSH dedup {len(docs) / seconds:,.0f} documents/s ({sum(len(d) for d in docs) / seconds / 1e6:.1f} MB/s)")
    print(f"ratio: {raw / ours:.2f}")


if __name__ == "__main__":
    main()
