"""A validated request -> the job the decoder runs: prompt ids, output limit, sampling, stops. Everything a client
can get wrong that needs the model (its vocabulary, context length, chat template) is a 400 naming the field here,
before the request takes a place in the queue.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from blockdraft.decoding.generate import check_prompt_ids
from blockdraft.decoding.grammar import GrammarSpec
from blockdraft.decoding.penalties import Penalties
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.errors import BlockdraftError
from blockdraft.prompting import encode_messages, encode_text
from blockdraft.serve.errors import ApiError
from blockdraft.serve.structured import grammar_spec
from blockdraft.serve.tools import ToolPlan, tool_plan
from blockdraft.serve.output import StopRules
from blockdraft.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

# OpenAI's defaults when neither the request nor the target's generation_config sets one (vLLM's order).
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                   "frequency_penalty": 0.0}


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the served name, the target it came from, its tokenizer, vocabulary
    (embedding rows), limits and sampling defaults."""

    name: str
    root: str
    vocab_size: int
    tokenizer: Any
    max_model_len: int
    eos_ids: tuple[int, ...]
    sampling_defaults: dict[str, float]
    synthetic: bool = False  # --synthetic-acceptance: greedy requests only

    def check_model(self, requested: str | None) -> None:
        """A request for another model is a 404, as in vLLM (a missing `model` means this one)."""
        if requested is not None and requested != self.name:
            raise ApiError(404, f"The model `{requested}` does not exist. Valid aliases: {self.name}.", "model")


@dataclass(frozen=True)
class Prepared:
    """A request ready to queue."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int
    rules: StopRules
    grammar: GrammarSpec | None = None
    prompt_logprobs: int | None = None  # completions' `echo` with `logprobs`: the prompt's, with this many candidates


def generation_defaults(model: Any) -> dict[str, float]:
    """temperature / top_p / top_k and the penalties the target's generation_config.json sets explicitly (vLLM's
    `--generation-config auto`), which win over OpenAI's defaults."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    diff = config.to_diff_dict()
    return {k: diff[k] for k in OPENAI_DEFAULTS if isinstance(diff.get(k), (int, float))}


def chat_tools(req: ChatCompletionRequest, served: ServedModel) -> ToolPlan | None:
    """The request's tools and tool_choice, checked against the target's chat template (serve/tools.py)."""
    return tool_plan(req.tool_list(), req.tool_choice_value(), getattr(served.tokenizer, "chat_template", None),
                     req.parallel_tool_calls)


def chat_prompt(req: ChatCompletionRequest, served: ServedModel, tools: ToolPlan | None = None) -> list[int]:
    """Messages (and the tools) through the target's chat template, exactly as `blockdraft generate --messages`
    does."""
    thinking = req.chat_template_kwargs.enable_thinking if req.chat_template_kwargs else False
    try:
        return encode_messages([m.as_template_message() for m in req.messages], served.tokenizer, thinking,
                               None if tools is None else tools.template_tools())
    except BlockdraftError as exc:
        raise ApiError(400, str(exc), "messages") from None


def completion_prompt(req: CompletionRequest, served: ServedModel) -> list[int]:
    """Text through the tokenizer as `generate --prompt` does, or token ids as given (checked against the vocab)."""
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        try:
            ids = encode_text(prompt, served.tokenizer)
        except BlockdraftError as exc:
            raise ApiError(400, str(exc), "prompt") from None
    else:
        ids = list(prompt)
    try:
        check_prompt_ids(served.vocab_size, ids)
    except BlockdraftError as exc:
        raise ApiError(400, str(exc), "prompt") from None
    return ids


def echoed_prompt(req: CompletionRequest, ids: list[int], served: ServedModel) -> str:
    """The text `echo` puts before the output, as vLLM: the prompt as sent, token ids decoded (nothing with
    `return_token_ids`, whose prompt_token_ids say it)."""
    if req.return_token_ids:
        return ""
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        return prompt
    if served.tokenizer is None:
        raise ApiError(400, "`echo` of token ids needs a tokenizer and this target has none; send "
                       "`return_token_ids` instead", "echo")
    return served.tokenizer.decode(ids)


def _sampling(req: SamplingRequest, served: ServedModel) -> SamplingParams:
    def pick(name: str) -> Any:
        value = getattr(req, name)
        return value if value is not None else served.sampling_defaults.get(name, OPENAI_DEFAULTS[name])

    sampling = SamplingParams(float(pick("temperature")), float(pick("top_p")), max(int(pick("top_k")), 0),
                              req.logprobs_asked, _penalties(req, served, pick))
    if served.synthetic and not sampling.greedy:
        raise ApiError(400, f"`temperature` {sampling.temperature:g}: this server dials its acceptance "
                       "(--synthetic-acceptance, benchmarks only) and decodes at temperature 0; send 0 or leave it "
                       "out", "temperature")
    return sampling


def _penalties(req: SamplingRequest, served: ServedModel, pick: Any) -> Penalties:
    """vLLM's penalty parameters (the target's generation_config defaults where the request leaves them out, as
    vLLM's repetition_penalty): the logit bias's ids checked against the vocabulary, each bad word tokenized alone
    and with a leading space (vLLM's rule: the spaced form only where it is a different token sequence of the same
    length)."""
    bias: list[tuple[int, float]] = []
    for key, value in (req.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < served.vocab_size:
            raise ApiError(400, f"`logit_bias` key {key!r} is not a token id of this target "
                           f"(0..{served.vocab_size - 1})", "logit_bias")
        bias.append((int(key), min(100.0, max(-100.0, value))))
    words: list[tuple[int, ...]] = []
    for word in req.bad_words or []:
        if served.tokenizer is None:
            raise ApiError(400, "`bad_words` needs a tokenizer and this target has none", "bad_words")
        plain = tuple(served.tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ApiError(400, f"`bad_words` entry {word!r} tokenizes to no token", "bad_words")
        words.append(plain)
        spaced = tuple(served.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            words.append(spaced)
    min_tokens = req.min_tokens or 0
    if req.max_tokens is not None and min_tokens > req.max_tokens:
        raise ApiError(400, f"`min_tokens`={min_tokens} must be at most `max_tokens`={req.max_tokens}", "min_tokens")
    return Penalties(frequency=float(pick("frequency_penalty")), presence=float(pick("presence_penalty")),
                     repetition=float(pick("repetition_penalty")), logit_bias=tuple(bias), min_tokens=min_tokens,
                     bad_words=tuple(words))


def _rules(req: SamplingRequest, served: ServedModel) -> StopRules:
    strings = tuple(req.stop_strings)
    if any(not s for s in strings):
        raise ApiError(400, "`stop` holds an empty string; every stop string needs at least one character", "stop")
    if strings and served.tokenizer is None:
        raise ApiError(400, "`stop` strings need a tokenizer and this target has none; use `stop_token_ids`", "stop")
    user_ids = list(req.stop_token_ids or [])
    vocab = served.vocab_size
    bad = next((t for t in user_ids if t >= vocab), None)
    if bad is not None:
        raise ApiError(
            400, f"`stop_token_ids` holds {bad}, outside the target's vocabulary of {vocab} ids (0..{vocab - 1})",
            "stop_token_ids",
        )
    eos = () if req.ignore_eos else served.eos_ids
    return StopRules(frozenset(user_ids) | frozenset(eos), frozenset(user_ids) - frozenset(served.eos_ids), strings)


def prepare(
    req: SamplingRequest, prompt_ids: list[int], served: ServedModel, requested: int | None, param: str,
    prompt_param: str, tools: ToolPlan | None = None,
) -> Prepared:
    """Check the prompt and output against --max-model-len and build the job's settings (the model name is
    checked first, by the caller, so an unknown model is a 404 whatever else is wrong).

    `requested` is the client's output limit from `param` (None: what is left of the context, vLLM's chat default).
    """
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "`stream_options` is only allowed with `stream`: true", "stream_options")
    if not prompt_ids:
        raise ApiError(400, f"`{prompt_param}` encodes to no tokens; give at least one", prompt_param)
    room = served.max_model_len - len(prompt_ids)
    if room < 1:
        raise ApiError(
            400, f"the prompt has {len(prompt_ids)} tokens and this server's --max-model-len is "
            f"{served.max_model_len}, which leaves no room for output; shorten `{prompt_param}`", prompt_param,
        )
    max_tokens = room if requested is None else requested
    if max_tokens > room:
        raise ApiError(
            400, f"`{param}`={max_tokens} plus the prompt's {len(prompt_ids)} tokens exceeds --max-model-len "
            f"{served.max_model_len}; ask for at most {room}", param,
        )
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    grammar = grammar_spec(req.response_format, req.structured_outputs, served.tokenizer)
    forced = None if tools is None else tools.grammar()
    if forced is not None:
        if grammar is not None:
            raise ApiError(400, "`tool_choice` required or named is enforced by a grammar of its own; leave out "
                           "`response_format` / `structured_outputs`, or send tool_choice auto", "tool_choice")
        if served.tokenizer is None:
            raise ApiError(400, "tool calls need a tokenizer and this target has none", "tool_choice")
        grammar = forced
    sampling = _sampling(req, served)
    echoed = sampling.logprobs if getattr(req, "echo", False) else None
    return Prepared(prompt_ids, max_tokens, sampling, seed, _rules(req, served), grammar, echoed)
