"""Parsing vLLM / SGLang metrics, vLLM's SpecDecoding log line, and typed numbers into Fingerprints."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockdraft.doctor.fingerprint import Fingerprint, ProbeResult, parse_number_list, rate_from_tau
from blockdraft.doctor.log_line import parse_spec_decoding_log
from blockdraft.doctor.server_metrics import (
    detect_engine,
    parse_samples,
    parse_server_info,
    parse_sglang_metrics,
    parse_vllm_metrics,
    vllm_recent,
    vllm_window,
)
from blockdraft.errors import BlockdraftError

QWEN = "Qwen/Qwen3-8B"
LORA = "qwen3-8b-lora"

# (engine, model_name) -> (drafts, draft_tokens, accepted_per_position); accepted = sum(per position)
BEFORE = {
    ("0", QWEN): (600, 1800, [300, 150, 60]),
    ("1", QWEN): (400, 1200, [200, 100, 40]),
    ("0", LORA): (100, 300, [10, 0, 0]),
}
AFTER = {
    ("0", QWEN): (1600, 4800, [800, 350, 110]),
    ("1", QWEN): (1400, 4200, [700, 300, 90]),
    ("0", LORA): (300, 900, [40, 0, 0]),
}

HEADER = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="Qwen/Qwen3-8B"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 9.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"} 9.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="Qwen/Qwen3-8B"} 21.5
"""


def vllm_exposition(counts: dict[tuple[str, str], tuple[int, int, list[int]]]) -> str:
    """Text as prometheus_client renders vLLM's counters: `_total` samples plus `_created` gauges."""
    families = {
        "vllm:spec_decode_num_drafts": ("Number of spec decoding drafts.", lambda c: [((), c[0])]),
        "vllm:spec_decode_num_draft_tokens": ("Number of draft tokens.", lambda c: [((), c[1])]),
        "vllm:spec_decode_num_accepted_tokens": ("Number of accepted tokens.", lambda c: [((), sum(c[2]))]),
        "vllm:spec_decode_num_accepted_tokens_per_pos": (
            "Accepted tokens per draft position.",
            lambda c: [((("position", str(i)),), n) for i, n in enumerate(c[2])],
        ),
    }
    lines = [HEADER.rstrip("\n")]
    for name, (help_text, values) in families.items():
        for suffix, kind in (("_total", "counter"), ("_created", "gauge")):
            lines += [f"# HELP {name}{suffix} {help_text}", f"# TYPE {name}{suffix} {kind}"]
            for (engine, model), c in counts.items():
                for extra, value in values(c):
                    labels = ",".join(f'{k}="{v}"' for k, v in (("engine", engine), ("model_name", model), *extra))
                    shown = 1.7559123e9 if suffix == "_created" else float(value)
                    lines.append(f"{name}{suffix}{{{labels}}} {shown!r}")
    return "\n".join(lines) + "\n"


def test_vllm_counters_sum_engines_and_models_and_skip_created_twins() -> None:
    counters = parse_vllm_metrics(vllm_exposition(BEFORE))
    assert counters.drafts == 1100
    assert counters.draft_tokens == 3300
    assert counters.accepted == 860
    assert counters.accepted_per_position == (510, 250, 100)


def test_vllm_select_one_model() -> None:
    counters = parse_vllm_metrics(vllm_exposition(BEFORE), model_name=QWEN)
    fp = counters.fingerprint("test")
    assert fp.tau == pytest.approx(1 + 850 / 1000)
    assert fp.acceptance_rate == pytest.approx(850 / 3000)
    assert fp.per_position == pytest.approx([0.5, 0.25, 0.1])
    assert fp.block_size == 4
    assert fp.num_drafts == 1000


def test_unknown_model_lists_known_ones() -> None:
    with pytest.raises(BlockdraftError, match="qwen3-8b-lora"):
        parse_vllm_metrics(vllm_exposition(BEFORE), model_name="nope")


def test_vllm_window_is_the_difference_of_two_scrapes() -> None:
    fp = vllm_window(vllm_exposition(BEFORE), vllm_exposition(AFTER), QWEN, "window")
    # QWEN deltas: drafts 2000, draft tokens 6000, per position [1000, 400, 100] -> accepted 1500
    assert fp.tau == pytest.approx(1.75)
    assert fp.acceptance_rate == pytest.approx(0.25)
    assert fp.per_position == pytest.approx([0.5, 0.2, 0.05])
    assert fp.tau == pytest.approx(1 + sum(fp.per_position))


def test_counter_reset_is_a_clear_error() -> None:
    with pytest.raises(BlockdraftError, match="went down"):
        vllm_window(vllm_exposition(AFTER), vllm_exposition(BEFORE), None, "window")


def test_idle_window_is_a_clear_error() -> None:
    text = vllm_exposition(BEFORE)
    with pytest.raises(BlockdraftError, match="no speculative drafts"):
        vllm_window(text, text, None, "window")


def test_an_idle_window_on_a_server_that_had_traffic_reads_its_totals_since_start() -> None:
    """`doctor server` on a server idle while it measures: the counters' totals since start, and the source says so;
    a window with drafts is the window; a server that never drafted is still the clear error."""
    text = vllm_exposition(AFTER)
    fp = vllm_recent([text, text], QWEN, "window", "totals since start")
    # QWEN totals: drafts 3000, draft tokens 9000, per position [1500, 650, 200]
    assert fp.source.startswith("totals since start") and fp.num_drafts == 3000
    assert fp.per_position == pytest.approx([0.5, 650 / 3000, 200 / 3000])
    windowed = vllm_recent([vllm_exposition(BEFORE), text], QWEN, "window", "totals since start")
    assert windowed.source.startswith("window") and windowed.tau == pytest.approx(1.75)
    never = vllm_exposition({key: (0, 0, [0, 0, 0]) for key in AFTER})
    with pytest.raises(BlockdraftError, match="no speculative drafts"):
        vllm_recent([never, never], None, "window", "totals since start")


def test_vllm_without_speculative_decoding() -> None:
    with pytest.raises(BlockdraftError, match="--speculative-config"):
        parse_vllm_metrics(HEADER)


@pytest.mark.parametrize("garbage", ["<html><body>404</body></html>", "hello world again", "vllm:x{a=1} 2"])
def test_garbage_exposition_says_what_was_expected(garbage: str) -> None:
    with pytest.raises(BlockdraftError, match="Prometheus text exposition"):
        parse_vllm_metrics(garbage)


SGLANG_LABELS = 'engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
SGLANG = f"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{dp_rank="0",{SGLANG_LABELS}}} 4.0
# HELP sglang:spec_accept_length Mean acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{{dp_rank="0",{SGLANG_LABELS}}} 5.5
sglang:spec_accept_length{{dp_rank="1",{SGLANG_LABELS}}} 5.7
# HELP sglang:spec_accept_rate Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).
# TYPE sglang:spec_accept_rate gauge
sglang:spec_accept_rate{{dp_rank="0",{SGLANG_LABELS}}} 0.3
sglang:spec_accept_rate{{dp_rank="1",{SGLANG_LABELS}}} 0.32
"""
ENGINES = Path(__file__).parent / "fixtures" / "engines"


def test_detect_engine() -> None:
    assert detect_engine(parse_samples(vllm_exposition(BEFORE), "m")) == "vllm"
    assert detect_engine(parse_samples(SGLANG, "m")) == "sglang"
    assert detect_engine(parse_samples("# HELP up x\n# TYPE up gauge\nup 1\n", "m")) is None


def test_sglang_gauges() -> None:
    fp = parse_sglang_metrics(SGLANG, model_name=QWEN)
    assert fp.tau == pytest.approx(5.6)
    assert fp.acceptance_rate == pytest.approx(0.31)
    assert fp.per_position == []
    assert "mean of 2 ranks that decoded" in fp.source and "ignored" not in fp.source


def test_sglang_idle_rank_is_not_averaged_in() -> None:
    idle = SGLANG.replace("} 5.7", "} 0.0").replace("} 0.32", "} 0.0")
    fp = parse_sglang_metrics(idle)
    assert (fp.tau, fp.acceptance_rate) == (5.5, 0.3)
    assert "mean of 1 rank that decoded, 1 idle rank(s) at 0.0 ignored" in fp.source


def test_sglang_all_ranks_idle() -> None:
    with pytest.raises(BlockdraftError, match="no speculative traffic"):
        parse_sglang_metrics(SGLANG.replace("5.5", "0.0").replace("5.7", "0.0"))


def test_sglang_real_collector_output_three_dp_ranks_one_idle() -> None:
    """SGLang 0.5.23's SchedulerMetricsCollector, one process per DP rank, collected as its /metrics does.

    Ranks (accepted tokens, verify forwards, correct drafts), 16 draft tokens: (1100, 200, 900) -> 5.5 and
    900 / (200 * 15) = 0.3; rank 1 idle (0.0); (600, 100, 500) -> 6.0 and 500 / 1500."""
    text = (ENGINES / "sglang_0.5.23_dflash_dp3_metrics.txt").read_text()
    samples = [s for s in parse_samples(text, "m") if s.name == "sglang:spec_accept_length"]
    assert {frozenset(s.labels) for s in samples} == {
        frozenset({"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank"})}
    fp = parse_sglang_metrics(text)
    assert fp.tau == pytest.approx((5.5 + 6.0) / 2)
    assert fp.acceptance_rate == pytest.approx((0.3 + 500 / 1500) / 2)
    assert "mean of 2 ranks that decoded, 1 idle rank(s) at 0.0 ignored" in fp.source


def test_sglang_real_mtp_output_reads_the_same_gauges() -> None:
    """NEXTN (MTP) on SGLang publishes the same gauges: (640 tokens, 200 forwards, 440 correct), 4 draft tokens."""
    fp = parse_sglang_metrics((ENGINES / "sglang_0.5.23_mtp_dp2_metrics.txt").read_text())
    assert fp.tau == pytest.approx(3.2)
    assert fp.acceptance_rate == pytest.approx(440 / (200 * 3))
    assert "1 idle" in fp.source


@pytest.mark.parametrize(
    "info",
    [
        {"avg_spec_accept_length": 4.0, "version": "0.4.9"},
        {"internal_states": [{"avg_spec_accept_length": 3.5}, {"avg_spec_accept_length": 4.5}], "version": "0.5"},
        {"internal_states": {"avg_spec_accept_length": 4.0, "last_gen_throughput": 88.0}},
    ],
)
def test_server_info_top_level_or_internal_states(info: dict) -> None:
    fp = parse_server_info(info)
    assert fp.tau == pytest.approx(4.0)
    assert "average since start" in fp.source


def test_server_info_rank_without_decoding() -> None:
    """0.5.23 answers internal_states per DP rank; a rank that has not decoded has no avg_spec_accept_length."""
    info = {"internal_states": [{"avg_spec_accept_length": 5.0, "last_gen_throughput": 9.0},
                                {"last_gen_throughput": 0.0}], "version": "0.5.23"}
    fp = parse_server_info(info)
    assert fp.tau == 5.0
    assert "average since start" in fp.source
    assert "mean of 1 rank that decoded, 1 DP rank(s) without it ignored" in fp.source


def test_server_info_without_acceptance() -> None:
    with pytest.raises(BlockdraftError, match="avg_spec_accept_length"):
        parse_server_info({"internal_states": [{"last_gen_throughput": 1.0}]})


REAL_BROKEN_LINE = (
    "INFO 08-12 10:31:07 [metrics.py:96] SpecDecoding metrics: Mean acceptance length: 1.14, Accepted throughput: "
    "10.60 tokens/s, Drafted throughput: 609.61 tokens/s, Accepted: 106 tokens, Drafted: 6096 tokens, "
    "Per-position acceptance rate: 0.139, 0.000, ..., Avg Draft acceptance rate: 1.7%"
)


def test_real_broken_log_line() -> None:
    fp = parse_spec_decoding_log(REAL_BROKEN_LINE)
    assert fp.tau == pytest.approx(1.14)
    assert fp.acceptance_rate == pytest.approx(106 / 6096)
    assert fp.per_position[0] == pytest.approx(0.139)
    assert fp.per_position == [0.139, 0.0]  # elided positions are not invented
    assert fp.block_size is None
    # vLLM prints no draft count; tau has 2 decimals and drafts may be shorter than K: nothing exact to recover
    assert fp.num_drafts is None


def test_full_log_line_gives_block_size_but_not_drafts() -> None:
    rates = ", ".join(["0.139"] + ["0.000"] * 7)
    fp = parse_spec_decoding_log(REAL_BROKEN_LINE.replace("0.139, 0.000, ...", rates))
    assert fp.block_size == 9
    assert len(fp.per_position) == 8
    assert fp.num_drafts is None  # 6096 / 8 would assume every draft was full length (vLLM shortens them)


def spec_line(tau: str, accepted: int, drafted: int, rates: list[str]) -> str:
    return (f"SpecDecoding metrics: Mean acceptance length: {tau}, Accepted throughput: 1.00 tokens/s, Drafted "
            f"throughput: 2.00 tokens/s, Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position "
            f"acceptance rate: {', '.join(rates)}, Avg Draft acceptance rate: {100 * accepted / drafted:.1f}%")


def test_log_lines_of_two_engines_combine_as_counts() -> None:
    """Engine 0: 100 drafts, 300 accepted of 400 (tau 4.00); engine 1: 300 drafts, 30 of 900 (tau 1.10).
    Drafts weigh in: tau = 1 + 330 / 400 = 1.825, not (4.00 + 1.10) / 2."""
    healthy = spec_line("4.00", 300, 400, ["1.000", "1.000", "1.000", "0.000"])
    broken = spec_line("1.10", 30, 900, ["0.100", "0.000", "0.000", "0.000"])
    log = "\n".join(["INFO Engine 000: Avg prompt throughput: 1.0 tokens/s", healthy,
                     "INFO Engine 001: Avg prompt throughput: 1.0 tokens/s", broken, "INFO done"])
    fp = parse_spec_decoding_log(log, "vllm.log")
    assert fp.tau == pytest.approx(1.825)
    assert fp.acceptance_rate == pytest.approx(330 / 1300)
    assert fp.per_position == pytest.approx([(100 + 30) / 400, 0.25, 0.25, 0.0])
    assert fp.num_drafts is None and fp.block_size == 5
    assert "2 vLLM SpecDecoding lines combined" in fp.source and "cannot be told apart" in fp.source


def test_log_line_at_tau_one_keeps_its_weight() -> None:
    """A line printing 1.00 (nothing accepted) still counts its drafts: at least Drafted / K of them."""
    healthy = spec_line("3.00", 200, 400, ["1.000", "1.000", "0.000", "0.000"])
    idle = spec_line("1.00", 0, 400, ["0.000"] * 4)
    fp = parse_spec_decoding_log(healthy + "\n" + idle)
    assert fp.tau == pytest.approx(1 + 200 / (100 + 100))


def test_log_lines_that_cannot_be_combined() -> None:
    full = spec_line("2.00", 10, 30, ["0.500", "0.300", "0.200"])
    with pytest.raises(BlockdraftError, match="pass one line with --line"):
        parse_spec_decoding_log(full + "\n" + REAL_BROKEN_LINE)
    wider = spec_line("2.00", 10, 40, ["0.500", "0.300", "0.200", "0.000"])
    with pytest.raises(BlockdraftError, match="mixes deployments"):
        parse_spec_decoding_log(full + "\n" + wider)


def test_real_vllm_log_two_dp_engines() -> None:
    """vLLM 0.33.0's own loggers (StatLoggerManager, DP engines 0 and 1, two intervals; K = 15).

    Drafts per (interval, engine), as (draft tokens, accepted): I1 e0 40x(15,6) 10x(15,0) 5x(7,7) 5x(3,1);
    I1 e1 20x(15,9) 20x(15,2); I2 e0 50x(15,5) 10x(10,10); I2 e1 30x(15,8) 10x(4,0). In all: 200 drafts,
    2740 draft tokens, 1090 accepted -> tau 6.45, rate 1090 / 2740 (2740 / 15 would say 182.7 drafts)."""
    text = (ENGINES / "vllm_0.33.0_dflash_dp2.log").read_text()
    assert text.count("SpecDecoding metrics:") == 4 and "Engine 001:" in text
    fp = parse_spec_decoding_log(text, "vllm.log")
    assert fp.acceptance_rate == pytest.approx(1090 / 2740)
    assert fp.tau == pytest.approx(6.45, abs=0.005)
    assert fp.block_size == 16 and fp.num_drafts is None
    assert "4 vLLM SpecDecoding lines combined" in fp.source


def test_real_vllm_log_mtp() -> None:
    """MTP (K = 3) logs the same line: 110 drafts, 320 draft tokens, 210 accepted -> tau 2.909."""
    fp = parse_spec_decoding_log((ENGINES / "vllm_0.33.0_mtp.log").read_text())
    assert fp.acceptance_rate == pytest.approx(210 / 320)
    assert fp.tau == pytest.approx(1 + 210 / 110, abs=0.005)
    assert fp.block_size == 4


def test_real_vllm_metrics_window_two_dp_engines() -> None:
    """The second interval (see the log test): 100 drafts, 1340 draft tokens, 590 accepted, per position
    [90]*5 + [40]*3 + [10]*2 + [0]*5, summed over engines 0 and 1."""
    before = (ENGINES / "vllm_0.33.0_dflash_dp2_metrics_before.txt").read_text()
    after = (ENGINES / "vllm_0.33.0_dflash_dp2_metrics_after.txt").read_text()
    assert "vllm:spec_decode_num_drafts_created" in after  # the twins a substring match would sum in
    fp = vllm_window(before, after, None, "window")
    assert fp.tau == pytest.approx(6.9)
    assert fp.acceptance_rate == pytest.approx(590 / 1340)
    assert fp.per_position == pytest.approx([c / 100 for c in [90] * 5 + [40] * 3 + [10] * 2 + [0] * 5])
    assert fp.num_drafts == 100 and fp.block_size == 16
    assert "2 engines summed" in fp.source


def test_real_vllm_metrics_mtp() -> None:
    before = (ENGINES / "vllm_0.33.0_mtp_metrics_before.txt").read_text()
    after = (ENGINES / "vllm_0.33.0_mtp_metrics_after.txt").read_text()
    fp = vllm_window(before, after, None, "window")  # 40x(3,2) 10x(3,0): 50 drafts, 150 tokens, 80 accepted
    assert (fp.tau, fp.num_drafts, fp.block_size) == (pytest.approx(2.6), 50, 4)
    assert fp.per_position == pytest.approx([0.8, 0.8, 0.0])


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("INFO nothing to see", "no `SpecDecoding metrics:` line"),
        ("SpecDecoding metrics: all good", "Mean acceptance length"),
        (
            "SpecDecoding metrics: Mean acceptance length: 2.0, Per-position acceptance rate: 0.5, x, 0.1",
            "not a number",
        ),
    ],
)
def test_log_garbage_says_what_was_expected(text: str, match: str) -> None:
    with pytest.raises(BlockdraftError, match=match):
        parse_spec_decoding_log(text)


def test_typed_numbers() -> None:
    fp = Fingerprint.from_numbers(1.2, parse_number_list("0.14,0,0", "--per-position"))
    assert fp.per_position == [0.14, 0.0, 0.0]
    assert fp.block_size == 4
    assert fp.acceptance_rate == pytest.approx(0.2 / 3)
    assert Fingerprint.from_numbers(None, [0.5, 0.25]).tau == pytest.approx(1.75)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tau": 0.2}, "add 1"),
        ({"tau": 2.0, "per_position": [14.0]}, "fraction"),
        ({"tau": 2.0, "acceptance_rate": 17.0}, "percentage"),
        ({"tau": 20.0, "block_size": 16}, "exceeds"),
        ({"tau": None}, "--tau"),
    ],
)
def test_bad_typed_numbers(kwargs: dict, match: str) -> None:
    with pytest.raises(BlockdraftError, match=match):
        Fingerprint.from_numbers(**kwargs)


def test_number_list_garbage() -> None:
    with pytest.raises(BlockdraftError, match="--per-position"):
        parse_number_list("0.1;0.2", "--per-position")


def test_acceptance_lengths_match_vllm_units() -> None:
    fp = Fingerprint.from_acceptance_lengths([1, 2, 4, 4], block_size=4, source="probe")
    assert fp.tau == pytest.approx(2.75)
    assert fp.per_position == pytest.approx([0.75, 0.5, 0.5])
    assert fp.tau == pytest.approx(1 + sum(fp.per_position))
    assert fp.acceptance_rate == pytest.approx(rate_from_tau(2.75, 3))
    with pytest.raises(BlockdraftError, match="1..block_size"):
        Fingerprint.from_acceptance_lengths([5], block_size=4, source="probe")


def test_probe_file_round_trip(tmp_path) -> None:
    reference = Fingerprint.from_numbers(3.4, [0.9, 0.8, 0.7], source="probe")
    faults = {"wrong mask id": Fingerprint.from_numbers(1.1, [0.1, 0.0, 0.0], source="probe")}
    ProbeResult(reference, faults).save(tmp_path / "probe.json")
    loaded = ProbeResult.load(tmp_path / "probe.json")
    assert loaded.reference == reference
    assert loaded.faults == faults
    (tmp_path / "bare.json").write_text('{"tau": 5.0}')
    assert ProbeResult.load(tmp_path / "bare.json").reference.tau == 5.0
    (tmp_path / "bad.json").write_text('{"taux": 5.0}')
    with pytest.raises(BlockdraftError, match="tau"):
        ProbeResult.load(tmp_path / "bad.json")
