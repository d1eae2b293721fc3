"""`blockdraft serve` through the real `openai` client and raw HTTP: a real uvicorn server on 127.0.0.1 (a free
port) on a thread of this process, serving the tiny fixture pair with a character-level tokenizer."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serve_support import running, settings, text_pair_dirs
from typer.testing import CliRunner

from blockdraft.cli import app

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Hello there, how are you?"}]
LONG = 480  # tokens: seconds of decoding on the tiny pair, so a request is still running when the test acts


@pytest.fixture(scope="module")
def text_pair(tiny_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return text_pair_dirs(tiny_dirs, tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(text_pair: tuple[Path, Path]):
    with running(settings(*text_pair, served_model_name=MODEL)) as server:
        yield server


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def cli_generate(text_pair: tuple[Path, Path], *args: str) -> dict:
    """`blockdraft generate --json` with the server's CPU defaults (DDTree, 4 nodes, 3 drafted tokens)."""
    target, drafter = text_pair
    result = CliRunner().invoke(app, ["generate", "--target", str(target), "--drafter", str(drafter), "--method",
                                      "ddtree", "--budget", "4", "--draft-tokens", "3", "--device", "cpu", "--json",
                                      *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def metric_values(url: str) -> dict[tuple, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name")))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def finished(url: str, reason: str) -> float:
    return metric_values(url)[("vllm:request_success_total", (("finished_reason", reason),))]


def test_models_health_and_metrics(server, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].max_model_len == 512
    assert httpx.get(f"{server.url}/health").status_code == 200
    names = {name for name, _ in metric_values(server.url)}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:spec_decode_num_drafts_total",
            "vllm:spec_decode_num_accepted_tokens_per_pos_total", "vllm:time_to_first_token_seconds_bucket",
            "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket"} <= names


def test_chat_at_t0_is_blockdraft_generate(client: openai.OpenAI, text_pair: tuple[Path, Path]) -> None:
    reference = cli_generate(text_pair, "--messages", json.dumps(CHAT), "--max-new-tokens", "40")
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                              extra_body={"return_token_ids": True})
    choice = response.choices[0]
    assert choice.token_ids == reference["token_ids"] and choice.message.content == reference["text"]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert response.usage.completion_tokens == len(reference["token_ids"])
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    spec = response.metrics["speculative_decoding"]
    assert spec["acceptance_lengths"] == reference["acceptance_lengths"]
    assert spec["tau"] == pytest.approx(reference["metrics"]["tau"]) and spec["num_spec_tokens"] == 3


def test_completions_text_and_ids_at_t0_are_blockdraft_generate(client: openai.OpenAI, text_pair) -> None:
    reference = cli_generate(text_pair, "--prompt", "Once upon a time", "--max-new-tokens", "30")
    text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0)
    assert text.choices[0].text == reference["text"] and text.usage.completion_tokens == len(reference["token_ids"])
    by_ids = cli_generate(text_pair, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "30")
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=30, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert ids.choices[0].token_ids == by_ids["token_ids"] and ids.usage.prompt_tokens == 4


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_stream_equals_the_whole_response_and_ends_with_usage(client: openai.OpenAI, endpoint: str) -> None:
    if endpoint == "chat":
        call = lambda **kw: client.chat.completions.create(model=MODEL, messages=CHAT, **kw)  # noqa: E731
        piece = lambda c: c.choices[0].delta.content or ""  # noqa: E731
        whole = lambda r: r.choices[0].message.content  # noqa: E731
    else:
        call = lambda **kw: client.completions.create(model=MODEL, prompt="Hi!", **kw)  # noqa: E731
        piece = lambda c: c.choices[0].text  # noqa: E731
        whole = lambda r: r.choices[0].text  # noqa: E731
    full = call(max_tokens=50, temperature=0)
    chunks = list(call(max_tokens=50, temperature=0, stream=True, stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    assert "".join(piece(c) for c in with_choices) == whole(full)
    assert with_choices[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    if endpoint == "chat":
        assert with_choices[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].metrics["speculative_decoding"]["tau"] == full.metrics["speculative_decoding"]["tau"]
    plain = list(call(max_tokens=5, temperature=0, stream=True))
    assert all(c.usage is None for c in plain)
    running = list(call(max_tokens=50, temperature=0, stream=True,
                        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in running]  # vLLM's continuous usage: every chunk, tokens so far
    assert all(c.usage is not None and c.usage.prompt_tokens == full.usage.prompt_tokens for c in running)
    assert counts == sorted(counts) and counts[-1] == full.usage.completion_tokens and len(running) > 2
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in running)
    alone = list(call(max_tokens=5, temperature=0, stream=True, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in alone)  # without include_usage: none, as vLLM


def test_stop_string_spanning_tokens(client: openai.OpenAI) -> None:
    ids = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=60, temperature=0,
                                    extra_body={"return_token_ids": True}).choices[0]
    text = ids.text
    start = next(i for i in range(4, len(text) - 2) if text[i] != text[i + 1] and text.find(text[i:i + 2]) == i)
    stop = text[start:start + 2]  # two characters = two tokens of this tokenizer
    reply = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=60, temperature=0, stop=[stop],
                                      extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    assert choice.text == text[:start] and choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.token_ids == ids.token_ids[:len(choice.token_ids)]
    assert reply.usage.completion_tokens == len(choice.token_ids)  # up to the token that completed the stop
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Tell me", max_tokens=60, temperature=0, stop=stop, stream=True)]
    assert "".join(pieces) == text[:start] and all(stop[0] not in p[-1:] for p in pieces[:-1] if p)


def test_stop_token_ids_end_the_output(client: openai.OpenAI) -> None:
    ids = client.completions.create(model=MODEL, prompt=[9, 10], max_tokens=30, temperature=0,
                                    extra_body={"return_token_ids": True}).choices[0].token_ids
    stop = next(t for t in ids[4:] if t != 1)  # 1 is EOS, which stops without a stop_reason
    cut = ids[:ids.index(stop) + 1]
    reply = client.completions.create(model=MODEL, prompt=[9, 10], max_tokens=30, temperature=0,
                                      extra_body={"return_token_ids": True, "stop_token_ids": [stop]})
    choice = reply.choices[0]
    assert choice.token_ids == cut and choice.finish_reason == "stop" and choice.stop_reason == stop
    assert reply.usage.completion_tokens == len(cut)


def test_seed_reproduces_samples_at_t_above_0(client: openai.OpenAI, text_pair) -> None:
    def sample(seed: int) -> list[int]:
        return client.completions.create(model=MODEL, prompt=[3, 4, 5], max_tokens=30, temperature=1.0, seed=seed,
                                         extra_body={"return_token_ids": True}).choices[0].token_ids

    first, again, other = sample(7), sample(7), sample(8)
    assert first == again and first != other
    cli = cli_generate(text_pair, "--prompt-ids", "3,4,5", "--max-new-tokens", "30", "--temperature", "1.0",
                       "--seed", "7")
    assert cli["token_ids"] == first


def post(url: str, path: str, body: object, timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=timeout)


BAD = [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 600}, 400, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x" * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 9999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [9999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object", "x": 1}}, 400,
     "response_format.type"),
    ("/v1/chat/completions", {"messages": CHAT, "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": CHAT, "surprise": 1}, 400, "surprise"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, 400, "stop"),
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_bad_requests_get_openais_error_object(server, path: str, body: object, status: int, param) -> None:
    response = post(server.url, path, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param and error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    if param:
        assert param.split(".")[0] in error["message"]


def test_errors_through_the_openai_client_and_unknown_routes(server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, n=3)
    assert info.value.status_code == 400 and "`n`" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    missing = httpx.get(f"{server.url}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"


def test_harmless_and_neutral_fields_are_accepted(server) -> None:
    body = {"messages": CHAT, "max_tokens": 2, "user": "u1", "metadata": {"a": "b"}, "store": False, "n": 1,
            "logprobs": False, "presence_penalty": 0, "tool_choice": "none", "service_tier": "auto", "seed": 3}
    assert post(server.url, "/v1/chat/completions", body).status_code == 200
    vllm = {"prompt": "a", "max_tokens": 2, "request_id": "r-7", "session_id": "s", "mm_payload": "tensors",
            "return_token_offsets": False, "vllm_xargs": {}, "stream_interval": 1}
    reply = post(server.url, "/v1/completions", vllm)
    assert reply.status_code == 200 and reply.json()["id"] == "cmpl-r-7"  # vLLM's id from the request's own
    headed = httpx.post(f"{server.url}/v1/completions", json=vllm, headers={"X-Request-Id": "h-1"}, timeout=30)
    assert headed.json()["id"] == "cmpl-h-1"  # the header first, as vLLM


def test_api_key(text_pair) -> None:
    with running(settings(*text_pair, api_key="s3cret")) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/metrics").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            response = httpx.get(f"{server.url}/v1/models", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["type"] == "AuthenticationError"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=str(text_pair[0]), prompt="a", max_tokens=2).usage.completion_tokens >= 1


def test_sixteen_concurrent_clients_match_sequential_answers(server, client: openai.OpenAI) -> None:
    prompts = [[(7 * i + j) % 90 + 2 for j in range(5)] for i in range(48)]

    def ask(prompt: list[int]) -> tuple[list[int], int]:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"return_token_ids": True})
        return reply.choices[0].token_ids, reply.usage.completion_tokens

    sequential = [ask(p) for p in prompts[:16]]
    before = finished(server.url, "length") + finished(server.url, "stop")
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(ask, prompts))
    assert concurrent[:16] == sequential
    assert all(count == len(ids) for ids, count in concurrent)
    assert finished(server.url, "length") + finished(server.url, "stop") == before + len(prompts)


def test_busy_server_answers_health_refuses_past_its_queue_and_frees_a_gone_clients_slot(text_pair) -> None:
    with running(settings(*text_pair, max_queue=0)) as server:
        long = {"prompt": [5, 6, 7], "max_tokens": LONG, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # decoding has started
            t0 = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
            gauges = metric_values(server.url)
            assert time.monotonic() - t0 < 2 and gauges[("vllm:num_requests_running", ())] == 1
            refused = post(server.url, "/v1/completions", {"prompt": [1], "max_tokens": 2})
            assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["type"] == "RateLimitError"
        # the client left mid-stream: the worker drops the request at its next step and takes the next one
        deadline = time.monotonic() + 5
        while (accepted := post(server.url, "/v1/completions", {"prompt": [1], "max_tokens": 2})).status_code == 429:
            assert time.monotonic() < deadline, "the slot of a disconnected client was not freed"
            time.sleep(0.05)
        assert accepted.status_code == 200 and finished(server.url, "abort") == 1
        assert metric_values(server.url)[("vllm:generation_tokens_total", ())] < LONG
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up is dropped too
            post(server.url, "/v1/completions", {"prompt": [5, 6], "max_tokens": LONG, "ignore_eos": True}, timeout=0.5)
        deadline = time.monotonic() + 5
        while finished(server.url, "abort") < 2:
            assert time.monotonic() < deadline, "a non-streamed request whose client left kept decoding"
            time.sleep(0.05)


def test_doctor_server_reads_our_metrics(trained_pairs: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    from blockdraft.doctor.fingerprint import ProbeResult
    from blockdraft.doctor.probes import healthy_deployment, measure
    from blockdraft.pair import Loaded

    target, drafter = trained_pairs["full"]
    prompts = [[(s + i) % 48 for i in range(12)] for s in (1, 9, 20, 33)]
    loaded = Loaded(str(target), str(drafter), "cpu", None)
    assert loaded.drafter is not None
    reference = measure(healthy_deployment(loaded.target, loaded.drafter), prompts, 32)
    probe = tmp_path / "probe.json"
    ProbeResult(reference).save(probe)
    block = loaded.drafter.cfg.block_size
    with running(settings(target, drafter, method="dflash", draft_tokens=block - 1)) as server:
        report: dict = {}

        def doctor() -> None:
            result = CliRunner().invoke(app, ["doctor", "server", "--url", server.url, "--interval", "4",
                                              "--reference", str(probe), "--json"])
            report.update(json.loads(result.stdout), exit_code=result.exit_code)

        thread = threading.Thread(target=doctor)
        thread.start()
        time.sleep(1.0)  # after the doctor's first scrape
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        lengths: list[int] = []
        for prompt in prompts:
            reply = client.completions.create(model=str(target), prompt=prompt, max_tokens=32, temperature=0)
            lengths += reply.metrics["speculative_decoding"]["acceptance_lengths"]
        thread.join(timeout=60)
    assert report["exit_code"] == 0
    observed = report["fingerprints"]["observed"]
    assert observed["tau"] == pytest.approx(sum(lengths) / len(lengths)) == pytest.approx(reference.tau)
    assert observed["num_drafts"] == len(lengths) and observed["block_size"] == block
    assert report["verdict"].startswith("the drafter is the limit")


def test_a_busy_port_or_a_missing_drafter_is_one_sentence_before_loading(text_pair) -> None:
    from blockdraft.errors import BlockdraftError
    from blockdraft.serve.server import BlockdraftServer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BlockdraftError, match=f"--port {port} cannot be bound"):
            BlockdraftServer(settings(*text_pair, port=port), print)
    with pytest.raises(BlockdraftError, match="--method ddtree needs --drafter PATH"):
        BlockdraftServer(settings(text_pair[0], None), print)


@pytest.mark.parametrize("seqs,scheduled", [(1, False), (3, False), (3, True)])
def test_lookup_trees_serve_generates_answers_and_are_refused_off_ddtree(text_pair, tmp_path: Path, seqs: int,
                                                                         scheduled: bool) -> None:
    """--lookup N one request at a time, under continuous batching and under a schedule that picks DDTree@4 at every
    batch size (requests sent together): each answer and its acceptance lengths are `generate --lookup N`'s (the
    schedule's trees draft the whole block); with another method it is one sentence before loading."""
    from concurrent.futures import ThreadPoolExecutor

    from blockdraft.engine.acceptance import AcceptanceProfile
    from blockdraft.engine.candidate import AR, Candidate
    from blockdraft.engine.cost_table import CostTable
    from blockdraft.engine.schedule import choose
    from blockdraft.errors import BlockdraftError
    from blockdraft.serve.server import BlockdraftServer

    conversations = [[{"role": "user", "content": text}] for text in ("abcabcabcabcabc", "xyz xyz xyz xyz")]
    depth = ["--draft-tokens", "5"] if scheduled else []  # the tiny drafter's whole block of 6
    references = [cli_generate(text_pair, "--messages", json.dumps(messages), "--max-new-tokens", "40", "--lookup", "2",
                               *depth) for messages in conversations]
    extra: dict[str, object] = {}
    if scheduled:
        flat = {1: 1.0, 5: 1.0}
        costs = CostTable(device="cpu", dtype="float32", target="t", drafter="d", context_tokens=64,
                          verify_s={1: flat, 2: flat, 3: flat}, draft_s={1: 0.1, 2: 0.1, 3: 0.1})
        schedule = choose(costs, AcceptanceProfile([0.9, 0.8, 0.7], {4: 3.5}), [AR, Candidate("ddtree", budget=4)],
                          [1, 2, 3])
        assert {entry.choice.label for entry in schedule.entries} == {"ddtree@4"}
        schedule.save(tmp_path / "schedule.json")
        extra = dict(engine="fast", schedule=str(tmp_path / "schedule.json"), schedule_adapt=False)
    said: list[str] = []
    with running(settings(*text_pair, served_model_name=MODEL, max_num_seqs=seqs, lookup=2, **extra),
                 said.append) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(messages: list[dict]) -> object:
            return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                  extra_body={"return_token_ids": True})

        with ThreadPoolExecutor(len(conversations)) as pool:
            responses = list(pool.map(ask, conversations))
    for response, reference in zip(responses, references):
        assert response.choices[0].token_ids == reference["token_ids"]
        assert response.metrics["speculative_decoding"]["acceptance_lengths"] == reference["acceptance_lengths"]
    assert any("each holding a prompt-lookup chain of up to 2 tokens" in line for line in said)
    if seqs > 1:
        return
    with pytest.raises(BlockdraftError, match="--lookup 2 adds .* --method ddtree, not dflash"):
        BlockdraftServer(settings(*text_pair, method="dflash", lookup=2), print)


def test_an_engine_that_dies_answers_every_request_and_turns_health_503(text_pair) -> None:
    import os
    import signal

    with running(settings(*text_pair)) as server:
        long = {"prompt": [5, 6, 7], "max_tokens": LONG, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # decoding has started
            queued = ThreadPoolExecutor(1).submit(post, server.url, "/v1/completions", {"prompt": [1], "max_tokens": 2})
            time.sleep(0.2)
            os.kill(server.engine.process.pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        error = json.loads(rest[-2][6:])["error"]
        assert rest[-1] == "data: [DONE]" and error["code"] == 500 and "engine process exited" in error["message"]
        answer = queued.result(timeout=30)
        assert answer.status_code == 500 and "engine process exited" in answer.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
        refused = post(server.url, "/v1/completions", {"prompt": [1], "max_tokens": 2})
        assert refused.status_code == 503 and "without its engine" in refused.json()["error"]["message"]
        assert finished(server.url, "error") == 2


def test_continuous_batching_answers_sixteen_clients_as_sequential_decoding_does(text_pair, server) -> None:
    """--max-num-seqs 4 on the fast engine: concurrent requests decode together (running reaches 4) and each answer
    at T=0 is the one-at-a-time server's."""
    prompts = [[(5 * i + j) % 90 + 2 for j in range(1 + i % 7)] for i in range(24)]

    def ask(url: str, prompt: list[int]) -> tuple[list[int], int, str]:
        reply = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60).completions.create(
            model=MODEL, prompt=prompt, max_tokens=4 + len(prompt) * 2, temperature=0,
            extra_body={"return_token_ids": True})
        return reply.choices[0].token_ids, reply.usage.completion_tokens, reply.choices[0].text

    one_at_a_time = [ask(server.url, p) for p in prompts]
    with running(settings(*text_pair, served_model_name=MODEL, max_num_seqs=4, engine="fast")) as batched:
        peak = 0.0

        def watch(stop: threading.Event) -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, metric_values(batched.url)[("vllm:num_requests_running", ())])
                time.sleep(0.01)

        stop = threading.Event()
        watcher = threading.Thread(target=watch, args=(stop,))
        watcher.start()
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda p: ask(batched.url, p), prompts))
        stop.set()
        watcher.join()
        assert finished(batched.url, "length") + finished(batched.url, "stop") == len(prompts)
    assert together == one_at_a_time
    assert peak == 4


def test_stop_strings_end_batched_requests_where_they_end_one_at_a_time(text_pair, server) -> None:
    """In a batch, a commit's stop-string check runs while the next step verifies (the pipelined step): a request a
    stop string ends answers exactly what the one-at-a-time server answers (text, finish reason, usage)."""
    prompts = [[(3 * i + j) % 90 + 2 for j in range(2 + i % 5)] for i in range(8)]

    def ask(url: str, prompt: list[int], stop: str | None = None) -> tuple[str, str, int]:
        reply = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60).completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop)
        return reply.choices[0].text, reply.choices[0].finish_reason, reply.usage.completion_tokens

    texts = [ask(server.url, prompt)[0] for prompt in prompts]
    stops = [text[len(text) // 2 : len(text) // 2 + 2] or None for text in texts]  # a piece of each answer
    one_at_a_time = [ask(server.url, prompt, stop) for prompt, stop in zip(prompts, stops)]
    assert sum(reason == "stop" for _, reason, _ in one_at_a_time) >= len(prompts) // 2
    with running(settings(*text_pair, served_model_name=MODEL, max_num_seqs=4, engine="fast")) as batched:
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda pair: ask(batched.url, *pair), zip(prompts, stops)))
    assert together == one_at_a_time


def test_a_schedule_serves_with_the_method_it_picks_per_batch_size(text_pair, server, tmp_path: Path) -> None:
    from blockdraft.engine.acceptance import AcceptanceProfile
    from blockdraft.engine.candidate import AR, Candidate
    from blockdraft.engine.cost_table import CostTable
    from blockdraft.engine.schedule import choose
    from blockdraft.errors import BlockdraftError
    from blockdraft.serve.server import BlockdraftServer

    flat, steep = {1: 1.0, 4: 1.0, 5: 1.0}, {1: 1.0, 4: 9.0, 5: 9.0}
    costs = CostTable(device="cpu", dtype="float32", target="t", drafter="d", context_tokens=64,
                      verify_s={1: flat, 2: steep}, draft_s={1: 0.1, 2: 0.1})
    schedule = choose(costs, AcceptanceProfile([0.9, 0.8, 0.7], {4: 3.5}),
                      [AR, Candidate("dflash", 3), Candidate("ddtree", budget=4)], [1, 2])
    path = tmp_path / "schedule.json"
    schedule.save(path)
    prompts = [[(3 * i + j) % 90 + 2 for j in range(2 + i % 5)] for i in range(8)]

    def ask(url: str, prompt: list[int]) -> tuple[list[int], list[int]]:
        reply = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 10,
                                                          "temperature": 0, "return_token_ids": True}, timeout=60).json()
        return reply["choices"][0]["token_ids"], reply["metrics"]["speculative_decoding"]["acceptance_lengths"]

    said: list[str] = []
    with running(settings(*text_pair, served_model_name=MODEL, max_num_seqs=4, engine="fast", schedule=str(path),
                          schedule_adapt=False), said.append) as scheduled:
        alone = ask(scheduled.url, prompts[0])
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda p: ask(scheduled.url, p), prompts))
        time.sleep(0.5)  # the engine reports its busy time when it goes idle
        steps = {labels[0][1]: n for (name, labels), n in metric_values(scheduled.url).items()
                 if name == "blockdraft:engine_step_seconds_count"}
        assert steps.keys() == {"ddtree@4", "ar"} and min(steps.values()) > 0  # /metrics: each step by its method
    assert any(line.startswith(f"schedule ({path}; acceptance: acceptance profile): batch 1: ddtree@4")
               and "batch 2: ar" in line for line in said)
    assert not any("adapts" in line for line in said)
    assert [ids for ids, _ in together] == [ask(server.url, p)[0] for p in prompts]
    assert alone[0] == together[0][0]

    # adapting (the default): one request at a time until batch 1's first phase (from its 32nd step) has timed the
    # candidates; the server prints what it measured, and every answer is still the plain server's
    said.clear()
    long = [[(7 * i + j) % 90 + 2 for j in range(4)] for i in range(12)]
    with running(settings(*text_pair, served_model_name=MODEL, max_num_seqs=4, engine="fast", schedule=str(path)),
                 said.append) as adapting:
        answers = []
        for prompt in long:
            answers.append(httpx.post(f"{adapting.url}/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "return_token_ids": True,
                "ignore_eos": True}, timeout=60).json()["choices"][0]["token_ids"])
            if any(line.startswith("schedule measured at batch 1: ") for line in said):
                break
    assert any("the schedule adapts" in line for line in said)
    assert any(line.startswith("schedule measured at batch 1: ") and "tokens/s of the server's own steps: " in line
               for line in said)
    assert answers == [httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "prompt": p, "max_tokens": 40, "temperature": 0, "return_token_ids": True,
        "ignore_eos": True}, timeout=60).json()["choices"][0]["token_ids"] for p in long[: len(answers)]]
    with pytest.raises(BlockdraftError, match="--schedule needs continuous batching"):
        BlockdraftServer(settings(*text_pair, schedule=str(path)), print)
    costs.device = "cuda"
    choose(costs, AcceptanceProfile([0.9, 0.8, 0.7], {4: 3.5}), [AR], [1, 2]).save(path)
    with pytest.raises(BlockdraftError, match="was tuned on cuda, this server runs on cpu"):
        BlockdraftServer(settings(*text_pair, max_num_seqs=2, engine="fast", schedule=str(path)), print)


@pytest.mark.parametrize("lookup", [0, 3])
def test_schedule_auto_tunes_at_start_up(text_pair, lookup: int) -> None:
    """With --lookup the start-up tune measures the trees' tau holding the chain the scheduled trees will hold."""
    said: list[str] = []
    with running(settings(*text_pair, max_num_seqs=2, engine="fast", schedule="auto", lookup=lookup),
                 said.append) as server:
        reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200
    chained = ", trees holding a prompt-lookup chain of up to 3 tokens" if lookup else ""
    assert any(line.startswith(f"schedule (measured at start-up; acceptance: start-up decodes{chained}): batch 1: ")
               and "batch 2: " in line for line in said)


def test_a_schedule_over_a_dflash2_drafter_is_refused_at_start_up(text_pair, tmp_path: Path) -> None:
    """The schedule switches between the plain DFlash chain and trees, which a DFlash-2 drafter's selector does not
    draft: asked for one, the server names the fix instead of serving the wrong drafting."""
    from conftest import make_drafter

    from blockdraft.errors import BlockdraftError
    from blockdraft.models.loading import save_drafter

    save_drafter(make_drafter("dflash2"), tmp_path / "dflash2", dtype=torch.float32)
    with pytest.raises(BlockdraftError, match="DFlash-2 selector or DSpark head drafts otherwise"):
        with running(settings(text_pair[0], tmp_path / "dflash2", max_num_seqs=2, engine="fast", schedule="auto")):
            pass


def test_a_batched_client_that_leaves_frees_its_slot_while_the_others_decode(text_pair) -> None:
    with running(settings(*text_pair, max_num_seqs=2, max_queue=0)) as server:  # HF engine: seconds of decoding
        long = {"prompt": [5, 6, 7], "max_tokens": LONG, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=60) as staying:
            kept = staying.iter_lines()
            assert next(kept).startswith("data: ")
            with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=60) as leaving:
                left = leaving.iter_lines()  # kept: a dropped line iterator closes the stream
                assert next(left).startswith("data: ")
                deadline = time.monotonic() + 10
                while metric_values(server.url)[("vllm:num_requests_running", ())] < 2:  # both decode together
                    assert time.monotonic() < deadline, "the second request never joined the running one"
                    time.sleep(0.02)
            deadline = time.monotonic() + 10
            while finished(server.url, "abort") < 1:  # the leaver's slot is freed at the next step
                assert time.monotonic() < deadline, "a batched request whose client left kept its slot"
                time.sleep(0.05)
            short = post(server.url, "/v1/completions", {"prompt": [1], "max_tokens": 2, "ignore_eos": True})
            assert short.status_code == 200  # took the freed slot beside the running request
            rest = [line for line in kept if line.startswith("data: ")]
        usage = json.loads(rest[-2][6:])
        assert rest[-1] == "data: [DONE]" and usage["choices"][0]["finish_reason"] == "length"
        assert finished(server.url, "length") == 2 and finished(server.url, "abort") == 1


def target_logprobs(text_pair, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """The target's own log-softmax at each generated position [n, V] (float32, its forward over prompt + tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(text_pair[0], dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_targets_own(server, client: openai.OpenAI, text_pair, stream: bool) -> None:
    """Chat `logprobs` + `top_logprobs` and completions' `logprobs` N, vLLM's layouts, streamed and not: each token's
    log-probability is the target's log-softmax at its position, whatever the speculation accepted."""
    extra = {"return_token_ids": True}
    if stream:
        chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0, logprobs=2,
                                                stream=True, extra_body=extra))
        ids = [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])]
        entries = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
        tokens = [t for e in entries for t in e.tokens]
        token_logprobs = [lp for e in entries for lp in e.token_logprobs]
        tops = [top for e in entries for top in e.top_logprobs]
        offsets = [o for e in entries for o in e.text_offset]
        text = "".join(c.choices[0].text for c in chunks)
    else:
        reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0, logprobs=2,
                                          extra_body=extra)
        choice = reply.choices[0]
        ids, text = choice.token_ids, choice.text
        tokens, token_logprobs = choice.logprobs.tokens, choice.logprobs.token_logprobs
        tops, offsets = choice.logprobs.top_logprobs, choice.logprobs.text_offset
    prompt = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1,
                                       extra_body=extra).choices[0].prompt_token_ids
    want = target_logprobs(text_pair, prompt, ids)
    assert len(tokens) == len(ids) == 20 and "".join(tokens) == text
    assert token_logprobs == pytest.approx([want[j, t].item() for j, t in enumerate(ids)], abs=1e-4)
    assert offsets == [sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]
    for j, top in enumerate(tops):  # the emitted token first, then the 2 most likely (N + 1 entries at most)
        assert 2 <= len(top) <= 3 and list(top)[0] == tokens[j]
        assert max(top.values()) == pytest.approx(want[j].max().item(), abs=1e-4)

    chat = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
                extra_body=extra)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **chat))
        content = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                   for c in chunk.choices[0].logprobs.content]
        ids = [t for chunk in chunks if chunk.choices for t in (getattr(chunk.choices[0], "token_ids", None) or [])]
        prompt = chunks[0].prompt_token_ids
    else:
        reply = client.chat.completions.create(**chat)
        content, ids, prompt = reply.choices[0].logprobs.content, reply.choices[0].token_ids, reply.prompt_token_ids
    want = target_logprobs(text_pair, prompt, ids)
    assert len(content) == len(ids)
    for j, entry in enumerate(content):
        assert entry.logprob == pytest.approx(want[j, ids[j]].item(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # vLLM's order: the emitted token, then the most likely
        best = want[j].topk(3)
        listed = [ids[j]] + [t for t in best.indices.tolist() if t != ids[j]]
        assert [c.logprob for c in entry.top_logprobs] == pytest.approx([want[j, t].item() for t in listed[:3]],
                                                                         abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_and_its_logprobs_first(server, client: openai.OpenAI, text_pair, stream: bool) -> None:
    """Completions' `echo`: the text opens with the prompt; with `logprobs` the prompt's tokens come first, the first
    with none (vLLM's layout), each other one with the target's log-softmax at its position, then the output's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_pair[0])
    prompt = "Hi there"
    body = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=2)
    if stream:
        text, tokens, token_logprobs, tops = "", [], [], []
        for chunk in client.completions.create(stream=True, **body):
            for choice in chunk.choices:
                text += choice.text
                if choice.logprobs is not None:
                    tokens += choice.logprobs.tokens
                    token_logprobs += choice.logprobs.token_logprobs
                    tops += choice.logprobs.top_logprobs
    else:
        choice = client.completions.create(**body).choices[0]
        text, tokens = choice.text, choice.logprobs.tokens
        token_logprobs, tops = choice.logprobs.token_logprobs, choice.logprobs.top_logprobs
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert text.startswith(prompt) and "".join(tokens) == text and len(tokens) == len(ids) + 6
    assert token_logprobs[0] is None and tops[0] is None
    output = tokenizer.encode(text[len(prompt):], add_special_tokens=False)
    want = target_logprobs(text_pair, ids[:1], ids[1:] + output)
    for j, token in enumerate(ids[1:] + output):
        assert token_logprobs[1 + j] == pytest.approx(want[j, token].item(), abs=1e-4)
        assert len(tops[1 + j]) <= 3
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None


def test_logprob_requests_out_of_range_are_refused(server) -> None:
    for path, body, param in [("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
                              ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
                               "top_logprobs"),
                              ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs")]:
        reply = post(server.url, path, body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param
    named = post(server.url, "/v1/completions", {"prompt": "a", "max_tokens": 3, "logprobs": 0,
                                                 "return_tokens_as_token_ids": True}).json()
    assert all(token.startswith("token_id:") for token in named["choices"][0]["logprobs"]["tokens"])


def test_penalties_are_honoured_with_speculation(server, client: openai.OpenAI, text_pair) -> None:
    """frequency, presence and repetition penalties and logit_bias at T=0: the ids of a plain token-by-token loop
    over the target under vLLM's formulas; bad_words keeps a word out of the text; bad values are 400s by name."""
    from transformers import AutoModelForCausalLM

    from blockdraft.decoding.penalties import Penalties
    from test_penalties import reference_greedy

    body = dict(frequency_penalty=0.5, presence_penalty=1.0, repetition_penalty=1.3, logit_bias={"11": 5.0})
    reply = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=16, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True, **body})
    choice = reply.choices[0]
    model = AutoModelForCausalLM.from_pretrained(text_pair[0], dtype=torch.float32).eval()
    penalties = Penalties(frequency=0.5, presence=1.0, repetition=1.3, logit_bias=((11, 5.0),))
    assert choice.token_ids == reference_greedy(model, choice.prompt_token_ids, 16, penalties)
    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=16, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    assert plain.token_ids != choice.token_ids
    banned = next(ch for ch in plain.text if ch.isalpha())
    kept = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True, "bad_words": [banned]}).choices[0].text
    assert banned not in kept
    for extra, param in [({"frequency_penalty": 2.5}, "frequency_penalty"),
                         ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                         ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"min_tokens": 9, "max_tokens": 4}, "min_tokens")]:
        response = post(server.url, "/v1/completions", {"prompt": "a", **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, extra


def test_structured_outputs_with_speculation(server, client: openai.OpenAI, text_pair) -> None:
    """vLLM's `structured_outputs` (regex, choice) and OpenAI's `response_format` json_schema constrain the text, with
    the server's DDTree ids equal to a token-by-token masked loop; a grammar that cannot compile is a 400 naming the
    part."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from blockdraft.decoding.grammar import GrammarSpec, GrammarState, compile_grammar

    regex = "(ab|cd){1,3}e[0-9]{2}"
    reply = client.completions.create(model=MODEL, prompt="Code: ", max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"regex": regex}, "return_token_ids": True})
    choice = reply.choices[0]
    assert re.fullmatch(regex, choice.text) and choice.finish_reason == "stop"
    tokenizer = AutoTokenizer.from_pretrained(text_pair[0])
    model = AutoModelForCausalLM.from_pretrained(text_pair[0], dtype=torch.float32).eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    grammar, output = GrammarState(compile_grammar(GrammarSpec("regex", regex), tokenizer, vocab), vocab), []
    while len(output) < 20 and (not output or output[-1] != tokenizer.eos_token_id):
        with torch.inference_mode():
            row = model(torch.tensor([choice.prompt_token_ids + output])).logits[0, -1:]
        output.append(int(grammar.apply(row, [], []).argmax()))
        grammar.accept(output[-1:])
    assert choice.token_ids == output
    picked = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert picked.choices[0].message.content in ("yes", "no")
    schema = {"type": "string", "enum": ["red", "blue"]}
    colour = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}})
    assert json.loads(colour.choices[0].message.content) in ("red", "blue")
    for body, param in [({"structured_outputs": {"regex": "(open"}}, "structured_outputs.regex"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                            "type": "integer", "minimum": "zero"}}}}, "response_format.json_schema.schema"),
                        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                        ({"response_format": {"type": "xml"}}, "response_format.type")]:
        response = post(server.url, "/v1/completions", {"prompt": "a", **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (body, response.text)
