"""`blockdraft serve` end to end on the real embedded pair: the self-check passes against the shipped drafter's
recorded figures, and a chat request at T=0 gives `generate`'s ids (the same loop, DDTree at the CPU sizes)."""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest
from serve_support import running, settings

from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.pair import EMBEDDED_DRAFTER, Loaded
from blockdraft.prompting import encode_messages

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]


def test_embedded_pair_serves_generates_ids_after_passing_its_self_check(converted: Path) -> None:
    said: list[str] = []
    with running(settings(converted, EMBEDDED_DRAFTER, self_check=True, served_model_name="smol"), said.append) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=24, temperature=0,
                                               extra_body={"return_token_ids": True})
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smol", messages=MESSAGES, max_tokens=24, temperature=0, stream=True))
    assert any(line.startswith("self-check passed") and "probe.json" in line for line in said), said
    assert any("trees of 4 nodes, 3 drafted tokens deep on cpu" in line and "(loaded in " in line for line in said)
    assert any(re.fullmatch(r"warmed up in \d+\.\d s", line) for line in said), said  # start-up, phase by phase
    assert any(re.fullmatch(r"engine started in [\d.]+ s: loading [\d.]+ s, self-check [\d.]+ s, warm-up [\d.]+ s, "
                            r"the rest [\d.]+ s; of it no compiling, timing or capturing", line) for line in said), said
    loaded = Loaded(str(converted), str(EMBEDDED_DRAFTER), "cpu", None)
    ids = encode_messages(MESSAGES, loaded.tokenizer)
    proposer = build_proposer("ddtree", loaded.target, loaded.drafter, 4, 3)
    expected = generate(loaded.target, ids, proposer, 24, stop_token_ids=loaded.stops([], False))
    choice = reply.choices[0]
    assert choice.token_ids == expected.token_ids and reply.usage.prompt_tokens == len(ids)
    assert choice.message.content == streamed == loaded.decode(expected.token_ids)
    assert reply.metrics["speculative_decoding"]["acceptance_lengths"] == expected.acceptance_lengths
