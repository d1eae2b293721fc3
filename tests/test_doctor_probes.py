"""The bug zoo: plant each known deployment fault in a trained pair and check that the doctor names it.

The probe measures the reference and every fault's fingerprint on one prompt set; each "observed" deployment
(the same fault, injected the same way) runs on a different prompt set, as a user's traffic would, and
`rank_hypotheses` must name the planted fault. Two trained pairs: all-full layers, and a sliding (window 8) +
full drafter whose window matters for 8..24-token prompts + 24 generated tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from blockdraft.config import parse_draft_config
from blockdraft.decoding.draft import DFlashProposer
from blockdraft.doctor import probes, thinking
from blockdraft.doctor.cli import doctor_app
from blockdraft.doctor.diagnose import HEALTHY, rank_hypotheses, verdict
from blockdraft.doctor.fingerprint import Fingerprint, ProbeResult
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target

from conftest import drafter_raw_config, make_drafter, make_target_model

trained = pytest.importorskip("trained_pair")

# 32 prompts x 24 tokens: two prompt sets of one deployment differ by ~0.15 in tau on these pairs (margins: below).
PROMPTS = 32
MAX_NEW_TOKENS = 24
PROBE_SEED, TRAFFIC_SEED = 1, 2


@dataclass
class Zoo:
    """A trained pair, its probe on one prompt set, and the faults as deployments for other traffic."""

    target_dir: Path
    drafter_dir: Path
    probe: probes.ProbeRun
    deployments: dict[str, probes.Deployment]
    traffic: list[list[int]]

    def observe(self, name: str) -> Fingerprint:
        """What a deployment with this fault (or `healthy`) measures on the other prompts."""
        return probes.measure(self.deployments[name], self.traffic, MAX_NEW_TOKENS)

    def ranked(self, observed: Fingerprint) -> list[str]:
        result = self.probe.result
        return [h.name for h in rank_hypotheses(observed, result.reference, result.faults)]

    def verdict(self, observed: Fingerprint) -> str:
        return verdict(observed, self.probe.result.reference, self.probe.result.faults)


def _zoo(target_dir: Path, drafter_dir: Path) -> Zoo:
    from blockdraft.models.loading import load_drafter, load_target

    target, _ = load_target(str(target_dir), torch.device("cpu"), torch.float32)
    drafter = load_drafter(drafter_dir, target)
    prompts = [p.ids for p in trained.prompts(PROBE_SEED, PROMPTS)]
    run = probes.run_probes(target, drafter, prompts, MAX_NEW_TOKENS)
    faults, _ = probes.fault_deployments(target, drafter, prompts)
    deployments = {d.name: d for d in [probes.healthy_deployment(target, drafter), *faults]}
    traffic = [p.ids for p in trained.prompts(TRAFFIC_SEED, PROMPTS)]
    return Zoo(target_dir, drafter_dir, run, deployments, traffic)


@pytest.fixture(scope="module")
def swa_zoo(trained_pairs: dict[str, tuple[Path, Path]]) -> Zoo:
    return _zoo(*trained_pairs["swa"])


@pytest.fixture(scope="module")
def full_zoo(trained_pairs: dict[str, tuple[Path, Path]]) -> Zoo:
    return _zoo(*trained_pairs["full"])


# ---------------------------------------------------------------- the zoo


@pytest.mark.parametrize(
    "fault",
    [
        probes.TAPS_LAYER_INPUT,
        probes.TAPS_NEXT_LAYER,
        probes.GUESSED_TAPS,
        probes.SWA_AS_FULL,
        probes.WRONG_MASK,
        probes.WRONG_ROPE_THETA,
    ],
)
def test_the_doctor_names_each_planted_fault(swa_zoo: Zoo, fault: str) -> None:
    """On the sliding pair every planted fault is named first.

    Margins differ: over 30 (probe seed, traffic seed) combinations of 32 prompts, taps L-1, SWA as full and the
    wrong mask are named first 30/30; taps L+1 and the guessed taps 26/30 (each is the other's runner-up, 3.15
    vs 3.44 tau); RoPE theta x10 costs this drafter only ~5% of tau and is named first 22/30 (else eviction or
    healthy). These seeds are one fixed draw; a failure of the last three after a trainer change may be noise.
    """
    observed = swa_zoo.observe(fault)
    assert swa_zoo.ranked(observed)[0] == fault
    said = swa_zoo.verdict(observed)  # named alone where the noise separates it, else first of the pair it cannot
    assert said.startswith(f"deployment fault, most likely {fault}:") or f"; {fault} or " in said


@pytest.mark.parametrize("fault", [probes.TAPS_NEXT_LAYER, probes.GUESSED_TAPS, probes.WRONG_ROPE_THETA])
def test_faults_that_cost_the_same_are_grouped_on_the_all_full_pair(full_zoo: Zoo, fault: str) -> None:
    """On the all-full drafter three faults land on one fingerprint, so the doctor narrows to the group only.

    Taps L+1 = [2, 3] and the guessed taps [1, 3] both replace tap 2, the feature this drafter leans on, by the
    last layer's residual; RoPE theta x10 happens to cost the same share of the gain. Their probe taus are
    ~2.24 / 2.15 / 1.92 with per-position curves within ~0.07 of each other, while two prompt sets of one
    deployment differ by ~0.15 in tau. No distance on these numbers orders them reliably: over 30 seed
    combinations, the L1 gap used by `diagnose`, a noise-weighted chi-square, L2, and KL / Hellinger distances
    between acceptance-length histograms all name the right one of the three only 10-26 times in 30.
    What must hold: the group, and not healthy, taps L-1 or a collapse, tops the ranking (30/30 for the two tap
    faults, 20/30 for RoPE, which sometimes lets taps L-1 at tau 1.73 in), and the verdict says that the first two
    are not told apart instead of naming one.
    """
    group = {probes.TAPS_NEXT_LAYER, probes.GUESSED_TAPS, probes.WRONG_ROPE_THETA}
    observed = full_zoo.observe(fault)
    ranked = full_zoo.ranked(observed)
    assert set(ranked[:3]) == group
    said = full_zoo.verdict(observed)
    assert f"; {ranked[0]} or {ranked[1]}, not told apart on" in said and "doctor static" in said


@pytest.mark.parametrize("zoo_name", ["swa_zoo", "full_zoo"])
def test_a_healthy_deployment_means_the_drafter_is_the_limit(zoo_name: str, request: pytest.FixtureRequest) -> None:
    zoo: Zoo = request.getfixturevalue(zoo_name)
    observed = zoo.observe(HEALTHY)
    assert zoo.verdict(observed).startswith("the drafter is the limit")


def test_the_probe_measures_a_working_drafter_and_every_fault_that_applies(swa_zoo: Zoo, full_zoo: Zoo) -> None:
    swa, full = swa_zoo.probe, full_zoo.probe
    assert swa.skipped == {}
    assert set(full.skipped) == {probes.SWA_AS_FULL, probes.CONTEXT_EVICTED}
    assert "no sliding" in full.skipped[probes.SWA_AS_FULL]
    for run in (swa, full):
        reference, faults = run.result.reference, run.result.faults
        assert reference.tau > 2.5 and reference.block_size == 8 and len(reference.per_position) == 7
        assert faults[probes.WRONG_MASK].tau < 1.3 and faults[probes.HEAD_NOT_SHARED].tau < 1.1
        for name in (probes.TAPS_LAYER_INPUT, probes.TAPS_NEXT_LAYER, probes.GUESSED_TAPS):
            assert faults[name].tau < reference.tau - 0.5
    assert swa.result.faults[probes.SWA_AS_FULL].tau < 1.3


# ---------------------------------------------------------------- injections, on tiny random models


def test_wrong_formula_taps_match_the_published_example() -> None:
    assert probes.wrong_formula_taps(64, 5) == [1, 17, 33, 49, 63]
    assert probes.wrong_formula_taps(4, 2) == [1, 3]


def test_guessed_taps_are_skipped_when_the_formula_happens_to_be_right() -> None:
    raw = drafter_raw_config("all_full")
    raw["dflash_config"]["target_layer_ids"] = [1, 3]
    target = Target(make_target_model())
    _, skipped = probes.fault_deployments(target, DFlashDrafter(parse_draft_config(raw)).eval(), [[1, 2, 3]])
    assert "gives the real taps [1, 3]" in skipped[probes.GUESSED_TAPS]


def test_engine_taps_read_the_raw_residual_of_the_last_layer() -> None:
    model = make_target_model()
    target, engine = Target(model), probes.EngineTapTarget(model, model.model.layers[-1])
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    positions = torch.arange(5)
    captured: list[torch.Tensor] = []
    handle = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    hf = target.forward(ids, positions, target.new_cache(), (2, 3)).taps
    handle.remove()
    hooked = engine.forward(ids, positions, engine.new_cache(), (2, 3)).taps
    assert hf is not None and hooked is not None
    hidden = hf.shape[-1] // 2
    assert torch.equal(hooked[..., :hidden], hf[..., :hidden])  # other taps: unchanged
    assert torch.allclose(hooked[..., hidden:], captured[0])  # tap N-1: the residual, not HF's post-norm state
    assert not torch.allclose(hooked[..., hidden:], hf[..., hidden:])


def test_faults_are_built_from_the_drafter_without_touching_it() -> None:
    target, drafter = Target(make_target_model()), make_drafter("mixed_swa")
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    deployments, skipped = probes.fault_deployments(target, drafter, [[5, 5, 7, 95]])
    by_name = {d.name: d for d in deployments}
    assert skipped == {}
    assert by_name[probes.TAPS_LAYER_INPUT].proposer.tap_layers == (-1, 1, 2)
    assert by_name[probes.TAPS_NEXT_LAYER].proposer.tap_layers == (1, 3, 3)
    assert by_name[probes.WRONG_MASK].proposer.cfg.mask_token_id == 5  # the prompts' most frequent token
    swa = by_name[probes.SWA_AS_FULL].proposer.drafter
    assert swa.cfg.layer_types == ("full_attention",) * 3 and not any(l.self_attn.causal for l in swa.layers)
    rope = by_name[probes.WRONG_ROPE_THETA].proposer.drafter
    assert not torch.allclose(rope.rotary_emb.inv_freq, drafter.rotary_emb.inv_freq)
    assert torch.equal(rope.layers[0].self_attn.q_proj.weight, drafter.layers[0].self_attn.q_proj.weight)
    head = by_name[probes.HEAD_NOT_SHARED].proposer.target.lm_head
    assert head is not target.lm_head and head.weight.shape == target.lm_head.weight.shape
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in before.items())
    assert drafter.cfg.mask_token_id != 5 and target.lm_head is target.model.get_output_embeddings()


def test_the_evicting_cache_keeps_only_the_window_in_every_layer() -> None:
    target, drafter = Target(make_target_model()), make_drafter("mixed_swa")
    window = drafter.cfg.sliding_window
    assert window is not None
    proposer = probes.EvictingProposer(drafter, target, window)
    proposer.add_context(torch.randn(1, 3 * window, 3 * target.hidden_size))
    kept = [proposer.cache.get(i)[0].shape[2] for i in range(len(drafter.layers))]
    assert kept == [window - 1, window - 1, window]  # sliding layers keep W - 1 anyway; the full layer lost the rest
    healthy = DFlashProposer(drafter, target)
    healthy.add_context(torch.randn(1, 3 * window, 3 * target.hidden_size))
    assert healthy.cache.get(2)[0].shape[2] == 3 * window


def test_a_qwen_mask_id_is_swapped_for_the_other_family() -> None:
    vocab = 248320
    target = Target(make_target_model(vocab=vocab))
    drafter = DFlashDrafter(parse_draft_config(drafter_raw_config("all_full", vocab, mask_id=151669))).eval()
    deployments, _ = probes.fault_deployments(target, drafter, [[1, 2]])
    wrong = next(d for d in deployments if d.name == probes.WRONG_MASK)
    assert wrong.proposer.cfg.mask_token_id == 248070 and "other Qwen family" in wrong.detail


# ---------------------------------------------------------------- the command


def test_doctor_probe_writes_a_reference_and_gives_a_verdict_in_one_step(tmp_path: Path, full_zoo: Zoo) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p.ids}) + "\n" for p in trained.prompts(5, 3)))
    out, html = tmp_path / "probe.json", tmp_path / "probe.html"
    result = CliRunner().invoke(
        doctor_app,
        [
            "probe", "--target", str(full_zoo.target_dir), "--drafter", str(full_zoo.drafter_dir),
            "--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "12", "--device", "cpu",
            "--out", str(out), "--json", "--html", str(html),
            "--observed-tau", "1.1", "--observed-per-position", "0.1,0,0,0,0,0,0",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["verdict"].startswith("deployment fault, most likely ")
    assert {"observed", "reference", probes.WRONG_MASK} <= set(data["fingerprints"])
    assert {f["field"] for f in data["findings"]} == {probes.SWA_AS_FULL, probes.CONTEXT_EVICTED, thinking.FIELD}
    (mode,) = [f for f in data["findings"] if f["field"] == thinking.FIELD]
    assert mode["message"] == "the prompts are not chat messages, so no chat template renders them; probed once"
    saved = ProbeResult.load(out)
    assert saved.reference.num_drafts and probes.GUESSED_TAPS in saved.faults
    assert "verdict" in html.read_text()


def test_doctor_probe_rejects_bad_observed_numbers_before_loading(tmp_path: Path) -> None:
    with pytest.raises(BlockdraftError, match="--observed-per-position"):
        CliRunner().invoke(
            doctor_app,
            ["probe", "--target", str(tmp_path), "--drafter", str(tmp_path), "--observed-per-position", "a,b"],
            catch_exceptions=False,
        )


def test_a_block_cut_by_num_speculative_tokens_is_probed_and_named(full_zoo: Zoo) -> None:
    """vLLM below B-1 drafts from a block of k+1 rows; the probe measures that as a fault and the doctor names it."""
    from blockdraft.models.loading import load_drafter, load_target

    target, _ = load_target(str(full_zoo.target_dir), torch.device("cpu"), torch.float32)
    drafter = load_drafter(full_zoo.drafter_dir, target)
    prompts = [p.ids for p in trained.prompts(PROBE_SEED, PROMPTS)]
    run = probes.run_probes(target, drafter, prompts, MAX_NEW_TOKENS, served_tokens=2)
    cut = run.result.faults[probes.SHORT_BLOCK]
    assert cut.tau <= 3 and cut.tau < run.result.reference.tau - 0.5 and max(cut.per_position[2:]) == 0
    served = next(d for d in probes.fault_deployments(target, drafter, prompts, 2)[0] if d.name == probes.SHORT_BLOCK)
    assert served.proposer.block_rows(40) == (2, 2)  # the cut block: 2 drafted slots, 2 mask rows
    observed = probes.measure(served, full_zoo.traffic, MAX_NEW_TOKENS)
    ranked = [h.name for h in rank_hypotheses(observed, run.result.reference, run.result.faults)]
    assert ranked[0] == probes.SHORT_BLOCK
    assert "whole block" in probes.fault_deployments(target, drafter, prompts, 7)[1][probes.SHORT_BLOCK]
    for bad in (0, 8):
        with pytest.raises(BlockdraftError, match=f"--num-speculative-tokens {bad} must be between 1 and 7"):
            probes.fault_deployments(target, drafter, prompts, bad)
