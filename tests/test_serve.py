"""The OpenAI-compatible server on a real `marin-study serve` process, called through the official `openai` client:
listing, chat, streaming, seeded samples equal to offline generation, concurrency, refusals, a clean stop."""
import asyncio
import subprocess

import httpx
import pytest

from conftest import BIN, run
from marin_study.generate import Sampling, generate_batch, load_generator
from marin_study.serve import ServerProcess

openai = pytest.importorskip("openai")
PROMPT = "The river ran through the"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=server.key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_export):
    return load_generator(tiny_export)


def test_lists_the_served_model(client, tiny_export):
    models = client.models.list().data
    assert [m.id for m in models] == [str(tiny_export)]


def test_chat_completion_counts_its_tokens(client, server, offline):
    model, tokenizer = offline
    messages = [{"role": "user", "content": "Where does the river go?"}]
    answer = client.chat.completions.create(model=server_model(client), messages=messages, max_tokens=12, temperature=0)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert answer.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert answer.choices[0].message.role == "assistant"
    expected = generate_batch(model, tokenizer, [prompt], Sampling(max_new_tokens=12))[0]
    assert answer.choices[0].message.content == expected["completion"]
    assert answer.usage.completion_tokens == expected["new_tokens"]
    assert answer.choices[0].finish_reason == expected["finish_reason"]
    two = client.chat.completions.create(model=server_model(client), messages=messages, max_tokens=12, n=2, temperature=0)
    assert two.usage.prompt_tokens == answer.usage.prompt_tokens  # the prompt is read once, however many choices
    assert [c.message.content for c in two.choices] == [expected["completion"]] * 2


def server_model(client) -> str:
    return client.models.list().data[0].id


def test_streaming_sends_the_same_text_in_pieces(client):
    model = server_model(client)
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1, "one chunk is not a stream"
    assert "".join(pieces) == whole
    assert chunks[-1].usage.completion_tokens > 0


def test_seeded_sample_equals_offline_generate(client, offline):
    model, tokenizer = offline
    settings = Sampling(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    answer = client.completions.create(model=server_model(client), prompt=PROMPT, n=2, max_tokens=16, temperature=0.9,
                                       top_p=0.95, seed=1234)
    expected = generate_batch(model, tokenizer, [PROMPT, PROMPT], settings)
    assert [c.text for c in answer.choices] == [e["completion"] for e in expected]
    assert answer.choices[0].text != answer.choices[1].text  # sampled, so the two choices differ
    other_seed = client.completions.create(model=server_model(client), prompt=PROMPT, max_tokens=16, temperature=0.9,
                                           top_p=0.95, seed=99)
    assert other_seed.choices[0].text != answer.choices[0].text


def test_stop_strings_cut_the_text(client):
    model = server_model(client)
    free = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]).choices[0]
    assert cut.text == free[:free.index(stop)] and cut.finish_reason == "stop"


def test_eight_concurrent_requests_are_batched(server, client):
    model = server_model(client)
    prompts = [f"{PROMPT} {word}" for word in "hill town sea road field wood gate stone".split()]
    alone = [client.completions.create(model=model, prompt=p, max_tokens=24, temperature=0).choices[0].text for p in prompts]
    headers = {"Authorization": f"Bearer {server.key}"}
    before = httpx.get(f"{server.url.removesuffix('/v1')}/health", headers=headers).json()["batches"]

    async def together():
        aclient = openai.AsyncOpenAI(base_url=server.url, api_key=server.key, max_retries=0, timeout=120)
        answers = await asyncio.gather(*[aclient.completions.create(model=model, prompt=p, max_tokens=24, temperature=0)
                                         for p in prompts])
        return [a.choices[0].text for a in answers]

    assert asyncio.run(together()) == alone
    batches = httpx.get(f"{server.url.removesuffix('/v1')}/health", headers=headers).json()["batches"] - before
    assert batches < len(prompts), f"8 concurrent requests took {batches} batches: none shared a generate() call"


def test_past_the_context_is_a_400_and_the_server_goes_on(client):
    model = server_model(client)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt="river " * 400, max_tokens=8)
    assert "exceed the model's context of 256 positions" in str(refused.value)
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=4).choices[0].text is not None


def test_bad_json_and_bad_fields_are_400s(server):
    headers = {"Authorization": f"Bearer {server.key}", "Content-Type": "application/json"}
    bad = httpx.post(f"{server.url}/chat/completions", content=b'{"messages": [', headers=headers)
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
    hot = httpx.post(f"{server.url}/completions", json={"prompt": "x", "temperature": 7}, headers=headers)
    assert hot.status_code == 400 and hot.json()["error"]["param"] == "temperature"
    wrong = httpx.post(f"{server.url}/completions", json={"prompt": "x", "model": "gpt-4"}, headers=headers)
    assert wrong.status_code == 404 and "is not served here" in wrong.json()["error"]["message"]
    for body, says in [({"prompt": [[5, 999999]]}, "token id 999999 is not in the vocabulary"),
                       ({"prompt": "x", "max_tokens": 0}, "max_tokens: 0 only makes sense with echo"),
                       ({"prompt": ["x"] * 5, "n": 4}, "more than this server decodes at once")]:
        refused = httpx.post(f"{server.url}/completions", json=body, headers=headers)
        assert refused.status_code == 400 and says in refused.json()["error"]["message"], refused.text


def test_a_wrong_or_missing_key_is_a_401_on_every_route(server):
    intruder = openai.OpenAI(base_url=server.url, api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        intruder.models.list()
    for path in ("/health", "/v1/models"):
        assert httpx.get(f"http://127.0.0.1:{server.port}{path}").status_code == 401


def test_served_metrics_equal_the_export_offline(server, tiny_export, suite, tmp_path):
    "The third leg of 'same behaviour before and after deployment': lm-eval over HTTP gives the offline numbers."
    from marin_study.evaluate import evaluate
    data_dir, _ = suite
    tasks = ["ppl_web", "cloze_books", "choice_heldout", "complete_code"]
    served = evaluate(tiny_export, tasks, limit=4, out=tmp_path / "served.json", endpoint=server.url, api_key=server.key,
                      data_dir=data_dir)
    offline = evaluate(tiny_export, tasks, limit=4, out=tmp_path / "offline.json", data_dir=data_dir)
    assert {r["backend"] for r in served} == {"served"}
    pairs = {(r["task"], r["metric"]): r["value"] for r in offline}
    assert len(pairs) == len(served) >= 7
    for row in served:
        assert row["value"] == pytest.approx(pairs[row["task"], row["metric"]], rel=1e-5), (row["task"], row["metric"])


def test_refusals_before_loading(server, tiny_export, tmp_path):
    taken = run([str(BIN / "marin-study"), "serve", str(tiny_export), "--port", str(server.port)], check=False)
    assert taken.returncode == 2 and "cannot listen there" in taken.stderr and "Traceback" not in taken.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "model.safetensors.index.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_export / name).read_bytes())
    missing = run([str(BIN / "marin-study"), "serve", str(broken), "--port", "0"], check=False)
    assert missing.returncode == 2 and "tokenizer.json missing" in missing.stderr and "Traceback" not in missing.stderr


def test_sigterm_stops_the_server_cleanly(tiny_export, tmp_path):
    srv = ServerProcess(tiny_export, tmp_path / "serve.log")
    assert srv.stop() == 0
    assert "server stopped" in srv.log.read_text()
