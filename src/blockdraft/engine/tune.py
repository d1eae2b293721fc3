"""`blockdraft tune`: measure on this device what a batched step costs and what the drafter accepts, and pick the
speculation schedule from both (engine/schedule.py).

Costs are the batched engine's own operations, timed after a warm-up (median of `repeats`, the device synchronised
around each): one verify forward over B sequences x R rows at `context` tokens of cache each (batch 1: the target's
own batch-1 forward, which a lone sequence runs; more: `BatchForward`, CUDA graphs per batch bucket), one batched
drafter step for B sequences (`BatchDrafter`: the pass over every block, then the context extension of a whole
block per sequence, the most a step commits), one DDTree build per budget (and a whole batch's, built together),
and the rest of a step: a whole step of the batched engine itself over B sequences, less the timed parts of it above
(reading the verdicts back, the commits, the cache bookkeeping, and, given the server's per-commit hook, the text
each commit adds). That is AR's step for every candidate (commit_s), and each speculative candidate passed in
`candidates` its own step too (commit_by_candidate_s): landing a DDTree@32 step took 20x an AR step's host time
on a CPU (benchmarks/commit_cost.py), which AR's alone left out of the schedule.
Acceptance is measured by decoding the prompts greedily: the DFlash chain over the whole block (per-position rates)
and DDTree at each budget (tau), its trees holding the prompt-lookup chain the server will run with (`--lookup`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from blockdraft.decoding.ddtree import build_tree, build_trees
from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import OnCommit, generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.batch_sizes import bucket_sizes
from blockdraft.engine.sequence import Request
from blockdraft.engine.acceptance import AcceptanceProfile
from blockdraft.engine.candidate import AR, Candidate
from blockdraft.engine.cost_table import CostTable
from blockdraft.engine.schedule import choose, Schedule
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.fast.batch import BatchForward, BatchKV
from blockdraft.fast.batch_drafter import BatchDrafter
from blockdraft.fast.drafter import fast_drafter_problem
from blockdraft.fast.target import FastTarget
from blockdraft.models.target import Target


def _seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of `run` after one warm-up call, waiting for the device around each."""
    cuda = device.type == "cuda"
    times = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def measure_costs(target: Target, drafter: DFlashDrafter, target_name: str, drafter_name: str,
                  batch_sizes: list[int], rows: list[int], budgets: list[int], context: int,
                  repeats: int, commit_work: Callable[[], OnCommit] | None = None, *,
                  candidates: Sequence[Candidate] = (), lookup: int = 0,
                  say: Callable[[str], None] = lambda line: None) -> CostTable:
    """The cost table of the batched engine on this device (see the module docstring); `commit_work()` gives each
    timed sequence the hook the server runs on its commits (its text), so the host work is the server's. Each
    speculative candidate in `candidates` gets its own host work, DDTree's with the prompt-lookup chain of
    `lookup` tokens the server's trees hold (its search and merge); one whose device work the table cannot cost (its
    rows or budget not measured) is skipped, not failed: without a device time its step cannot be split, and it
    pays AR's host work as tables without commit_by_candidate_s do. `say` gets each part's times as they are
    measured, so a run stopped at a time limit still tells what it timed."""
    if not target.batch_slots:
        raise BlockdraftError("tune times the batched engine, which needs the fast engine's batch slots: pass "
                              "--engine fast")
    device = target.device
    verify_s = verify_seconds(target, drafter.cfg.target_layer_ids, batch_sizes, rows, context, repeats, say)
    draft_s = _draft_costs(target, drafter, batch_sizes, context, repeats)
    say("drafter step: " + _ms_line(draft_s))
    ar_steps = _steps(target, drafter, AR, batch_sizes, context, repeats, commit_work)
    say("whole AR step: " + _ms_line(ar_steps))
    commit_s = {batch: max(0.0, ar_steps[batch] - verify_s[batch][1]) for batch in batch_sizes if 1 in verify_s[batch]}
    log_probs = torch.randn(drafter.cfg.block_size - 1, target.vocab_size, device=device).log_softmax(-1)
    tree_build_s = {b: _seconds(lambda b=b: build_tree(log_probs, b), device, repeats) for b in budgets}
    trees_s = {batch: {b: _seconds(lambda b=b, rows=log_probs.expand(batch, -1, -1): build_trees(
        rows, [rows.shape[1]] * batch, b), device, repeats) for b in budgets} for batch in batch_sizes}
    table = CostTable(device=device.type, dtype=str(target.dtype).removeprefix("torch."), target=target_name,
                      drafter=drafter_name, context_tokens=context, verify_s=verify_s,
                      draft_s=draft_s, tree_build_s=tree_build_s, commit_s=commit_s, trees_s=trees_s)
    for candidate in {c.label: c for c in candidates if c != AR}.values():
        try:
            device_s = {batch: table.device_time(batch, candidate) for batch in batch_sizes}
        except BlockdraftError:
            continue
        steps = _steps(target, drafter, candidate, batch_sizes, context, repeats, commit_work, lookup)
        say(f"whole {candidate.label} step: " + _ms_line(steps))
        table.commit_by_candidate_s[candidate.label] = {batch: max(0.0, steps[batch] - device_s[batch])
                                                        for batch in batch_sizes}
    return table


@torch.inference_mode()
def verify_seconds(target: FastTarget, taps: tuple[int, ...] | None, batch_sizes: list[int], rows: list[int],
                   context: int, repeats: int,
                   say: Callable[[str], None] = lambda line: None) -> dict[int, dict[int, float]]:
    """Seconds of the target's verify forward of `rows` causal rows over each batch size's sequences of `context`
    cached tokens, tapping `taps`: batch 1 on the batch-1 path, more through `BatchForward` (the server's graphs);
    `say` gets each batch size's times as they are measured."""
    device = target.device
    store = BatchKV.for_target(target, max(batch_sizes), context + max(rows))
    batched = BatchForward(target, store)
    single = target.new_cache()
    target.forward(torch.randint(0, target.vocab_size, (1, context), device=device), torch.arange(context, device=device),
                   single, last_logits_only=True)

    def one_sequence(ids: torch.Tensor, positions: torch.Tensor) -> None:
        target.forward(ids, positions, single, taps)
        single.crop(context)

    verify_s: dict[int, dict[int, float]] = {}
    for batch in batch_sizes:
        store.lengths[:batch] = [context] * batch
        verify_s[batch] = {}
        for r in rows:
            ids = torch.randint(0, target.vocab_size, (batch, r), device=device)
            positions = (context + torch.arange(r, device=device)).expand(batch, r)
            own = torch.ones(r, r, dtype=torch.bool, device=device).tril().expand(batch, r, r)
            run = ((lambda: one_sequence(ids, positions[0])) if batch == 1 else
                   (lambda: batched(ids, positions, own, taps)))
            verify_s[batch][r] = _seconds(run, device, repeats)
        say(f"verify at batch {batch}: " + ", ".join(f"{r} rows {1000 * t:.3f} ms" for r, t in verify_s[batch].items()))
    return verify_s


def _ms_line(seconds: dict[int, float]) -> str:
    """Times by batch size, as `say` prints them: 'B=1 1.234 ms, B=4 ...'."""
    return ", ".join(f"B={batch} {1000 * t:.3f} ms" for batch, t in seconds.items())


def _steps(target: FastTarget, drafter: DFlashDrafter, candidate: Candidate, batch_sizes: list[int], context: int,
           repeats: int, commit_work: Callable[[], OnCommit] | None, lookup: int = 0) -> dict[int, float]:
    """Seconds of one whole `candidate` step of the batched engine over each batch size's sequences of `context`
    prompt tokens, in one decoder with the largest batch's slots (as a server's, graphs and buffers shared across
    sizes). The sequences are then ended where they are, as a hook ends one: decoding them out would time nothing."""
    lookup = lookup if candidate.method == "ddtree" else 0  # the chain is DDTree's alone
    decoder = BatchDecoder(target, lambda: build_proposer(candidate.method, target, drafter, candidate.budget,
                                                          candidate.draft_tokens or None, lookup), max(batch_sizes))
    prompt = torch.randint(0, target.vocab_size, (context,)).tolist()
    tokens = _step_tokens(target, context, candidate.rows, repeats)
    seconds: dict[int, float] = {}
    for batch in batch_sizes:
        decoder.join_many([Request(prompt, tokens, on_commit=commit_work() if commit_work else None)
                           for _ in range(batch)])
        decoder.step()  # graphs for this shape, off the clock
        seconds[batch] = _seconds(decoder.step, target.device, repeats)
        for seq in decoder.running:
            seq.ended_early = True
        while decoder.running:  # the step in flight is landed, its rows dropped, and the sequences leave
            decoder.step()
    return seconds


def _step_tokens(target: Target, context: int, rows: int, repeats: int) -> int:
    """max_new_tokens of a timed sequence: room for the untimed step, the timed ones and the step in flight at the
    end to commit up to `rows` tokens each, so every timed step drafts in full and none ends a sequence; within the
    target's window, which must also hold the `rows` a verify writes past the commits."""
    wanted = (repeats + 4) * rows
    limit = target.max_positions
    if limit is None:
        return wanted
    if limit - context - rows < repeats + 4:
        raise BlockdraftError(f"--context {context} leaves {limit - context} of the target's {limit} positions; "
                              f"timing {rows}-row steps needs {rows + repeats + 4}: lower --context or --repeats")
    return min(wanted, limit - context - rows)


def _draft_costs(target: FastTarget, drafter: DFlashDrafter, batch_sizes: list[int], context: int,
                 repeats: int) -> dict[int, float]:
    """Seconds of one drafting step per batch size: the batched pass and extension, or, for a drafter only the
    eager path runs (the batch engine then drafts each sequence in turn), batch x one sequence's pass."""
    device = target.device
    width = len(drafter.cfg.target_layer_ids) * target.hidden_size
    if fast_drafter_problem(drafter) is not None:
        proposer = DFlashProposer(drafter, target)
        proposer.add_context(torch.randn(1, context, width, dtype=target.dtype, device=device))
        one = _seconds(lambda: proposer.propose(1, context, proposer.block_size, SamplingParams(), None), device,
                       repeats)
        return {batch: batch * one for batch in batch_sizes}
    drafting = BatchDrafter(drafter, target, max(batch_sizes))
    for slot in range(max(batch_sizes)):
        drafting.extend([slot], [torch.randn(1, context, width, dtype=target.dtype, device=device)])
    block = [torch.randn(1, drafter.cfg.block_size, width, dtype=target.dtype, device=device)]

    def draft_step(batch: int) -> None:
        drafting.draft([1] * batch, [context] * batch, [drafter.cfg.block_size - 1] * batch)
        drafting.extend(list(range(batch)), block * batch)
        drafting.store.lengths[:batch] = [context] * batch

    return {batch: _seconds(lambda batch=batch: draft_step(batch), device, repeats) for batch in batch_sizes}


def measure_acceptance(target: Target, drafter: DFlashDrafter, prompts: list[list[int]], budgets: list[int],
                       max_new_tokens: int, stop_token_ids: tuple[int, ...], source: str, lookup: int = 0
                       ) -> AcceptanceProfile:
    """Greedy per-position acceptance of the whole-block chain, and DDTree's tau at each budget, over the prompts;
    with `lookup` the trees hold the prompt-lookup chain the server's DDTree steps will hold (its tau is theirs)."""
    chain = DFlashProposer(drafter, target)
    lengths = [a for ids in prompts
               for a in generate(target, ids, chain, max_new_tokens, stop_token_ids=stop_token_ids).acceptance_lengths]
    depth = chain.block_size - 1
    per_position = [sum(1 for a in lengths if a - 1 > i) / len(lengths) for i in range(depth)]
    tree_tau = {}
    for budget in budgets:
        tree = build_proposer("ddtree", target, drafter, budget, lookup=lookup)
        steps = [a for ids in prompts
                 for a in generate(target, ids, tree, max_new_tokens, stop_token_ids=stop_token_ids).acceptance_lengths]
        tree_tau[budget] = sum(steps) / len(steps)
    chained = f", trees holding a prompt-lookup chain of up to {lookup} tokens" if lookup else ""
    return AcceptanceProfile(per_position, tree_tau, source + chained)


def auto_schedule(target: Target, drafter: DFlashDrafter, target_name: str, drafter_name: str, max_num_seqs: int,
                  depth: int, budget: int, prompts: list[list[int]], stop_token_ids: tuple[int, ...],
                  commit_work: Callable[[], OnCommit] | None = None, lookup: int = 0) -> Schedule:
    """`--schedule auto`: a short `tune` at start-up over the served sizes (AR, the chain of `depth`, the tree of
    `budget`, holding a prompt-lookup chain of up to `lookup` tokens) at batch sizes 1, 2, 4, ... up to
    `max_num_seqs`."""
    candidates = [AR, Candidate("dflash", depth), Candidate("ddtree", budget=budget)]
    return tune(target, drafter, target_name, drafter_name, bucket_sizes(max_num_seqs), candidates, 128, 3, prompts,
                32, stop_token_ids, "start-up decodes", commit_work, lookup)[1]

DEFAULT_CHAINS = (1, 3, 7)  # chain lengths `blockdraft tune` weighs by default, and the drafter's whole block


def tune_candidates(block_size: int, chains: list[int] | None, budgets: list[int]) -> list[Candidate]:
    """AR, the DFlash chains of `chains` drafted tokens (default DEFAULT_CHAINS and the whole block, those the block
    holds) and the DDTrees of `budgets` nodes: what `blockdraft tune` weighs."""
    most = block_size - 1
    lengths = sorted({d for d in (chains or DEFAULT_CHAINS) if d <= most} | ({most} if chains is None else set()))
    if not lengths or min(lengths) < 1:
        raise BlockdraftError(f"--draft-tokens {','.join(map(str, chains or []))} must list chain lengths between 1 "
                              f"and {most}")
    return [AR, *(Candidate("dflash", d) for d in lengths), *(Candidate("ddtree", budget=b) for b in budgets)]


def tune(target: Target, drafter: DFlashDrafter, target_name: str, drafter_name: str, batch_sizes: list[int],
         candidates: list[Candidate], context: int, repeats: int, prompts: list[list[int]], max_new_tokens: int,
         stop_token_ids: tuple[int, ...], source: str, commit_work: Callable[[], OnCommit] | None = None,
         lookup: int = 0, say: Callable[[str], None] = lambda line: None) -> tuple[CostTable, Schedule]:
    """`blockdraft tune`: the cost table of `candidates` at `batch_sizes` on this device, the acceptance measured on
    `prompts` (greedy decodes; `source` names them in the profile), and the schedule chosen from both."""
    budgets = sorted({c.budget for c in candidates if c.budget})
    rows = sorted({c.rows for c in candidates})
    say(f"timing {len(batch_sizes)} batch sizes x {len(rows)} row counts ...")
    costs = measure_costs(target, drafter, target_name, drafter_name, batch_sizes, rows, budgets, context, repeats,
                          commit_work, candidates=candidates, lookup=lookup, say=say)
    say(f"measuring acceptance: {source} ...")
    profile = measure_acceptance(target, drafter, prompts, budgets, max_new_tokens, stop_token_ids, source, lookup)
    return costs, choose(costs, profile, candidates, batch_sizes)
