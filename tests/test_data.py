"The data pipeline on real text: cleaning, dedup, held-out split, tokenizer, shards, mixture and loader."
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, run, small_corpus, tree_hashes
from marin_study.config import ConfigError, MixturePhase, load_params
from marin_study.data.clean import clean_corpus, contamination, first_failed_filter, normalize, quality_stats
from marin_study.data.corpus import DataError, read_jsonl
from marin_study.data.mixture import BLOCK, Feistel, Mixture, StepSampler, make_loader
from marin_study.data.tokens import EOD, Shard, bytes_per_token, load_tokenizer, token_dtype
from marin_study.utils import write_jsonl

PARAMS = load_params(ROOT / "params/tiny.yaml")


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_bad_jsonl_is_a_clear_error_with_file_and_line(tmp_path):
    good = json.dumps({"id": "a", "domain": "web", "source": "s", "license": "x", "group": "a", "text": "hi"}).encode()
    cases = {
        b"": "the file is empty",
        good + b"\n{not json\n": ":2: not valid JSON",
        good + b"\n" + good.replace(b"hi", b"\xff\xfe") + b"\n": ":2: invalid UTF-8",
        b"{\"id\": \"a\", \"text\": \"x\"}\n": ":1: document lacks domain, source, license",
    }
    for number, (data, words) in enumerate(cases.items()):
        path = write(tmp_path / f"f{number}.jsonl", data)
        with pytest.raises(DataError, match=words) as info:
            list(read_jsonl(path))
        assert str(path) in str(info.value)


def test_normalize_and_filters():
    assert normalize("a\u0301\r\nb\x00c   \n\n\n\nd") == "\u00e1\nbc\n\nd"
    stats = quality_stats("word " * 10)
    assert stats["words"] == 10 and stats["dup_line_fraction"] == 0
    limits = PARAMS.data.filters
    assert first_failed_filter(quality_stats("# # # # # # code words here"), limits) == "max_symbol_ratio"
    code_limits = {**limits, **PARAMS.data.filter_overrides["code"]}
    code = "total = count  # running total\nvalue = other  # the value\nresult = total + value  # summed"
    assert first_failed_filter(quality_stats(code), limits) == "max_symbol_ratio"
    assert first_failed_filter(quality_stats(code), code_limits) is None
    repeated = "\n".join(["the same line of text here"] * 20)
    assert first_failed_filter(quality_stats(repeated), limits) == "max_dup_line_fraction"


def test_clean_report_counts_every_document(pipeline):
    raw = sum(1 for p in pipeline["raw"].glob("*/*.jsonl") for _ in read_jsonl(p))
    report = pipeline["report"]
    assert sum(c["raw_docs"] for c in report.values()) == raw
    accounted = sum(v for c in report.values() for k, v in c.items() if k.endswith("_docs") and k != "raw_docs")
    assert accounted == raw, "every document is kept, held out, filtered or deduplicated, exactly once"
    assert all(c.get("heldout_docs", 0) > 0 for c in report.values()), "every domain has a held-out slice"


def test_first_folio_twin_is_removed_as_a_near_duplicate(pipeline):
    out = pipeline["root"] / "out/clean"
    ids = {d["id"] for p in out.glob("*/*.jsonl") for d in read_jsonl(p)}
    lear = {"shakespeare/lear_gut.txt", "shakespeare/lear_gut_f.txt"}
    assert len(ids & lear) == 1, "exactly one of King Lear and its First Folio survives"
    assert "shakespeare/hamlet_gut.txt" in ids
    assert pipeline["report"]["books"]["dedup:near_docs"] >= 1


def test_no_training_document_duplicates_a_heldout_one(pipeline):
    cfg = pipeline["params"].data
    assert contamination(pipeline["root"] / "out/clean", cfg) == []


def test_contamination_check_finds_a_planted_leak(pipeline, tmp_path):
    import shutil
    leaky = tmp_path / "clean"
    shutil.copytree(pipeline["root"] / "out/clean", leaky)
    heldout = next(read_jsonl(next(leaky.glob("heldout/*.jsonl"))))
    planted = {**heldout, "id": "planted", "text": heldout["text"] + " (lightly edited)"}
    with open(leaky / "train/web.jsonl", "a") as f: f.write(json.dumps(planted) + "\n")
    found = contamination(leaky, pipeline["params"].data)
    assert ("near", "planted", heldout["id"]) in found


def test_heldout_split_is_stable_and_by_group(pipeline):
    out = pipeline["root"] / "out/clean"
    train_groups = {d["group"] for p in out.glob("train/*.jsonl") for d in read_jsonl(p)}
    held_groups = {d["group"] for p in out.glob("heldout/*.jsonl") for d in read_jsonl(p)}
    assert not train_groups & held_groups
    again = clean_corpus(pipeline["raw"], pipeline["root"] / "again", pipeline["params"].data)
    assert again == pipeline["report"]
    for split in ("train", "heldout"):
        for path in out.glob(f"{split}/*.jsonl"):
            assert (pipeline["root"] / "again" / split / path.name).read_bytes() == path.read_bytes()


def test_tokenizer_round_trips_every_domain_and_reports_compression(pipeline):
    tokenizer = pipeline["tokenizer"]
    for path in (pipeline["root"] / "out/clean").glob("*/*.jsonl"):
        for doc in read_jsonl(path):
            assert tokenizer.decode(tokenizer.encode(doc["text"]).ids, skip_special_tokens=False) == doc["text"], doc["id"]
    ratio = bytes_per_token(tokenizer, pipeline["root"] / "out/clean")
    assert set(ratio) == {"books", "chat", "code", "docs", "math", "quotes", "web"}
    assert all(1.5 < r < 6 for r in ratio.values()), ratio


def test_shards_hold_each_document_then_the_end_token(pipeline):
    tokenizer, folder = pipeline["tokenizer"], pipeline["root"] / "out/shards/train"
    shard = Shard(folder, "web")
    assert isinstance(shard.tokens, np.memmap) and shard.tokens.dtype == np.uint16
    docs = list(read_jsonl(pipeline["root"] / "out/clean/train/web.jsonl"))
    assert len(shard.offsets) == len(docs) + 1 and shard.offsets[-1] == len(shard)
    for k in (0, len(docs) - 1):
        ids = shard.document(k)
        assert ids[-1] == tokenizer.token_to_id(EOD)
        assert tokenizer.decode(ids[:-1].tolist()) == docs[k]["text"]
    assert not list(folder.glob("*.tmp")) and not list(folder.glob(".*"))


def test_token_dtype_refuses_a_vocab_that_does_not_fit():
    assert token_dtype(8192) == np.uint16 and token_dtype(128256) == np.uint32
    with pytest.raises(DataError, match="data.token_dtype: a vocabulary of 128,256 ids does not fit uint16"):
        token_dtype(128256, "uint16")


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 1025, 4096])
def test_feistel_is_a_bijection(n):
    perm = Feistel(n, "test")
    assert sorted(perm(i) for i in range(n)) == list(range(n))
    if n >= 1000:
        assert [perm(i) for i in range(20)] != [Feistel(n, "other")(i) for i in range(20)]
        assert [perm(i) for i in range(20)] != list(range(20))


def mixture(pipeline, **data_changes):
    p = pipeline["params"]
    data = dataclasses.replace(p.data, **{"max_epochs": 1000.0, **data_changes})  # the small corpus repeats a lot
    return Mixture(data, Path(data.out_dir) / "shards/train", 64, 16)


def test_realised_mixture_matches_the_weights_within_one_percent(pipeline):
    mix = mixture(pipeline)
    window = 5 * BLOCK + 333
    counts = Counter(mix.locate(i)[0] for i in range(10_000, 10_000 + window))
    total = sum(PARAMS.data.mixture.values())
    for domain, weight in PARAMS.data.mixture.items():
        assert abs(counts[domain] / window - weight / total) < 0.01, domain


def test_sample_is_a_pure_function_of_seed_mixture_and_index(pipeline):
    a, b = mixture(pipeline), mixture(pipeline)
    indices = [0, 1, 17, 1023, 1024, 5000, 12345]
    assert [a.locate(i) for i in indices] == [b.locate(i) for i in reversed(indices)][::-1]
    other = mixture(pipeline, seed=1)
    assert [a.locate(i) for i in range(50)] != [other.locate(i) for i in range(50)]


def test_an_epoch_of_a_domain_neither_repeats_nor_skips_a_window(pipeline):
    mix = mixture(pipeline, mixture={"web": 1.0}, max_epochs=2)
    n = mix.windows["web"]
    starts = [mix.locate(i)[1] for i in range(n)]
    assert sorted(starts) == [64 * j for j in range(n)]
    assert sorted(mix.locate(i)[1] for i in range(n, 2 * n)) == sorted(starts)
    with pytest.raises(DataError, match="past data.max_epochs"):
        mix.locate(2 * n)


def test_epoch_cap_names_the_domain(pipeline):
    mix = mixture(pipeline, max_epochs=8.0)
    with pytest.raises(DataError, match=r"domain '\w+' would be repeated .* more than data.max_epochs = 8"):
        mix.check_epochs(10_000_000)


def test_unknown_domain_in_the_mixture_is_named(pipeline):
    with pytest.raises(DataError, match="no shard for domain 'poetry'"):
        mixture(pipeline, mixture={"web": 1.0, "poetry": 1.0})


def test_phases_switch_weights_and_carry_counts_over(pipeline):
    phases = [MixturePhase(0, {"web": 1.0}), MixturePhase(10, {"web": 1.0, "code": 1.0})]
    mix = mixture(pipeline, mixture=phases, max_epochs=100)
    assert {mix.locate(i)[0] for i in range(160)} == {"web"}
    later = Counter(mix.locate(i)[0] for i in range(160, 160 + 2 * BLOCK))
    assert abs(later["code"] / (2 * BLOCK) - 0.5) < 0.01
    web = [mix.locate(i)[1] for i in range(160 + 2 * BLOCK) if mix.locate(i)[0] == "web"]
    n = mix.windows["web"]
    assert len(set(web[:n])) == min(n, len(web)), "a phase change repeats no window of the running epoch"


def test_loader_resumes_and_is_independent_of_world_size(pipeline):
    params = dataclasses.replace(pipeline["params"], train=dataclasses.replace(PARAMS.train, steps=6, global_batch=8,
                                                                              micro_batch=2))
    full = torch.cat(list(make_loader(params)))
    assert full.shape == (6 * 8, 257)
    resumed = torch.cat(list(make_loader(params, start_step=3)))
    assert torch.equal(resumed, full[3 * 8:])
    ranks = [list(make_loader(params, rank=r, world_size=2)) for r in (0, 1)]
    per_step = [torch.cat([torch.cat(ranks[0][2 * s:2 * s + 2]), torch.cat(ranks[1][2 * s:2 * s + 2])]) for s in range(6)]
    assert torch.equal(torch.cat(per_step), full)
    assert list(StepSampler(8, 6, rank=1, world_size=2, start_step=5)) == [44, 45, 46, 47]


@pytest.mark.parametrize("start_step", [0, 3])
def test_the_loader_gives_the_same_batches_for_any_num_workers(pipeline, start_step):
    params = dataclasses.replace(pipeline["params"], train=dataclasses.replace(PARAMS.train, steps=6, global_batch=8,
                                                                              micro_batch=2))
    def first_batches(workers: int, n: int = 8) -> list:
        loader = make_loader(dataclasses.replace(params, data=dataclasses.replace(params.data, num_workers=workers)),
                             start_step=start_step)
        assert loader.num_workers == workers  # the trainer's call, make_loader(params, rank, world_size, start_step)
        return [batch for batch, _ in zip(loader, range(n))]
    alone = first_batches(0)
    assert len(alone) == 8 and alone[0].shape == (2, 257)
    for workers in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(alone, first_batches(workers), strict=True)), workers
    assert make_loader(params, workers=2).num_workers == 2  # an explicit count wins over data.num_workers


def test_mixture_params_validate():
    with pytest.raises(ConfigError, match="first phase must start at step 0"):
        load_params(ROOT / "params/tiny.yaml", ["data.mixture=[{start_step: 5, weights: {web: 1}}]"])
    with pytest.raises(ConfigError, match="has no positive weight"):
        load_params(ROOT / "params/tiny.yaml", ["data.mixture=[{start_step: 0, weights: {web: 0}}]"])
    p = load_params(ROOT / "params/tiny.yaml", ["data.mixture=[{start_step: 0, weights: {web: 1}}, {start_step: 9, weights: {code: 2}}]"])
    assert p.data.phases[1] == MixturePhase(9, {"code": 2.0})


def test_data_check_command(pipeline, tmp_path):
    p = pipeline["params"]
    out = run(["marin-study", "data", "check", str(ROOT / "params/tiny.yaml"), "--set", f"data.out_dir={p.data.out_dir}",
               "--set", "train.steps=20", "--set", "data.max_epochs=1000"]).stdout
    assert "micro-batch: (8, 257)" in out and "realised" in out and "samples/s" in out
    for domain in PARAMS.data.mixture: assert f"[{domain}]" in out
    bad = run(["marin-study", "data", "check", str(ROOT / "params/tiny.yaml"), "--set", f"data.out_dir={tmp_path}"], check=False)
    assert bad.returncode == 2 and f"run `marin-study data pack {ROOT / 'params/tiny.yaml'}` first" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_changing_one_data_parameter_reruns_only_what_depends_on_it(project_copy):
    import shutil
    shutil.rmtree(project_copy / "data")
    small_corpus(project_copy / "data", per_source=15)
    reran = lambda out: {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")}
    assert reran(run(["dvc", "repro", "pack"], cwd=project_copy).stdout) == {"clean", "tokenizer", "pack"}
    tiny = project_copy / "params/tiny.yaml"
    tiny.write_text(tiny.read_text().replace("lr: 3.0e-3", "lr: 1.0e-3"))
    assert reran(run(["dvc", "repro", "pack"], cwd=project_copy).stdout) == set()
    tiny.write_text(tiny.read_text().replace("  split_seed: 0\n  seed: 0\n", "  split_seed: 0\n  seed: 5\n"))
    assert load_params(tiny).data.seed == 5
    assert reran(run(["dvc", "repro", "pack"], cwd=project_copy).stdout) == set(), "the shuffle seed is not a data stage's"
    tiny.write_text(tiny.read_text().replace("vocab_size: 8192", "vocab_size: 4096"))
    assert reran(run(["dvc", "repro", "pack"], cwd=project_copy).stdout) == {"tokenizer", "pack"}
    tiny.write_text(tiny.read_text().replace("token_dtype: auto", "token_dtype: uint32"))
    assert reran(run(["dvc", "repro", "pack"], cwd=project_copy).stdout) == {"pack"}
    assert json.loads((project_copy / "runs/data/shards/train/meta.json").read_text())["dtype"] == "uint32"


def test_data_benchmark_runs_and_prints_its_ratio(pipeline):
    "Measured by hand (bench/data.py); here it only has to run end to end."
    out = run(["python", "bench/data.py", "--repeats", "1", "--out-dir", pipeline["params"].data.out_dir,
               "--set", "data.max_epochs=1000"]).stdout
    assert "tokenize+pack" in out and "samples/s" in out and "documents/s" in out
    assert out.strip().splitlines()[-1].startswith("ratio: ")


def test_non_latin_documents_are_not_all_near_duplicates_of_each_other():
    from marin_study.data.clean import minhash
    cfg = PARAMS.data
    russian = "Быстрая коричневая лиса перепрыгивает через ленивую собаку у реки каждое утро."
    japanese = "素早い茶色の狐は毎朝川のそばで怠け者の犬を飛び越えます。"
    greek = "Η γρήγορη καφέ αλεπού πηδά πάνω από το τεμπέλικο σκυλί κάθε πρωί."
    sigs = [minhash(t, cfg) for t in (russian, japanese, greek)]
    assert max(a.jaccard(b) for i, a in enumerate(sigs) for b in sigs[i + 1:]) < 0.2
    assert minhash(russian.upper(), cfg).jaccard(sigs[0]) == 1.0


def test_a_literal_end_token_inside_a_text_is_plain_text(pipeline):
    tokenizer = pipeline["tokenizer"]
    eod = tokenizer.token_to_id(EOD)
    text = 'print("<|endoftext|>")'
    ids = tokenizer.encode(text).ids
    assert eod not in ids and tokenizer.decode(ids) == text


def test_corrupt_or_mismatched_artefacts_are_clear_errors(pipeline, tmp_path):
    import shutil
    shards = tmp_path / "shards"
    shutil.copytree(pipeline["root"] / "out/shards/train", shards)
    with open(shards / "web.bin", "r+b") as f: f.truncate(1000)
    with pytest.raises(DataError, match="web.bin: 1000 bytes where meta.json says"):
        Shard(shards, "web")
    (shards / "meta.json").write_text("{oops")
    with pytest.raises(DataError, match="meta.json: not valid JSON"):
        Shard(shards, "web")
    (tmp_path / "tokenizer.json").write_text("{oops")
    with pytest.raises(DataError, match="not a readable tokenizer"):
        load_tokenizer(tmp_path / "tokenizer.json")
    small_vocab = dataclasses.replace(pipeline["params"], model=dataclasses.replace(PARAMS.model, vocab_size=1000))
    with pytest.raises(DataError, match="the shards use 2,048 token ids but model.vocab_size is 1,000"):
        make_loader(small_vocab)


def test_naming_one_filter_keeps_the_other_defaults():
    from marin_study.data.clean import thresholds
    cfg = load_params(ROOT / "params/small.yaml", ["data.filters.min_words=5"]).data
    limits = thresholds(cfg, "web")
    assert limits["min_words"] == 5 and limits["max_symbol_ratio"] == 0.1 and len(limits) == 9


def test_documents_without_a_group_default_to_their_id(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"id": "x", "domain": "web", "source": "s", "license": "l", "text": "t"}) + "\n")
    assert next(read_jsonl(path))["group"] == "x"


def test_a_training_document_quoting_part_of_a_heldout_one_is_dropped(pipeline, tmp_path):
    "Containment, not similarity: a third of a held-out entry has a low Jaccard but is all held-out text."
    import shutil
    from marin_study.data.clean import minhash
    raw = tmp_path / "raw"
    shutil.copytree(pipeline["raw"], raw)
    entry = max(read_jsonl(raw / "heldout/devils-dictionary.jsonl"), key=lambda d: len(d["text"].split()))
    words = entry["text"].split()
    quote = " ".join(words[:len(words) // 3])
    cfg = pipeline["params"].data
    assert minhash(quote, cfg).jaccard(minhash(entry["text"], cfg)) < cfg.dedup_threshold
    planted = {"id": "fortunes/planted", "domain": "quotes", "source": "fortunes", "license": "x", "group": "planted", "text": quote}
    with open(raw / "train/fortunes.jsonl", "a") as f: f.write(json.dumps(planted) + "\n")
    report = clean_corpus(raw, tmp_path / "clean", cfg)
    kept = {d["id"] for p in (tmp_path / "clean").glob("*/*.jsonl") for d in read_jsonl(p)}
    assert "fortunes/planted" not in kept and report["quotes"]["decontam:ngram_docs"] >= 1
    assert contamination(tmp_path / "clean", cfg) == []


def test_a_heldout_document_quoted_whole_inside_a_long_training_one_leaves_the_heldout_split(pipeline, tmp_path):
    "The other direction: the training document is mostly its own text (kept), the held-out entry all training text."
    import shutil
    raw = tmp_path / "raw"
    shutil.copytree(pipeline["raw"], raw)
    entry = next(d for d in read_jsonl(raw / "heldout/devils-dictionary.jsonl") if 40 <= len(d["text"].split()) <= 80)
    bible = list(read_jsonl(raw / "train/bible-kjv.jsonl"))
    host = max(bible, key=lambda d: len(d["text"]))
    host["text"] += "\n\n" + entry["text"]  # in place: a copy of the host would go as its near-duplicate
    write_jsonl(raw / "train/bible-kjv.jsonl", bible)
    cfg = pipeline["params"].data
    report = clean_corpus(raw, tmp_path / "clean", cfg)
    kept = {d["id"] for p in (tmp_path / "clean").glob("*/*.jsonl") for d in read_jsonl(p)}
    assert host["id"] in kept and entry["id"] not in kept
    assert report["books"]["decontam:heldout_docs"] >= 1
    assert contamination(tmp_path / "clean", cfg) == []
    (tmp_path / "clean/heldout/books.jsonl").open("a").write(json.dumps(entry) + "\n")
    assert ("contained", host["id"], entry["id"]) in contamination(tmp_path / "clean", cfg)


# --- Interrupted stages, mismatched shards and bad input (issue 22) ---

def data_cli(action: str, raw: Path, out: Path, *sets: str, check: bool = True):
    "`marin-study data ACTION` on the tiny params with a 1024-id tokenizer, the corpus `raw` and the outputs in `out`."
    overrides = [f"data.dir={raw}", f"data.out_dir={out}", "model.vocab_size=1024", *sets]
    return run(["marin-study", "data", action, str(ROOT / "params/tiny.yaml")] + [a for s in overrides for a in ("--set", s)],
               check=check)


OLD = {"clean": ["data.heldout_fraction=0.1"], "tokenizer": ["model.vocab_size=512"], "pack": ["data.token_dtype=uint32"]}
OUTPUT = {"clean": "clean", "tokenizer": "tokenizer.json", "pack": "shards"}


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    "A small corpus, its outputs from an uninterrupted run ('new'), and older outputs of other params ('old')."
    root = tmp_path_factory.mktemp("staged")
    raw = small_corpus(root / "raw", per_source=10)
    for name, sets in (("new", []), ("old", [s for v in OLD.values() for s in v])):
        for action in ("clean", "tokenizer", "pack"): data_cli(action, raw, root / name, *sets)
    return root


# The stage as `marin-study data` runs it (the CLI's own kills are drills: tests/test_drills.py), killed (SIGKILL) at its N-th os.replace (each file's commit, each folder's
# swap) or at the replace that moves a staging folder into place.
KILLED = """
import os, signal, sys
from pathlib import Path
from marin_study.config import load_params
stage, raw, out, when = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
p = load_params(sys.argv[5], [f"data.dir={raw}", f"data.out_dir={out}", "model.vocab_size=1024"])
calls, replace = [0], os.replace
def dying(src, dst):
    calls[0] += 1
    if str(calls[0]) == when or (when == "swap" and str(src).endswith(".staging")): os.kill(os.getpid(), signal.SIGKILL)
    return replace(src, dst)
os.replace = dying
if stage == "clean":
    from marin_study.data.clean import clean_corpus
    clean_corpus(raw, out / "clean", p.data)
elif stage == "tokenizer":
    from marin_study.data.tokens import train_tokenizer
    train_tokenizer(out / "clean", 1024, out / "tokenizer.json")
else:
    from marin_study.data import tokens
    tok = tokens.load_tokenizer(out / "tokenizer.json")
    tokens.pack_shards(out / "clean", tok, out / "shards", tokens.token_dtype(tok.get_vocab_size()))
"""


# every commit point of pack (a file's commit, another's, the folder's swap), the tokenizer's one file and clean's swap
@pytest.mark.parametrize("stage, when", [("clean", "swap"), ("tokenizer", "1"), ("pack", "1"), ("pack", "4"), ("pack", "swap")])
def test_a_stage_killed_midway_leaves_the_old_output_or_none_and_a_rerun_is_identical(staged, stage, when, tmp_path):
    import shutil
    out = tmp_path / "out"
    shutil.copytree(staged / "old", out)
    earlier = list(OUTPUT)[:list(OUTPUT).index(stage)]  # the stages before this one are up to date
    for name in earlier:
        target = out / OUTPUT[name]
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        (shutil.copytree if (staged / "new" / OUTPUT[name]).is_dir() else shutil.copy)(staged / "new" / OUTPUT[name], target)
    before = tree_hashes(out)
    killed = run([sys.executable, "-c", KILLED, stage, str(staged / "raw"), str(out), when, str(ROOT / "params/tiny.yaml")],
                 check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    left = tree_hashes(out / OUTPUT[stage])
    assert left in ({}, tree_hashes(staged / "old" / OUTPUT[stage]), tree_hashes(staged / "new" / OUTPUT[stage]))
    others = {k: v for k, v in tree_hashes(out).items() if not k.startswith(OUTPUT[stage]) and not k.startswith(".")}
    assert others == {k: v for k, v in before.items() if not k.startswith(OUTPUT[stage])}
    for name in list(OUTPUT)[list(OUTPUT).index(stage):]:  # the rerun, and the stages after it
        run([sys.executable, "-c", KILLED, name, str(staged / "raw"), str(out), "never", str(ROOT / "params/tiny.yaml")])
        assert tree_hashes(out / OUTPUT[name]) == tree_hashes(staged / "new" / OUTPUT[name]), "the uninterrupted run's bytes"
    assert not [p.name for p in out.rglob(".*")], "a killed run's staging folder or temporary file is left behind"


def test_the_loader_refuses_shards_of_another_tokenizer_an_older_pack_or_ids_past_the_model(pipeline, tmp_path):
    import shutil
    from marin_study.data.tokens import train_tokenizer
    from marin_study.utils import sha256_file
    out = tmp_path / "out"
    shutil.copytree(pipeline["root"] / "out/shards", out / "shards")
    shutil.copy(pipeline["root"] / "out/tokenizer.json", out / "tokenizer.json")
    params = dataclasses.replace(pipeline["params"], data=dataclasses.replace(pipeline["params"].data, out_dir=str(out),
                                                                              max_epochs=1000.0))
    make_loader(params)  # the shards and the tokenizer that packed them
    meta_path = out / "shards/train/meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["tokenizer_sha256"] == sha256_file(out / "tokenizer.json")
    assert meta["max_token_id"] == max(int(Shard(out / "shards/train", d).tokens.max()) for d in meta["domains"])
    packed = sha256_file(out / "tokenizer.json")
    train_tokenizer(pipeline["root"] / "out/clean", 512, out / "tokenizer.json")  # retrained, the shards not re-packed
    with pytest.raises(DataError) as info:
        make_loader(params)
    for words in (packed[:12], sha256_file(out / "tokenizer.json")[:12], "dvc repro pack", "marin-study data pack"):
        assert words in str(info.value)
    shutil.copy(pipeline["root"] / "out/tokenizer.json", out / "tokenizer.json")
    meta_path.write_text(json.dumps({**meta, "max_token_id": 9000}))
    with pytest.raises(DataError, match="token id 9,000 .* model.vocab_size is 8,192"):
        make_loader(params)
    meta_path.write_text(json.dumps({k: v for k, v in meta.items() if k not in ("tokenizer_sha256", "max_token_id")}))
    with pytest.raises(DataError, match="older pack.*re-pack.*dvc repro pack"):
        make_loader(params)


def test_heldout_shards_go_through_the_same_check(pipeline, tmp_path):
    "A pack killed between the splits left new training shards beside old held-out ones: evaluation is refused too."
    import shutil
    from marin_study.data.tokens import checked_shard_meta, train_tokenizer
    out = tmp_path / "out"
    shutil.copytree(pipeline["root"] / "out/shards", out / "shards")
    train_tokenizer(pipeline["root"] / "out/clean", 512, out / "tokenizer.json")
    params = dataclasses.replace(pipeline["params"], data=dataclasses.replace(pipeline["params"].data, out_dir=str(out)))
    with pytest.raises(DataError, match="shards/heldout.*another tokenizer"):
        checked_shard_meta(params, "heldout")


def bad_corpus(raw: Path, case: str) -> str:
    "Write a corpus with one fault into `raw`; return what the error must name."
    doc = lambda i, text=None: json.dumps({"id": f"web/{i}", "domain": "web", "source": "s", "license": "x",
                                           "text": text or f"Document {i} tells of rivers, mills and the weather today."})
    web = raw / "train/web.jsonl"
    web.parent.mkdir(parents=True)
    good = "".join(doc(i) + "\n" for i in range(5)).encode()
    data = {"no files": None, "empty file": b"", "blank lines": b"\n\n", "broken line": good + b'{"id": "web/9", "te\n',
            "non-UTF-8": good + doc(9).encode().replace(b"rivers", b"riv\xffers") + b"\n",
            "huge document": good + doc(9, "river " * 1_500_000).encode() + b"\n",
            "all filtered": "".join(doc(i, "## ##") + "\n" for i in range(3)).encode()}[case]
    if data is None: return f"{raw}: no train/*.jsonl"
    web.write_bytes(data)
    return {"empty file": f"{web}: the file is empty", "blank lines": f"{web}: the file is empty",
            "broken line": f"{web}:6: not valid JSON", "non-UTF-8": f"{web}:6: invalid UTF-8",
            "huge document": f"{web}:6: document 'web/9' has 9,000,000 characters", "all filtered": f"{raw}: no training document"}[case]


@pytest.mark.parametrize("case", ["no files", "empty file", "blank lines", "broken line", "non-UTF-8", "huge document",
                                  "all filtered"])
def test_bad_corpus_is_one_error_line_naming_file_line_and_fix_with_nothing_written(case, tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    names = bad_corpus(raw, case)
    result = data_cli("clean", raw, out, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert result.stderr.strip().count("\n") == 0 and line.startswith("marin-study: error: ") and names in line, line
    assert any(fix in line for fix in ("re-run", "repair", "re-encode", "split it", "loosen", "build the corpus")), line
    assert not out.exists() or tree_hashes(out) == {}, "nothing is written"
