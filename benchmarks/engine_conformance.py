"""Run vLLM 0.33.0's and SGLang 0.5.23's own code against what blockdraft writes and reads (not in CI).

Each engine goes into its own throwaway venv (they pin different torch releases) under --venv-root, outside the
repository. The checks then run the engines' own code, in those venvs, on no GPU:

- every command `blockdraft launch` writes (DFlash with an all-full drafter, DFlash with a sliding-window mixed
  drafter, DFlash on a hybrid Qwen3.5 target, MTP on that target) goes through the engine's own argument parser
  (vLLM: its CLI with the serve step replaced; SGLang: `sglang serve` with run_server replaced), and then
  through its config resolution (vLLM: create_engine_config on its CPU platform; SGLang: resolve_once as on a
  CUDA host) on tiny local model folders, and the resolved values are compared with what blockdraft meant;
- /metrics text is produced by the engines' own metric classes (vLLM: StatLoggerManager with two DP engines;
  SGLang: SchedulerMetricsCollector in one process per DP rank, collected the way its /metrics endpoint does,
  one rank idle), and log lines by vLLM's own SpecDecoding logger; blockdraft parses them to the numbers the
  scenarios below give by hand.

With --write-fixtures the captured texts go to tests/fixtures/engines/, which the CI tests read (CI cannot
install the engines); with --only, the other engine's recorded commands are kept. The same file is also the engine-side helper: the venvs' interpreters run it with
--engine-side TASK (stdlib imports only at module level, so it runs without blockdraft there).

    python benchmarks/engine_conformance.py [--write-fixtures] [--only vllm|sglang] [--venv-root /tmp/...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}
REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "engines"
TARGET, DRAFTER = "{TARGET}", "{DRAFTER}"  # placeholders for the tiny model folders in recorded argv
SERVED = ["--served-model-name", "Qwen/Qwen3.6-27B"]  # the metrics' model_name label, as a deployment shows it

# --- scenarios, in counts a person can add up -------------------------------------------------------------
# vLLM: per logging interval, per DP engine, one (draft tokens, accepted tokens) pair per draft. Some drafts are
# shorter than K (vLLM shortens drafts near the length limit), so Drafted / K is not the number of drafts.
VLLM_DFLASH_K = 15
VLLM_DFLASH_INTERVALS = [
    {0: [(15, 6)] * 40 + [(15, 0)] * 10 + [(7, 7)] * 5 + [(3, 1)] * 5, 1: [(15, 9)] * 20 + [(15, 2)] * 20},
    {0: [(15, 5)] * 50 + [(10, 10)] * 10, 1: [(15, 8)] * 30 + [(4, 0)] * 10},
]
VLLM_MTP_K = 3
VLLM_MTP_INTERVALS = [{0: [(3, 3)] * 30 + [(3, 1)] * 20 + [(2, 2)] * 10}, {0: [(3, 2)] * 40 + [(3, 0)] * 10}]
# SGLang: per DP rank, what its metrics reporter accumulated over one decode-log interval:
# (accepted tokens incl. bonus, verify forwards, correct drafts); None = the rank has not decoded.
SGLANG_DRAFT_TOKENS = 16
SGLANG_RANKS: list[tuple[int, int, int] | None] = [(1100, 200, 900), None, (600, 100, 500)]
SGLANG_MTP_DRAFT_TOKENS = 4
SGLANG_MTP_RANKS: list[tuple[int, int, int] | None] = [(640, 200, 440), None]

TARGET_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
    "max_position_embeddings": 2048, "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
HYBRID_CONFIG: dict[str, Any] = {  # Qwen3.6-27B's layout (multimodal wrapper, text_config, one MTP layer), tiny
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
        "max_position_embeddings": 2048, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "mtp_num_hidden_layers": 1, "rms_norm_eps": 1e-6, "attn_output_gate": True, "torch_dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    },
    "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                      "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "num_position_embeddings": 64},
    "image_token_id": 990, "video_token_id": 991, "vision_start_token_id": 992, "vision_end_token_id": 993,
    "torch_dtype": "bfloat16",
}


def drafter_config(sliding: bool) -> dict[str, Any]:
    """A tiny DFlash drafter for the tiny targets; `sliding` gives Qwen3.6-27B-DFlash's sliding + full mix."""
    raw: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 1000, "max_position_embeddings": 2048, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "block_size": 16, "num_target_layers": 4,
        "dflash_config": {"mask_token_id": 999, "target_layer_ids": [1, 2]},
    }
    if sliding:
        raw.update(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=2048)
    return raw


def relative_config(kind: str) -> dict[str, Any]:
    """The tiny drafter as a DFlash-2 drafter (Qwen3.8-27B-DFlash2's fields) or a DSpark one (anchor-first, N=7)."""
    raw = drafter_config(False)
    if kind == "dflash2":
        raw["architectures"] = ["DFlash2DraftModel"]
        raw["dflash_config"] |= {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32,
                                 "selector_top_k": 16}
    else:
        raw |= {"architectures": ["Qwen3DSparkModel"], "markov_rank": 32, "block_size": 7}
    return raw


# === engine side: runs inside an engine venv, stdlib imports only at module level ===========================

def _vllm_cpu_platform() -> None:
    """vLLM's own fallback when there is no accelerator (what `vllm bench` does in vllm/entrypoints/cli/main.py)."""
    from vllm import platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms.current_platform = CpuPlatform()


def _vllm_parse(argv: list[str]) -> Any:
    """Run `vllm serve ARGV` through vLLM's CLI with the serve step replaced; the parsed namespace."""
    import vllm.entrypoints.cli.serve as serve
    from vllm.entrypoints.cli import main as cli

    seen: dict[str, Any] = {}
    serve.ServeSubcommand.cmd = staticmethod(lambda args: seen.setdefault("args", args))
    sys.argv = argv
    cli.main()
    return seen["args"]


def _vllm_config(argv: list[str]) -> Any:
    """The parsed namespace and the VllmConfig vLLM resolves from it (on its CPU platform: no GPU here)."""
    _vllm_cpu_platform()  # before any vLLM module binds `current_platform`
    import vllm.config.vllm as vllm_config_module
    from vllm.engine.arg_utils import EngineArgs

    vllm_config_module.HAS_TRITON = True  # as on a CUDA host, where the V2 model runner's Triton kernels load

    args = _vllm_parse(argv)
    args.model = args.model_tag
    return args, EngineArgs.from_cli_args(args).create_engine_config()


def engine_vllm_parse(job: dict[str, Any]) -> dict[str, Any]:
    """Parse and resolve one `vllm serve` command; report what vLLM made of the speculative config."""
    args, config = _vllm_config(job["argv"])
    spec = config.speculative_config
    draft_hf = spec.draft_model_config.hf_config
    return {
        "parsed_speculative_config": args.speculative_config,
        "port": args.port,
        "model": args.model_tag,
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "draft_architectures": list(draft_hf.architectures or []),
        "n_predict": getattr(draft_hf, "n_predict", None),
        "target_attention_backend": None if config.attention_config.backend is None
        else str(config.attention_config.backend),
        "drafter_attention_backend": None if spec.attention_backend is None else str(spec.attention_backend),
        "v2_runner_env": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
        "v2_runner": config.use_v2_model_runner,
        "v2_runner_unsupported": config._get_v2_model_runner_unsupported_features(),
        "mixed_drafter_needs_v2": config._dflash_needs_multi_kv_group(),
        "candidate_draft": config._is_dflash_candidate_draft(),
    }


def engine_vllm_metrics(job: dict[str, Any]) -> dict[str, Any]:
    """Feed the scenario's drafts to vLLM's StatLoggerManager (DP engines); /metrics after each interval."""
    _, config = _vllm_config(job["argv"])
    import prometheus_client
    from vllm.v1.metrics.loggers import StatLoggerManager
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    k = config.speculative_config.num_speculative_tokens
    engines = sorted({int(e) for interval in job["intervals"] for e in interval})
    manager = StatLoggerManager(config, engine_idxs=engines)
    scrapes = []
    for interval in job["intervals"]:
        for engine, drafts in interval.items():
            stats = SpecDecodingStats.new(k)
            for draft_tokens, accepted in drafts:
                stats.observe_draft(num_draft_tokens=draft_tokens, num_accepted_tokens=accepted)
            iteration = IterationStats()
            iteration.num_generation_tokens = sum(accepted + 1 for _, accepted in drafts)
            manager.record(SchedulerStats(spec_decoding_stats=stats), iteration, engine_idx=int(engine))
        time.sleep(0.05)  # the logger divides by elapsed time
        manager.log()
        scrapes.append(prometheus_client.generate_latest().decode())
    sys.stdout.flush()
    return {"scrapes": scrapes, "k": k}


def _sglang_serve_args(argv: list[str]) -> Any:
    """Run `sglang serve ARGV` through SGLang's own CLI with run_server replaced; the ServerArgs it built."""
    import sglang.launch_server
    from sglang.cli import main as cli

    seen: dict[str, Any] = {}
    sglang.launch_server.run_server = lambda server_args: seen.setdefault("server_args", server_args)
    sys.argv = argv
    cli.main()
    return seen["server_args"]


def _sglang_resolve(server_args: Any) -> Any:
    """Resolve as on a CUDA host: the device is CUDA and the mamba snapshot support check answers yes."""
    import sglang.srt.arg_groups.mamba_hook as mamba_hook
    from sglang.srt.arg_groups.overrides import resolved_view

    mamba_hook._platform_supports_mamba_cache_extra_buffer = lambda: True
    server_args.device = "cuda"
    server_args.resolve_once()
    return resolved_view(server_args)


def engine_sglang_parse(job: dict[str, Any]) -> dict[str, Any]:
    """Parse (and resolve) one `sglang serve` command; a parser error is reported with its exit code."""
    import contextlib
    import io

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            server_args = _sglang_serve_args(job["argv"])
    except SystemExit as exc:
        return {"exit_code": exc.code, "stderr_tail": stderr.getvalue().strip().splitlines()[-1:]}
    view = _sglang_resolve(server_args)
    return {
        "exit_code": 0,
        "speculative_algorithm": view.speculative_algorithm,
        "speculative_num_draft_tokens": view.speculative_num_draft_tokens,
        "speculative_num_steps": view.speculative_num_steps,
        "speculative_eagle_topk": view.speculative_eagle_topk,
        "speculative_draft_model_path": view.speculative_draft_model_path,
        "mamba_radix_cache_strategy": view.mamba_radix_cache_strategy,
        "disable_overlap_schedule": view.disable_overlap_schedule,
        "enable_metrics": view.enable_metrics,
        "port": view.port,
    }


def engine_sglang_rank(job: dict[str, Any]) -> dict[str, Any]:
    """One scheduler rank: SGLang's own collector with the labels init_new gives it, logging one stats report."""
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector, SchedulerStats
    import sglang.srt.arg_groups.mamba_hook as mamba_hook
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank

    server_args = _sglang_serve_args(job["argv"])
    mamba_hook._platform_supports_mamba_cache_extra_buffer = lambda: True  # as on a CUDA host
    server_args.device = "cuda"
    publish(server_args, role="scheduler", ranks=SpawnRanks(
        world_rank=spawn_world_rank(server_args, tp_rank=0, pp_rank=0), dp_rank=job["dp_rank"], gpu_id=None))
    context = SchedulerMetricsCollector.init_new(
        server_args=server_args, enable_priority_scheduling=False, enable_lora=False, enable_hierarchical_cache=False
    )
    stats = SchedulerStats()  # a rank that has not decoded reports these defaults (spec_accept_length 0.0)
    if job["counts"] is not None:  # metrics_reporter.py log_decode_stats: tokens / forwards, correct / drafted
        tokens, forwards, correct = job["counts"]
        stats.spec_accept_length = tokens / forwards
        stats.spec_accept_rate = correct / (forwards * (job["draft_tokens"] - 1))
    context.collector.log_stats(stats)
    return {"labels": {k: str(v) for k, v in context.collector.labels.items()}}


def engine_sglang_collect(job: dict[str, Any]) -> dict[str, Any]:
    """What SGLang's /metrics answers: a MultiProcessCollector over the ranks' files (utils/common.py)."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return {"text": generate_latest(registry).decode()}


ENGINE_TASKS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "vllm-parse": engine_vllm_parse,
    "vllm-metrics": engine_vllm_metrics,
    "sglang-parse": engine_sglang_parse,
    "sglang-rank": engine_sglang_rank,
    "sglang-collect": engine_sglang_collect,
}


# === host side: installs, runs the engine side, checks with blockdraft ======================================

@dataclass
class Check:
    """One row of the summary table."""

    engine: str
    name: str
    passed: bool
    detail: str
    seconds: float


@dataclass
class Context:
    """The venvs, the tiny model folders, and where captured text goes."""

    venvs: dict[str, Path]
    models: dict[str, Path]
    write_fixtures: bool
    log_dir: Path
    launches: dict[str, Any] = field(default_factory=dict)

    def run(self, engine: str, task: str, job: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run one engine-side task in that engine's venv; its JSON answer (stdout and stderr go to a log)."""
        python = self.venvs[engine] / "bin" / "python"
        with tempfile.TemporaryDirectory() as tmp:
            job_file, answer_file = Path(tmp) / "job.json", Path(tmp) / "answer.json"
            job_file.write_text(json.dumps(job))
            log = self.log_dir / f"{engine}-{task}-{time.time_ns()}.log"
            with log.open("w") as out:
                done = subprocess.run(
                    [str(python), __file__, "--engine-side", task, str(job_file), str(answer_file)],
                    stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, timeout=900,
                )
            if done.returncode != 0 or not answer_file.exists():
                tail = log.read_text().strip().splitlines()[-3:]
                raise RuntimeError(f"{engine} {task} failed (exit {done.returncode}): {' | '.join(tail)}")
            answer = json.loads(answer_file.read_text())
            answer["log"] = log.read_text()
            return answer

    def fixture(self, name: str, text: str) -> None:
        if self.write_fixtures:
            FIXTURES.mkdir(parents=True, exist_ok=True)
            (FIXTURES / name).write_text(text)

    def record_launch(self, engine: str, name: str, plan: Any, resolved: dict[str, Any]) -> None:
        """Keep what the engine accepted, for the CI test that holds blockdraft's commands to it."""
        commands = self.launches.setdefault("commands", {}).setdefault(name, {})
        recorded = {"argv": plan.argv, "resolved_by_engine": resolved}
        commands[engine] = json.loads(self.placeholders(json.dumps(recorded)))

    def placeholders(self, text: str) -> str:
        """`text` with the tiny model folders replaced by placeholders (their paths differ per run)."""
        names = {str(self.models["target"]): TARGET, str(self.models["hybrid"]): TARGET}
        names |= {str(self.models[k]): DRAFTER for k in ("drafter", "sliding", "dflash2", "dspark")}
        for path, name in names.items():
            text = text.replace(path, name)
        return text


def install(venv_root: Path, engine: str, wheel_dir: Path | None) -> tuple[Path, float, bool]:
    """A venv with the released engine wheel (pip resolves its pinned torch); reused when already there."""
    venv = venv_root / engine
    start = time.monotonic()
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version('{engine}'))"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != VERSIONS[engine]:
        source = f"{engine}=={VERSIONS[engine]}"
        if wheel_dir is not None:
            wheels = sorted(wheel_dir.glob(f"{engine}-{VERSIONS[engine]}-*.whl"))
            source = str(wheels[0]) if wheels else source
        subprocess.run([str(python), "-m", "pip", "install", "-q", source], check=True)
        return venv, time.monotonic() - start, False
    return venv, time.monotonic() - start, True


def make_models(root: Path) -> dict[str, Path]:
    """Tiny config-only model folders: a dense Qwen3 target, a hybrid Qwen3.5 target and two drafters."""
    configs = {"target": TARGET_CONFIG, "hybrid": HYBRID_CONFIG,
               "drafter": drafter_config(False), "sliding": drafter_config(True),
               "dflash2": relative_config("dflash2"), "dspark": relative_config("dspark")}
    folders = {}
    for name, config in configs.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        folders[name] = folder
    return folders


def _launch_plans(models: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Every command `blockdraft launch` writes, per engine, built by blockdraft itself."""
    from blockdraft.config import load_draft_config
    from blockdraft.doctor import launch

    plain, sliding = load_draft_config(models["drafter"]), load_draft_config(models["sliding"])
    dflash2, dspark = load_draft_config(models["dflash2"]), load_draft_config(models["dspark"])
    target, hybrid = str(models["target"]), str(models["hybrid"])
    return {
        "dflash2_plain": {  # SGLang serves DFlash-2 under DFLASH too, by the drafter's architecture
            "vllm": launch.vllm_command(str(models["dflash2"]), target, dflash2),
            "sglang": launch.sglang_command(str(models["dflash2"]), target, dflash2, TARGET_CONFIG),
        },
        "dspark_plain": {"vllm": launch.vllm_command(str(models["dspark"]), target, dspark)},
        "dflash_plain": {
            "vllm": launch.vllm_command(str(models["drafter"]), target, plain),
            "sglang": launch.sglang_command(str(models["drafter"]), target, plain, TARGET_CONFIG),
        },
        "dflash_sliding": {
            "vllm": launch.vllm_command(str(models["sliding"]), target, sliding),
            "sglang": launch.sglang_command(str(models["sliding"]), target, sliding, TARGET_CONFIG),
        },
        "dflash_hybrid": {
            "vllm": launch.vllm_command(str(models["drafter"]), hybrid, plain),
            "sglang": launch.sglang_command(str(models["drafter"]), hybrid, plain, HYBRID_CONFIG),
        },
        "mtp_hybrid": {
            "vllm": launch.vllm_mtp_command(hybrid, HYBRID_CONFIG),
            "sglang": launch.sglang_mtp_command(hybrid, HYBRID_CONFIG),
        },
    }


def _expect(found: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    return [f"{key}={found.get(key)!r} (wanted {value!r})" for key, value in wanted.items() if found.get(key) != value]


def check_vllm_launch(ctx: Context, name: str, plan: Any) -> str:
    """vLLM parses the command and resolves the speculative config to what blockdraft meant."""
    from blockdraft.doctor.launch import DEFAULT_MTP_STEPS

    answer = ctx.run("vllm", "vllm-parse", {"argv": plan.argv})
    spec = plan.speculative_config
    wanted: dict[str, Any] = {
        "parsed_speculative_config": spec, "method": spec["method"],
        "num_speculative_tokens": spec["num_speculative_tokens"],
        "target_attention_backend": None, "drafter_attention_backend": None, "v2_runner_env": None,
        "v2_runner_unsupported": [], "v2_runner": True, "port": 8000,
    }
    if spec["method"] == "mtp":
        wanted |= {"draft_architectures": ["Qwen3_5MTP"], "n_predict": 1, "num_speculative_tokens": DEFAULT_MTP_STEPS}
    elif spec["method"] == "dspark":
        wanted |= {"draft_architectures": ["Qwen3DSparkModel"], "num_speculative_tokens": 7, "candidate_draft": False}
    else:
        dflash2 = name.startswith("dflash2")
        wanted |= {"draft_architectures": ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"],
                   "num_speculative_tokens": 15, "mixed_drafter_needs_v2": name == "dflash_sliding",
                   "candidate_draft": dflash2}
    problems = _expect(answer, wanted)
    if problems:
        raise AssertionError("; ".join(problems))
    ctx.record_launch("vllm", name, plan, {k: answer[k] for k in wanted})
    return f"spec {answer['method']} K={answer['num_speculative_tokens']}, backends auto, V2 runner by default"


def check_sglang_launch(ctx: Context, name: str, plan: Any) -> str:
    """SGLang's `sglang serve` parses the command; resolution gives the algorithm, units and mamba strategy."""
    answer = ctx.run("sglang", "sglang-parse", {"argv": plan.argv})
    hybrid = "hybrid" in name
    wanted: dict[str, Any] = {"exit_code": 0, "enable_metrics": True, "disable_overlap_schedule": False, "port": 30000,
                              "mamba_radix_cache_strategy": "extra_buffer" if hybrid else "auto"}
    if name.startswith("mtp"):
        wanted |= {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                   "speculative_num_draft_tokens": 4, "speculative_draft_model_path": None}
    else:
        wanted |= {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": 16,
                   "speculative_num_steps": 1, "speculative_eagle_topk": 1}
    problems = _expect(answer, wanted)
    if problems:
        raise AssertionError("; ".join(problems))
    ctx.record_launch("sglang", name, plan, {k: answer[k] for k in wanted})
    return (f"{answer['speculative_algorithm']} draft tokens {answer['speculative_num_draft_tokens']}, "
            f"mamba strategy {answer['mamba_radix_cache_strategy']}")


def check_sglang_stale_flag(ctx: Context, plan: Any) -> str:
    """The flag blockdraft used to emit for hybrid targets is rejected by SGLang 0.5.23's parser."""
    answer = ctx.run("sglang", "sglang-parse", {"argv": [*plan.argv, "--mamba-scheduler-strategy", "extra_buffer"]})
    if answer["exit_code"] != 2 or "unrecognized arguments" not in " ".join(answer["stderr_tail"]):
        raise AssertionError(f"expected exit 2 with unrecognized arguments, got {answer['exit_code']}")
    ctx.fixture("sglang_0.5.23_stale_mamba_flag.txt", "\n".join(answer["stderr_tail"]) + "\n")
    return f"exit {answer['exit_code']}: {answer['stderr_tail'][0]}"


def hand_counts(drafts: list[tuple[int, int]], k: int) -> dict[str, Any]:
    """vLLM's counters for a list of (draft tokens, accepted) drafts, added up by hand."""
    return {
        "drafts": len(drafts), "draft_tokens": sum(d for d, _ in drafts), "accepted": sum(a for _, a in drafts),
        "per_position": [sum(1 for _, a in drafts if a > i) for i in range(k)],
    }


def _approx(found: float | None, wanted: float, tolerance: float, what: str) -> None:
    if found is None or abs(found - wanted) > tolerance:
        raise AssertionError(f"{what} {found} != {wanted} (+-{tolerance})")


def check_vllm_metrics(ctx: Context, label: str, plan: Any, intervals: list[dict[int, list[tuple[int, int]]]],
                       k: int) -> str:
    """/metrics (two scrapes) and log lines from vLLM's own stat loggers, read back by blockdraft."""
    from blockdraft.doctor.log_line import parse_spec_decoding_log
    from blockdraft.doctor.server_metrics import vllm_window

    answer = ctx.run("vllm", "vllm-metrics", {"argv": [*plan.argv, *SERVED], "intervals": intervals})
    before, after = answer["scrapes"]
    log = "\n".join(line for line in answer["log"].splitlines() if "Engine 0" in line or "SpecDecoding" in line)
    window = hand_counts([d for drafts in intervals[1].values() for d in drafts], k)
    observed = vllm_window(before, after, None, "conformance")
    _approx(observed.tau, 1 + window["accepted"] / window["drafts"], 1e-12, "window tau")
    _approx(observed.acceptance_rate, window["accepted"] / window["draft_tokens"], 1e-12, "window rate")
    for found, count in zip(observed.per_position, window["per_position"], strict=True):
        _approx(found, count / window["drafts"], 1e-12, "window per-position rate")
    if observed.num_drafts != window["drafts"] or observed.block_size != k + 1:
        raise AssertionError(f"drafts {observed.num_drafts} / B {observed.block_size}")
    everything = hand_counts([d for interval in intervals for drafts in interval.values() for d in drafts], k)
    from_log = parse_spec_decoding_log(log, "conformance log")
    lines = sum(len(interval) for interval in intervals)
    if f"{lines} vLLM SpecDecoding lines combined" not in from_log.source or from_log.num_drafts is not None:
        raise AssertionError(f"log source {from_log.source!r}, num_drafts {from_log.num_drafts}")
    _approx(from_log.acceptance_rate, everything["accepted"] / everything["draft_tokens"], 1e-12, "log rate")
    _approx(from_log.tau, 1 + everything["accepted"] / everything["drafts"], 0.01, "log tau")
    ctx.fixture(f"vllm_0.33.0_{label}_metrics_before.txt", before)
    ctx.fixture(f"vllm_0.33.0_{label}_metrics_after.txt", after)
    ctx.fixture(f"vllm_0.33.0_{label}.log", log + "\n")
    return (f"window tau {observed.tau:.4f} exact over {len(intervals[1])} engine(s); "
            f"log: {lines} lines, tau {from_log.tau:.4f} vs {1 + everything['accepted'] / everything['drafts']:.4f}")


def check_sglang_metrics(ctx: Context, label: str, plan: Any, ranks: list[tuple[int, int, int] | None],
                         draft_tokens: int) -> str:
    """/metrics from SGLang's own collector, one process per DP rank (one idle), read back by blockdraft."""
    from blockdraft.doctor.server_metrics import parse_sglang_metrics

    argv = [*plan.argv, *SERVED, "--dp-size", str(len(ranks))]
    with tempfile.TemporaryDirectory() as prom:
        env = {"PROMETHEUS_MULTIPROC_DIR": prom}
        labels = [ctx.run("sglang", "sglang-rank", {"argv": argv, "dp_rank": rank, "counts": counts,
                                                    "draft_tokens": draft_tokens}, env)["labels"]
                  for rank, counts in enumerate(ranks)]
        text = ctx.run("sglang", "sglang-collect", {}, env)["text"]
    expected_labels = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank"}
    if any(set(found) != expected_labels for found in labels):
        raise AssertionError(f"labels {labels}")
    decoded = [c for c in ranks if c is not None]
    observed = parse_sglang_metrics(text, None, "conformance")
    _approx(observed.tau, sum(t / f for t, f, _ in decoded) / len(decoded), 1e-12, "tau")
    _approx(observed.acceptance_rate,
            sum(c / (f * (draft_tokens - 1)) for _, f, c in decoded) / len(decoded), 1e-12, "rate")
    idle = len(ranks) - len(decoded)
    if f"mean of {len(decoded)} rank" not in observed.source or f"{idle} idle" not in observed.source:
        raise AssertionError(f"source {observed.source!r}")
    ctx.fixture(f"sglang_0.5.23_{label}_metrics.txt", text)
    return (f"tau {observed.tau:.4f} over {len(decoded)} decoding rank(s), {idle} idle ignored; "
            f"labels {sorted(expected_labels)}")


def run_checks(ctx: Context, engines: list[str]) -> list[Check]:
    """Every check, timed; a failing check records its error and the run goes on."""
    plans = _launch_plans(ctx.models)
    todo: list[tuple[str, str, Callable[[], str]]] = []
    for engine in engines:
        for name, per_engine in plans.items():
            if engine not in per_engine:
                continue
            plan = per_engine[engine]
            launch_check = check_vllm_launch if engine == "vllm" else check_sglang_launch
            todo.append((engine, f"launch {name}", lambda c=launch_check, n=name, p=plan: c(ctx, n, p)))
    if "sglang" in engines:
        hybrid = plans["dflash_hybrid"]["sglang"]
        todo.append(("sglang", "stale --mamba-scheduler-strategy", lambda: check_sglang_stale_flag(ctx, hybrid)))
        todo.append(("sglang", "metrics dflash 3 DP ranks", lambda: check_sglang_metrics(
            ctx, "dflash_dp3", plans["dflash_plain"]["sglang"], SGLANG_RANKS, SGLANG_DRAFT_TOKENS)))
        todo.append(("sglang", "metrics mtp 2 DP ranks", lambda: check_sglang_metrics(
            ctx, "mtp_dp2", plans["mtp_hybrid"]["sglang"], SGLANG_MTP_RANKS, SGLANG_MTP_DRAFT_TOKENS)))
    if "vllm" in engines:
        todo.append(("vllm", "metrics+log dflash 2 DP engines", lambda: check_vllm_metrics(
            ctx, "dflash_dp2", plans["dflash_plain"]["vllm"], VLLM_DFLASH_INTERVALS, VLLM_DFLASH_K)))
        todo.append(("vllm", "metrics+log mtp", lambda: check_vllm_metrics(
            ctx, "mtp", plans["mtp_hybrid"]["vllm"], VLLM_MTP_INTERVALS, VLLM_MTP_K)))
    checks = []
    for engine, name, run in todo:
        start = time.monotonic()
        try:
            detail, passed = run(), True
        except Exception as exc:  # noqa: BLE001 (a check's failure is a result, reported in the table)
            detail, passed = f"{type(exc).__name__}: {exc}", False
        checks.append(Check(engine, name, passed, detail, time.monotonic() - start))
        print(f"{'PASS' if passed else 'FAIL'} {engine} {name} ({checks[-1].seconds:.1f} s): {detail}", flush=True)
    return checks


def summary(checks: list[Check], installs: dict[str, tuple[float, bool]]) -> str:
    """A table for RESULTS.md: engine, check, result, seconds, detail."""
    rows = ["| engine | check | result | s | detail |", "|---|---|---|---|---|"]
    rows += [f"| {e} {VERSIONS[e]} | install | done | {s:.0f} | {'venv reused' if reused else 'pip install'} |"
             for e, (s, reused) in installs.items()]
    rows += [f"| {c.engine} {VERSIONS[c.engine]} | {c.name} | {'pass' if c.passed else 'FAIL'} | {c.seconds:.0f} "
             f"| {c.detail.replace('|', '/')} |" for c in checks]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv-root", type=Path, default=Path(tempfile.gettempdir()) / "blockdraft-conformance",
                        help="Where the throwaway engine venvs live (outside the repository).")
    parser.add_argument("--only", choices=sorted(VERSIONS), help="Check one engine only.")
    parser.add_argument("--wheel-dir", type=Path, help="Install the engine wheels from this folder if they are there.")
    parser.add_argument("--write-fixtures", action="store_true", help=f"Write captured engine text to {FIXTURES}.")
    args = parser.parse_args()
    if REPO in args.venv_root.resolve().parents:
        parser.error("--venv-root must be outside the repository")
    engines = [args.only] if args.only else sorted(VERSIONS)
    args.venv_root.mkdir(parents=True, exist_ok=True)
    installs: dict[str, tuple[float, bool]] = {}
    venvs: dict[str, Path] = {}
    for engine in engines:
        venv, seconds, reused = install(args.venv_root, engine, args.wheel_dir)
        venvs[engine], installs[engine] = venv, (seconds, reused)
    log_dir = Path(tempfile.mkdtemp(prefix="logs-", dir=args.venv_root))
    with tempfile.TemporaryDirectory() as models:
        ctx = Context(venvs, make_models(Path(models)), args.write_fixtures, log_dir)
        checks = run_checks(ctx, engines)
        if args.write_fixtures and all(c.passed for c in checks):
            launches = FIXTURES / "launch_conformance.json"
            recorded = json.loads(launches.read_text()) if launches.exists() else {}
            for name, per_engine in ctx.launches.get("commands", {}).items():  # --only keeps the other engine's
                recorded.setdefault("commands", {}).setdefault(name, {}).update(per_engine)
            recorded |= {"versions": VERSIONS, "target_configs": {"dense": TARGET_CONFIG, "hybrid": HYBRID_CONFIG},
                         "drafter_configs": {"plain": drafter_config(False), "sliding": drafter_config(True),
                                             "dflash2": relative_config("dflash2"),
                                             "dspark": relative_config("dspark")}}
            ctx.fixture("launch_conformance.json", json.dumps(recorded, indent=2, sort_keys=True) + "\n")
    print("\n" + summary(checks, installs))
    print(f"\nengine logs: {log_dir}")
    return 0 if all(c.passed for c in checks) else 1


def engine_side(task: str, job_file: str, answer_file: str) -> None:
    """Entry point inside an engine venv: run one task, write its JSON answer."""
    answer = ENGINE_TASKS[task](json.loads(Path(job_file).read_text()))
    Path(answer_file).write_text(json.dumps(answer))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--engine-side":
        engine_side(*sys.argv[2:])
    else:
        sys.exit(main())
