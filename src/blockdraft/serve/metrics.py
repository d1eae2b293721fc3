"""/metrics in vLLM 0.33's names, labels and buckets, so vLLM dashboards and `blockdraft doctor server` read us.

Sources in the vLLM wheel: v1/metrics/loggers.py (PrometheusStatLogger: labels `model_name` and `engine`, request
gauges, token counters, `request_success{finished_reason}`, latency histograms), v1/metrics/buckets.py (bucket
bounds), v1/spec_decode/metrics.py (SpecDecodingProm: drafts, draft tokens, accepted tokens and the per-position
counter, each position pre-created). Counts follow vLLM's: a draft is a verify step with a non-empty draft,
accepted tokens exclude the bonus, per-position counts are unconditional (position i counts a step whose accepted
run reached it). Generation tokens are what the loop produced (vLLM counts engine output before stop-string
trimming); usage in a response counts the tokens kept.

Ours beside them, under `blockdraft:` (vLLM has no equivalent): the engine's busy time (serve/engine_clock.py), each
batched decode step's seconds by the method it ran and the seconds spent admitting requests.
"""

from __future__ import annotations

from itertools import pairwise

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from blockdraft.synthetic_acceptance import METRIC as SYNTHETIC_METRIC
from blockdraft.serve.engine_clock import SLOW_STEP_S
from blockdraft.serve.jobs import JobOutput, Timing
from blockdraft.serve.messages import EngineTime

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM v1/engine FINISH_REASON_STRINGS
ENGINE = "0"

REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, SLOW_STEP_S, 0.5, 1.0, 2.5, 5.0, 10.0)  # stalls countable
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def token_buckets(max_model_len: int) -> list[float]:
    """vLLM's request_tokens family: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class ServeMetrics:
    """One registry per server (tests run several in a process); `num_spec_tokens` None serves no spec counters,
    as vLLM without a speculative config."""

    def __init__(self, model_name: str, max_model_len: int, num_spec_tokens: int | None,
                 synthetic_length: float | None = None) -> None:
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        labels, values = ["model_name", "engine"], (model_name, ENGINE)
        self._values = values
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(*values)

        tokens = token_buckets(max_model_len)
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*labels, "finished_reason"], registry=reg)
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        rejections = Counter(
            "vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"], registry=reg,
        )
        self.rejections = rejections.labels(model_name, "max_num_queued_reqs")
        rejections.labels(model_name, "max_num_queued_tokens")  # vLLM shows both reasons; we never reject by tokens
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.step_seconds = Histogram(
            "blockdraft:engine_step_seconds", "Seconds of each batched decode step, by the method it ran.",
            [*labels, "method"], buckets=STEP_BUCKETS, registry=reg)
        self.capturing_step_seconds = Histogram(
            "blockdraft:engine_capturing_step_seconds", "Seconds of each decode step that captured CUDA graphs (a new "
            "batch size, row count or context length), by the method it ran; also counted in engine_step_seconds.",
            [*labels, "method"], buckets=STEP_BUCKETS, registry=reg)
        self.graph_captures = Counter("blockdraft:engine_graph_captures", "CUDA graphs captured by decode steps.",
                                      [*labels, "method"], registry=reg)
        by_batch = [*labels, "method", "batch"]
        self.batch_steps = Counter("blockdraft:engine_batch_steps", "Decode steps by the method they ran and their "
                                   "batch-size bucket (1, 2, 3-4, ...: the measured schedule's).", by_batch,
                                   registry=reg)
        self.batch_step_seconds = Counter("blockdraft:engine_batch_step_seconds", "Seconds of decode steps by method "
                                          "and batch-size bucket.", by_batch, registry=reg)
        self.batch_step_tokens = Counter("blockdraft:engine_batch_step_tokens", "Tokens committed by decode steps, "
                                         "by method and batch-size bucket.", by_batch, registry=reg)
        self.admit_seconds = counter("blockdraft:engine_admit_seconds",
                                     "Seconds the engine spent admitting requests (prefill, joining the batch; "
                                     "with --max-num-seqs 1, a request's whole decode).")
        self.spec: tuple[Counter, Counter, Counter, list[Counter]] | None = None
        if num_spec_tokens:
            # dialled acceptance (benchmarks only) counts under a label of its own: never mistaken for a drafter's
            spec_labels, spec_values = (labels, values) if synthetic_length is None else (
                [*labels, "acceptance"], (*values, "synthetic"))

            def spec_counter(name: str, doc: str) -> Counter:
                return Counter(name, doc, spec_labels, registry=reg).labels(*spec_values)

            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                              [*spec_labels, "position"], registry=reg)
            self.spec = (
                spec_counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                spec_counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                spec_counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
                [per_pos.labels(*spec_values, str(i)) for i in range(num_spec_tokens)],
            )
        if synthetic_length is not None:
            gauge(SYNTHETIC_METRIC, "Benchmarks only: the mean tokens a chain step commits under the dialled "
                  "acceptance (--synthetic-acceptance); the spec_decode counters count the dial, not the drafter."
                  ).set(synthetic_length)

    def exposition(self) -> tuple[bytes, str]:
        """The text a Prometheus scrape gets, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def reject(self) -> None:
        self.rejections.inc()

    def engine_time(self, report: EngineTime) -> None:
        """The engine's busy time since its last report."""
        self.admit_seconds.inc(report.admit_s)
        for method, seconds in report.steps.items():
            histogram = self.step_seconds.labels(*self._values, method)
            for value in seconds:
                histogram.observe(value)
        for method, steps in report.captures.items():
            capturing = self.capturing_step_seconds.labels(*self._values, method)
            for _, value in steps:
                capturing.observe(value)
            self.graph_captures.labels(*self._values, method).inc(sum(graphs for graphs, _ in steps))
        for (method, batch), (steps_n, seconds_sum, tokens) in report.by_batch.items():
            self.batch_steps.labels(*self._values, method, batch).inc(steps_n)
            self.batch_step_seconds.labels(*self._values, method, batch).inc(seconds_sum)
            self.batch_step_tokens.labels(*self._values, method, batch).inc(tokens)

    def abandoned(self, timing: Timing, reason: str) -> None:
        """A request that ended without decoding (client gone while queued, drain deadline, an error)."""
        self.success[reason].inc()
        if timing.finished is not None:
            self.e2e.observe(timing.finished - timing.arrival)

    def finished(self, output: JobOutput, prompt_tokens: int, max_tokens: int) -> None:
        """Everything vLLM records for one finished request, and its verify steps' acceptance."""
        result, t = output.result, output.timing
        generated = len(result.token_ids)
        self.success[output.finish_reason].inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated)
        self.max_generation_tokens.observe(max_tokens)
        self.params_max_tokens.observe(max_tokens)
        self.params_n.observe(1)
        self.iteration_tokens.observe(prompt_tokens + 1)
        for length in result.acceptance_lengths:
            self.iteration_tokens.observe(length)
        if t.commits and t.scheduled is not None and t.finished is not None:
            first, last = t.commits[0], t.commits[-1]
            self.ttft.observe(first - t.arrival)
            for earlier, later in pairwise(t.commits):
                self.itl.observe(later - earlier)
            self.tpot.observe((last - first) / (generated - 1) if generated > 1 else 0.0)
            self.e2e.observe(t.finished - t.arrival)
            self.queue_time.observe(t.scheduled - t.arrival)
            self.prefill_time.observe(first - t.scheduled)
            self.decode_time.observe(last - first)
            self.inference_time.observe(last - t.scheduled)
        if self.spec is not None:
            drafts, draft_tokens, accepted, per_pos = self.spec
            for drafted, kept in result.drafted_steps():
                drafts.inc()
                draft_tokens.inc(drafted)
                accepted.inc(kept)
                for position in range(min(kept, len(per_pos))):
                    per_pos[position].inc()
