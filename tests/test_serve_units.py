"""The server's parts without a server: request checking, stop rules, per-request and Prometheus metrics, the
self-check's judgement, and the decode loop's early-end hook and vocabulary check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import VOCAB, make_drafter, make_target_model
from prometheus_client.parser import text_string_to_metric_families
from serve_support import add_char_tokenizer

from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.doctor.fingerprint import Fingerprint, ProbeResult
from blockdraft.errors import BlockdraftError
from blockdraft.models.target import Target
from blockdraft.serve.errors import ApiError
from blockdraft.serve.jobs import JobOutput, Timing
from blockdraft.serve.metrics import ServeMetrics, token_buckets
from blockdraft.serve.output import OutputText, StopRules, held_back
from blockdraft.serve.prepare import ServedModel, generation_defaults, prepare
from blockdraft.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from blockdraft.serve.render import speculative_metrics
from blockdraft.serve.self_check import judge


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("chars")
    add_char_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


# Request checking


def refusal(body: dict, model=CompletionRequest, endpoint="completion") -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(body, model, endpoint)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    "extra, param",
    [({"n": 2}, "n"), ({"logprobs": 21}, "logprobs"), ({"best_of": 3}, "best_of"), ({"echo": 1}, "echo"),
     ({"suffix": "x"}, "suffix"), ({"presence_penalty": 2.5}, "presence_penalty"), ({"min_p": 0.5}, "min_p"),
     ({"use_beam_search": True}, "use_beam_search"), ({"frobnicate": 1}, "frobnicate"),
     ({"temperature": "0.5"}, "temperature"), ({"temperature": -0.1}, "temperature"), ({"top_p": 0}, "top_p"),
     ({"top_p": 1.01}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"seed": 1.5}, "seed"),
     ({"stream": "yes"}, "stream"), ({"stop": [1]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
     ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation")],
)
def test_unsupported_unknown_and_invalid_parameters_are_named(extra: dict, param: str) -> None:
    error = refusal({"prompt": "hi", **extra})
    assert error.param == param and param.split(".")[0] in error.message


def test_neutral_values_and_harmless_fields_pass() -> None:
    body = {"prompt": [1, 2], "n": 1, "logprobs": None, "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False,
            "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "temperature": 0}
    req = parse_request(body, CompletionRequest, "completion")
    assert req.temperature == 0.0 and req.single_prompt() == [1, 2]
    chat = parse_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                          "text": "b"}]}], "tool_choice": "none", "logprobs": False, "top_logprobs": 0,
                          "parallel_tool_calls": True, "add_special_tokens": False}, ChatCompletionRequest, "chat")
    assert chat.messages[0].as_template_message() == {"role": "user", "content": "a\nb"}
    assert refusal({"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True}, ChatCompletionRequest,
                   "chat").param == "add_special_tokens"


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_every_vllm_request_field_is_served_or_refused_by_name(endpoint: str) -> None:
    """vLLM 0.33's request models field by field (their names, read from the released wheel into a fixture): each
    is implemented, harmless, or accepted at its neutral value; none is an unknown parameter. A value we cannot
    honour is a 400 naming the field, as before."""
    import json
    from pathlib import Path

    from blockdraft.serve.protocol import _ENDPOINT_NEUTRAL, HARMLESS, NEUTRAL, StreamOptions

    fields = json.loads((Path(__file__).parent / "fixtures" / "engines" / "vllm_0.33.0_request_fields.json").read_text())
    model = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    served = set(model.model_fields) | set(NEUTRAL) | set(HARMLESS) | set(_ENDPOINT_NEUTRAL[endpoint])
    assert [name for name in fields[endpoint] if name not in served] == []
    assert set(fields["stream_options"]) <= set(StreamOptions.model_fields)
    base = {"messages": [{"role": "user", "content": "a"}]} if endpoint == "chat" else {"prompt": "a"}
    neutral = {name: values[0] for name, values in NEUTRAL.items() if values and name in fields[endpoint]}
    parse_request({**base, **neutral, "session_id": "s", "truncation_side": "right"}, model, endpoint)
    assert refusal({**base, "watermarking": {"key": 1}}, model, endpoint).param == "watermarking"
    assert refusal({**base, "return_token_offsets": True}, model, endpoint).param == "return_token_offsets"
    assert parse_request({**base, "request_id": "abc"}, model, endpoint).request_id == "abc"


def test_chat_messages_are_checked() -> None:
    assert refusal({"messages": []}, ChatCompletionRequest, "chat").param == "messages"
    for message in [{"role": "tool", "tool_call_id": "1"}, {"role": "robot", "content": "x"},
                    {"role": "user", "content": "x", "tool_calls": []}]:
        assert refusal({"messages": [message]}, ChatCompletionRequest, "chat").param.startswith("messages.0"), message
    tool = {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}
    assert parse_request(tool, ChatCompletionRequest, "chat").messages[0].as_template_message()["tool_call_id"] == "1"
    assert refusal({"messages": "hi"}, ChatCompletionRequest, "chat").param == "messages"


def test_one_prompt_per_request() -> None:
    assert parse_request({"prompt": ["only"]}, CompletionRequest, "completion").single_prompt() == "only"
    with pytest.raises(ApiError, match="2 prompts"):
        parse_request({"prompt": [[1], [2]]}, CompletionRequest, "completion").single_prompt()


def test_body_must_be_an_object() -> None:
    assert refusal([1, 2]).param is None


# Stop rules and streamed text


def push_each(output: OutputText, ids: list[int], chunk: int) -> list[str]:
    pieces = []
    for i in range(0, len(ids), chunk):
        if output.finished:
            break
        pieces.append(output.push(ids[i:i + chunk])[0])
    return pieces


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_across_tokens_and_commits(tokenizer, chunk: int) -> None:
    ids = ids_of(tokenizer, "abcdEND tail")
    output = OutputText(tokenizer, StopRules(strings=("xyz", "END")))
    pieces = push_each(output, ids, chunk)
    pieces.append(output.finish("length"))
    assert "".join(pieces) == output.text == "abcd"
    assert (output.finish_reason, output.stop_reason) == ("stop", "END")
    assert output.token_ids == ids[:7]  # up to and including the token that completed the stop


def test_streamed_text_never_shows_a_stop_prefix_that_is_later_cut(tokenizer) -> None:
    output = OutputText(tokenizer, StopRules(strings=("<end>",)))
    seen = [output.push(ids_of(tokenizer, c))[0] for c in "ab<en"]
    assert "".join(seen) == "ab"  # "<en" may still become "<end>"
    assert output.push(ids_of(tokenizer, "x"))[0] == "<enx"  # it did not
    assert output.push(ids_of(tokenizer, "<end>"))[0] == ""
    assert output.text == "ab<enx" and output.stop_reason == "<end>"


def test_earliest_completing_stop_string_wins(tokenizer) -> None:
    output = OutputText(tokenizer, StopRules(strings=("cdef", "de")))
    output.push(ids_of(tokenizer, "abcdefg"))
    assert output.stop_reason == "de" and output.text == "abc"


def test_stop_tokens_end_output_and_report_only_user_ids(tokenizer) -> None:
    eos, user = tokenizer.eos_token_id, ids_of(tokenizer, "q")[0]
    rules = StopRules(frozenset({eos, user}), frozenset({user}))
    for stop, reason in ((user, user), (eos, None)):
        output = OutputText(tokenizer, rules)
        text, kept = output.push([*ids_of(tokenizer, "hi"), stop, *ids_of(tokenizer, "zz")])
        assert kept == [*ids_of(tokenizer, "hi"), stop] and output.stop_reason == reason
        assert text + output.finish("length") == "hi"


def test_length_finish_decodes_every_kept_id_once(tokenizer) -> None:
    output = OutputText(tokenizer, StopRules())
    push_each(output, ids_of(tokenizer, "hello world"), 3)
    assert output.finish("length") == "" and output.text == "hello world" and output.finish_reason == "length"


def test_held_back_is_the_longest_suffix_that_starts_a_stop() -> None:
    assert held_back("abc<e", ("<end>", "c<")) == 2
    assert held_back("abc", ("<end>",)) == 0
    assert held_back("x<end", ("<end>",)) == 4


def test_no_tokenizer_means_ids_only() -> None:
    output = OutputText(None, StopRules(frozenset({7})))
    assert output.push([3, 7, 9]) == ("", [3, 7])
    assert output.finish("length") == "" and output.finish_reason == "stop" and output.stop_reason is None


# The decode loop's hook and vocabulary check


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[Target, object]:
    target = Target(make_target_model("qwen3"))
    return target, make_drafter("all_full")


def test_on_commit_returning_true_ends_the_run_with_exact_stats(tiny_pair) -> None:
    target, drafter = tiny_pair
    proposer = build_proposer("dflash", target, drafter, None, 3)
    full = generate(target, [1, 2, 3], proposer, 40)
    seen: list[list[int]] = []

    def stop_after_two(tokens: list[int]) -> bool:
        seen.append(tokens)
        return len(seen) == 3

    cut = generate(target, [1, 2, 3], proposer, 40, on_commit=stop_after_two)
    assert cut.ended_early and not full.ended_early
    assert cut.token_ids == [t for chunk in seen for t in chunk] == full.token_ids[:len(cut.token_ids)]
    assert cut.acceptance_lengths == full.acceptance_lengths[:2] and cut.stats.generated_tokens == len(cut.token_ids)
    assert cut.draft_lengths == full.draft_lengths[:2] and all(d == 3 for d in cut.draft_lengths)
    assert sum(cut.acceptance_lengths) == len(cut.token_ids) - 1


def test_out_of_vocabulary_prompt_ids_are_refused(tiny_pair) -> None:
    target, _ = tiny_pair
    with pytest.raises(BlockdraftError, match=f"id {VOCAB + 5} is outside the target's vocabulary of {VOCAB} ids"):
        generate(target, [1, VOCAB + 5], None, 4)


# Metrics


def run_output(acceptance: list[int], drafts: list[int], kept: int) -> JobOutput:
    from blockdraft.decoding.generate import GenerationResult
    from blockdraft.metrics import SpecStats

    stats = SpecStats(method="ddtree", acceptance_lengths=acceptance)
    tokens = list(range(1 + sum(acceptance)))
    result = GenerationResult(tokens, acceptance, stats, None, drafts)
    timing = Timing(arrival=0.0, scheduled=0.5, commits=[1.0 + i for i in range(len(acceptance) + 1)],
                    finished=1.0 + len(acceptance))
    return JobOutput(tokens[:kept], "", "", "stop", None, result, timing)


def samples(metrics: ServeMetrics) -> dict[tuple, float]:
    text = metrics.exposition()[0].decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_counts_follow_vllm() -> None:
    metrics = ServeMetrics("m", 512, 3)
    metrics.finished(run_output([1, 4, 3, 2], [4, 4, 4, 0], kept=9), prompt_tokens=5, max_tokens=20)
    got = samples(metrics)
    labels = (("engine", "0"), ("model_name", "m"))
    assert got[("vllm:spec_decode_num_drafts_total", labels)] == 3  # the step with no draft is not a draft
    assert got[("vllm:spec_decode_num_draft_tokens_total", labels)] == 12
    assert got[("vllm:spec_decode_num_accepted_tokens_total", labels)] == 0 + 3 + 2
    per_pos = [got[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*labels, ("position", str(i))))]
               for i in range(3)]
    assert per_pos == [2, 2, 1]
    assert got[("vllm:request_success_total", (("engine", "0"), ("finished_reason", "stop"), ("model_name", "m")))] == 1
    assert got[("vllm:generation_tokens_total", labels)] == 11 and got[("vllm:prompt_tokens_total", labels)] == 5
    assert got[("vllm:inter_token_latency_seconds_count", labels)] == 4
    assert got[("vllm:time_to_first_token_seconds_sum", labels)] == 1.0
    assert ("vllm:spec_decode_num_drafts_total", labels) not in samples(ServeMetrics("m", 512, None))


def test_request_token_buckets_are_vllms_1_2_5_series() -> None:
    assert token_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]


def test_per_request_speculative_metrics_follow_vllms_schema() -> None:
    spec = speculative_metrics(run_output([1, 4, 3, 2], [4, 4, 4, 0], kept=9), "ddtree", 3)
    assert spec.acceptance_histogram == [1, 0, 1, 1] and spec.num_spec_steps == 3
    assert spec.per_step_accepted == [0, 3, 2] and spec.per_step_drafted == [4, 4, 4]
    assert spec.mean_acceptance_length == pytest.approx(1 + 5 / 3) and spec.draft_acceptance_rate == pytest.approx(5 / 12)
    assert spec.tau == pytest.approx(10 / 4) and spec.acceptance_lengths == [1, 4, 3, 2]


# The self-check's judgement


def fingerprint(lengths: list[int], block: int) -> Fingerprint:
    return Fingerprint.from_acceptance_lengths(lengths, block, "test")


def test_judge_against_a_probe_at_the_served_depth() -> None:
    reference = fingerprint([8, 6, 5, 7, 3], 8)
    probe = ProbeResult(reference, {"wrong mask token": fingerprint([1, 1, 2, 1, 1], 8)})
    healthy = fingerprint([4, 4, 3, 4, 2], 4)  # drafting 3 tokens: capped at 4
    assert "expected" in judge(healthy, probe, 3, "probe.json").summary
    with pytest.raises(BlockdraftError, match="deployment fault, most likely wrong mask token"):
        judge(fingerprint([1, 1, 2, 1, 1], 4), probe, 3, "probe.json")
    assert reference.at_depth(3).tau == pytest.approx(1 + sum(reference.per_position[:3]))


def test_judge_without_figures_refuses_only_a_collapse() -> None:
    assert "floor" in judge(fingerprint([2, 1, 1, 3], 4), None, 3, "the floor").summary
    with pytest.raises(BlockdraftError, match="broken deployment shows; typical causes: wrong or zero features"):
        judge(fingerprint([1] * 40, 4), None, 3, "the floor")


# From a request to a job


def served_model(target: Target, tokenizer=None, defaults: dict | None = None) -> ServedModel:
    return ServedModel("m", "root", target.embedding_weight.shape[0], tokenizer, 64, (1,), defaults or {})


def test_output_limit_defaults_and_sampling_defaults(tiny_pair) -> None:
    target, _ = tiny_pair
    chat = parse_request({"messages": [{"role": "user", "content": "x"}]}, ChatCompletionRequest, "chat")
    requested, param = chat.max_output
    prepared = prepare(chat, [5] * 10, served_model(target, defaults={"temperature": 0.3}), requested, param,
                       "messages")
    assert prepared.max_tokens == 64 - 10  # vLLM's chat default: what the context leaves
    assert prepared.sampling == SamplingParams(0.3, 1.0, 0) and prepared.rules.token_ids == frozenset({1})
    completion = parse_request({"prompt": [5], "temperature": 0, "top_k": -1, "ignore_eos": True,
                                "stop_token_ids": [7, 1]}, CompletionRequest, "completion")
    prepared = prepare(completion, [5], served_model(target), completion.max_tokens, "max_tokens", "prompt")
    assert prepared.max_tokens == 16 and prepared.sampling == SamplingParams(0.0, 1.0, 0)
    assert prepared.rules.token_ids == frozenset({7, 1}) and prepared.rules.reported_ids == frozenset({7})
    with pytest.raises(ApiError, match="`max_tokens`=60 plus the prompt's 10 tokens exceeds --max-model-len 64"):
        prepare(completion, [5] * 10, served_model(target), 60, "max_tokens", "prompt")


def test_generation_config_sampling_values_win_over_openais_defaults() -> None:
    from transformers import GenerationConfig

    class Model:
        generation_config = GenerationConfig(temperature=0.6, top_p=0.9, max_new_tokens=12)

    assert generation_defaults(Model()) == {"temperature": 0.6, "top_p": 0.9}


def families(text: str) -> dict[str, tuple[str, str, set[tuple[str, tuple[str, ...]]], set[str]]]:
    """vllm: metric families -> (type, help, {(sample name, label names)}, histogram bounds)."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:"):
            shapes = {(s.name, tuple(sorted(k for k in s.labels if k not in ("le", "position")))) for s in family.samples}
            bounds = {s.labels["le"] for s in family.samples if "le" in s.labels}
            out[family.name] = (family.type, family.documentation, shapes, bounds)
    return out


def test_every_metric_we_export_is_vllms_own() -> None:
    """Same names, types, help, labels and buckets as vLLM 0.33's PrometheusStatLogger wrote them (the recorded
    exposition of benchmarks/engine_conformance.py, a DFlash deployment with max_model_len in 2000..4999)."""
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "engines" / "vllm_0.33.0_dflash_dp2_metrics_after.txt"
    vllm = families(fixture.read_text())
    ours = families(ServeMetrics("Qwen/Qwen3.6-27B", 2048, 15).exposition()[0].decode())
    assert len(ours) >= 20
    for name, family in ours.items():
        assert family == vllm[name], name


def test_the_engines_busy_time_is_exposed_by_method_and_by_batch() -> None:
    from blockdraft.serve.messages import EngineTime

    metrics = ServeMetrics("m", 2048, 15)
    metrics.engine_time(EngineTime(0.5, {"dflash/15": [0.004, 0.3], "ar": [0.002]}, {"dflash/15": [(3, 0.3)]},
                                   {("dflash/15", "33-64"): (2, 0.304, 200), ("ar", "1"): (1, 0.002, 1)}))
    metrics.engine_time(EngineTime(0.25, {"dflash/15": [0.006]}, {"dflash/15": [(1, 0.006)]},
                                   {("dflash/15", "33-64"): (1, 0.006, 90)}))
    samples = {(s.name, s.labels.get("method"), s.labels.get("le")): s.value
               for family in text_string_to_metric_families(metrics.exposition()[0].decode())
               if family.name.startswith("blockdraft:") for s in family.samples}
    assert samples[("blockdraft:engine_admit_seconds_total", None, None)] == 0.75
    assert samples[("blockdraft:engine_step_seconds_count", "dflash/15", None)] == 3
    assert samples[("blockdraft:engine_step_seconds_sum", "dflash/15", None)] == pytest.approx(0.31)
    assert samples[("blockdraft:engine_step_seconds_bucket", "dflash/15", "0.25")] == 2
    assert samples[("blockdraft:engine_step_seconds_count", "ar", None)] == 1
    assert samples[("blockdraft:engine_capturing_step_seconds_count", "dflash/15", None)] == 2
    assert samples[("blockdraft:engine_capturing_step_seconds_sum", "dflash/15", None)] == pytest.approx(0.306)
    assert samples[("blockdraft:engine_graph_captures_total", "dflash/15", None)] == 4
    assert ("blockdraft:engine_graph_captures_total", "ar", None) not in samples
    by_batch = {(s.name, s.labels["method"], s.labels["batch"]): s.value
                for family in text_string_to_metric_families(metrics.exposition()[0].decode())
                if family.name.startswith("blockdraft:engine_batch") for s in family.samples}
    assert by_batch[("blockdraft:engine_batch_steps_total", "dflash/15", "33-64")] == 3
    assert by_batch[("blockdraft:engine_batch_step_seconds_total", "dflash/15", "33-64")] == pytest.approx(0.31)
    assert by_batch[("blockdraft:engine_batch_step_tokens_total", "dflash/15", "33-64")] == 290
    assert by_batch[("blockdraft:engine_batch_step_tokens_total", "ar", "1")] == 1


def test_a_slow_step_is_named_with_what_it_did(monkeypatch) -> None:
    """A step over SLOW_STEP_S gets a line with the graphs it captured and the compilations it ran, at most one line
    per SAY_EVERY_S (the others counted in the next); every step still reaches the report."""
    from blockdraft.serve import engine_clock
    from blockdraft.serve.engine_clock import EngineClock
    from blockdraft.serve.messages import EngineTime

    now = [100.0]
    monkeypatch.setattr(engine_clock.time, "monotonic", lambda: now[0])
    captured = [3]
    monkeypatch.setattr(engine_clock, "graphs_captured", lambda: captured[0])
    monkeypatch.setattr(engine_clock, "compilations", lambda: 7)
    said: list[str] = []
    reports: list[EngineTime] = []
    clock = EngineClock(reports.append, said.append)
    for seconds, graphs, later in ((0.01, 0, 0.1), (2.5, 4, 0.1), (0.4, 0, 1.0), (0.3, 1, 5.0), (0.5, 2, 0.1)):
        clock.starting_step()
        captured[0] += graphs
        clock.stepped("ddtree@32", 4, seconds, 3)
        now[0] += later
    clock.flush(force=True)
    assert said == [
        "slow step: 2.50 s at batch 4 running ddtree@32 (4 CUDA graphs captured, 0 torch.compile compilations in it)",
        "slow step: 0.50 s at batch 4 running ddtree@32 (2 CUDA graphs captured, 0 torch.compile compilations in it; "
        "2 more over 0.25 s since the last such line)",
    ]
    assert reports == [EngineTime(0.0, {"ddtree@32": [0.01, 2.5, 0.4, 0.3, 0.5]},
                                  {"ddtree@32": [(4, 2.5), (1, 0.3), (2, 0.5)]},
                                  {("ddtree@32", "3-4"): (5, pytest.approx(3.71), 15)})]


def test_outbox_sends_the_first_and_final_events_at_once_and_batches_the_rest() -> None:
    import pickle

    from blockdraft.serve.jobs import Failed, Progress
    from blockdraft.serve.messages import JobEvents
    from blockdraft.serve.relay import Outbox

    def sent_batches(interval: float) -> tuple[list[list[str]], int]:
        sent: list[JobEvents] = []
        finals: list[int] = []
        emit = Outbox(lambda reply: sent.append(pickle.loads(pickle.dumps(reply))), interval).emitter(
            7, lambda: finals.append(7))
        for i in range(5):
            emit(Progress(str(i), [i]))
        emit(Failed(ApiError(429, "end", "model", {"Retry-After": "3"})))
        assert all(reply.job_id == 7 for reply in sent) and finals == [7]
        error = sent[-1].events[-1].error
        assert (error.status, error.message, error.param, error.headers) == (429, "end", "model", {"Retry-After": "3"})
        return [[e.text if isinstance(e, Progress) else "end" for e in reply.events] for reply in sent], len(finals)

    assert sent_batches(3600.0) == ([["0"], ["1", "2", "3", "4", "end"]], 1)
    assert sent_batches(0.0) == ([["0"], ["1"], ["2"], ["3"], ["4"], ["end"]], 1)


def test_event_relay_delivers_batches_pushed_from_another_thread_in_order() -> None:
    import asyncio
    import threading

    from blockdraft.serve.jobs import Failed, Progress
    from blockdraft.serve.relay import EventRelay

    async def received() -> list[str]:
        relay = EventRelay(asyncio.get_running_loop())

        def produce() -> None:
            for i in range(0, 6, 2):
                relay.push([Progress(str(i), [i]), Progress(str(i + 1), [i + 1])])
            relay.push([Failed(ApiError(500, "end"))])

        thread = threading.Thread(target=produce)
        thread.start()
        texts = [e.text if isinstance(e, Progress) else "end" async for batch in relay.batches() for e in batch]
        thread.join()
        return texts

    assert asyncio.run(received()) == ["0", "1", "2", "3", "4", "5", "end"]


# The decoding thread


def test_waiting_jobs_join_together_and_a_bad_one_gets_its_own_400() -> None:
    """The worker admits every job waiting at a step boundary in one group (prefilled together by the batched
    engine); one that cannot run gets a 400 naming why, the others their batch-1 ids, each exactly one final
    event. The engine's clock hears the admission and every step, by method."""
    import threading

    from blockdraft.fast.target import FastTarget
    from blockdraft.serve.batched import BatchedEngine
    from blockdraft.serve.engine_clock import EngineClock
    from blockdraft.serve.jobs import Failed, Finished, Job, JobSpec
    from blockdraft.serve.messages import EngineTime
    from blockdraft.serve.worker import Worker

    target = FastTarget(make_target_model("qwen3"))
    drafter = make_drafter("all_full")
    engine = BatchedEngine(target, lambda: build_proposer("dflash", target, drafter, None, 3), None, 4)
    groups: list[int] = []
    admit = engine.admit

    def counting_admit(jobs) -> None:  # noqa: ANN001
        groups.append(len(jobs))
        admit(jobs)

    engine.admit = counting_admit  # type: ignore[method-assign]
    steps = [0]
    step = engine.step

    def counting_step() -> tuple[str, int]:
        steps[0] += 1
        return step()

    engine.step = counting_step  # type: ignore[method-assign]
    finals: dict[int, list] = {}
    done = threading.Event()
    prompts = [[1, 2, 3], [VOCAB + 3], [4, 5, 6, 7, 8], [9]]

    def emitter(job_id: int):  # noqa: ANN202
        def emit(event) -> None:  # noqa: ANN001
            if isinstance(event, (Finished, Failed)):
                finals.setdefault(job_id, []).append(event)
                if len(finals) == len(prompts):
                    done.set()
        return emit

    reports: list[EngineTime] = []
    worker = Worker(engine, lambda job: None, EngineClock(reports.append))
    jobs = [Job(JobSpec(i, ids, 12, SamplingParams(), 0, StopRules(), 0.0), emitter(i)) for i, ids in enumerate(prompts)]
    for job in jobs:  # queued before the thread starts: all four wait together
        worker.submit(job)
    worker.start()
    assert done.wait(120)
    worker.stop()
    assert groups == [4]
    assert sum(r.admit_s for r in reports) > 0 and {m for r in reports for m in r.steps} == {"dflash"}
    step_seconds = [s for r in reports for s in r.steps["dflash"]]
    assert len(step_seconds) == steps[0] > 0 and min(step_seconds) > 0
    by_batch = [(key, counts) for r in reports for key, counts in r.by_batch.items()]
    assert sum(n for _, (n, _, _) in by_batch) == steps[0] and {method for (method, _), _ in by_batch} == {"dflash"}
    assert {batch for (_, batch), _ in by_batch} <= {"1", "2", "3-4"}
    committed = sum(tokens for _, (_, _, tokens) in by_batch)  # every token after each request's first (prefill's)
    assert committed == sum(len(finals[i][0].output.token_ids) - 1 for i in (0, 2, 3))
    assert all(len(events) == 1 for events in finals.values())
    error = finals[1][0]
    assert isinstance(error, Failed) and error.error.status == 400 and f"id {VOCAB + 3}" in error.error.message
    for i in (0, 2, 3):
        output = finals[i][0].output
        assert output.token_ids == generate(target, prompts[i], build_proposer("dflash", target, drafter, None, 3),
                                            12).token_ids


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_the_warm_up_decodes_full_depth_drafts_at_two_capacities_where_graphs_are_captured(monkeypatch,
                                                                                          graphs: bool) -> None:
    """With CUDA graphs the warm-up reserves K/V for --max-model-len, then its decodes reach a whole block's draft
    (the usual verify shape) and a context past the first capacity step at every batch bucket: both shapes were
    otherwise captured by the first requests. (Joins recorded, not run: a CPU cannot capture graphs.)"""
    from blockdraft.fast.target import FastTarget
    from blockdraft.fast.static_cache import SLOT_STEP
    from blockdraft.serve.batched import BatchedEngine

    target = FastTarget(make_target_model("qwen3"))
    drafter = make_drafter()
    engine = BatchedEngine(target, lambda: build_proposer("dflash", target, drafter, None), None, 4,
                           max_model_len=300)
    monkeypatch.setattr(target, "use_graphs", graphs)
    reserved: list[int] = []
    monkeypatch.setattr(engine.decoder, "reserve", reserved.append)
    monkeypatch.setattr(target, "warm_prefill", lambda tap_layers: None)
    joined: list[tuple[int, int, int]] = []
    monkeypatch.setattr(engine.decoder, "join_many", lambda requests: joined.append(
        (len(requests), len(requests[0].prompt_ids), requests[0].max_new_tokens)) or [])
    prompt = [3, 4, 5, 6, 7]
    engine.warm_up(prompt)
    block = drafter.cfg.block_size
    lengths = [SLOT_STEP, len(prompt)] if graphs else [len(prompt)]  # the longer first: buffers grow before captures
    tokens = 2 * block if graphs else 4
    assert joined == [(size, length, tokens) for length in lengths for size in (1, 2, 4)]
    assert reserved == ([300 + SLOT_STEP] if graphs else [])  # K/V for --max-model-len, before any capture


@pytest.mark.parametrize("max_model_len, bound", [(300, 300), (None, 512), (100_000, 512)])
def test_the_sequential_warm_up_warms_every_decode_graph_up_to_its_bound(
        monkeypatch, max_model_len: int | None, bound: int) -> None:
    """A sequential server warms the decode of contexts up to min(--max-model-len, the target's 512 positions,
    WARM_POSITIONS): no capture mid-decode within them."""
    from blockdraft.fast.target import FastTarget
    from blockdraft.serve import sequential

    target = FastTarget(make_target_model("qwen3"))
    proposer = build_proposer("ddtree", target, make_drafter(), 6)
    calls: list[tuple[object, int]] = []
    monkeypatch.setattr(sequential, "warm_decode", lambda t, p, positions, say: calls.append((p, positions)) or 0)
    sequential.SequentialEngine(target, proposer, None, max_model_len).warm_up([3, 4, 5])
    assert calls == [(proposer, bound)]



@pytest.fixture(scope="module")
def embedded_tokenizer(converted):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_streamed_text_is_the_decode_of_the_ids_stepped_or_windowed(embedded_tokenizer, data) -> None:
    """The embedded tokenizer (byte-level BPE: characters split across tokens), random ids and real multi-byte text,
    committed in chunks of 1-7: the released pieces plus the finish are `decode(ids)` exactly, through the
    tokenizers library's `DecodeStream` (the path a fast tokenizer takes) and through the windowed decodes."""
    tokenizer = embedded_tokenizer
    base = tokenizer("héllo wörld 日本語 🙂🚀 naïve — “quotes” ½")["input_ids"]
    ids = data.draw(st.one_of(
        st.lists(st.integers(0, tokenizer.vocab_size - 1), min_size=1, max_size=30),
        st.integers(0, len(base) - 1).map(lambda start: base[start:]),
    ))
    chunk = data.draw(st.integers(1, 7))
    for stepped in (True, False):
        output = OutputText(tokenizer, StopRules())
        assert output._stream is not None
        if not stepped:
            output._stream = None
        pieces = [output.push(ids[i:i + chunk])[0] for i in range(0, len(ids), chunk)]
        assert "".join(pieces) + output.finish("length") == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_schedule_is_auto_by_default_only_on_a_gpu_with_batching_a_drafter_and_no_method() -> None:
    """`blockdraft serve` with no --schedule measures one where it was measured to pay (the fast engine on a GPU,
    continuous batching, a drafter) unless --method asks for one method; a given --schedule always wins."""
    from dataclasses import replace

    from blockdraft.serve.engine_process import schedule_choice
    from blockdraft.serve.settings import ServeSettings

    default = ServeSettings()
    assert default.served_method == "ddtree" and replace(default, method="ar").served_method == "ar"
    assert schedule_choice(default, 64, True, True) == "auto"
    assert [schedule_choice(default, 1, True, True), schedule_choice(default, 64, False, True),
            schedule_choice(default, 64, True, False)] == ["off"] * 3
    assert schedule_choice(replace(default, method="ddtree"), 64, True, True) == "off"
    assert schedule_choice(replace(default, schedule="off"), 64, True, True) == "off"
    assert schedule_choice(replace(default, method="dflash", schedule="tune/schedule.json"), 1, False, False) == \
        "tune/schedule.json"
