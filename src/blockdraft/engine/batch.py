"""Batched speculative decoding: the running sequences draft, verify together in one target forward, and commit
each its own accepted tokens; sequences join after their prefill and leave when done (continuous batching). On
the fast engine the sequences joining at one step boundary are prefilled together, in one forward.

Each sequence keeps everything `generate()` keeps for one: its ids, its proposer (drafter context), its sampling
generator, consumed in the same order (propose, then verify, each step), so a sequence's ids in a batch are its
batch-1 ids. The verify step is the engine's (engine/verifiers.py): on the fast engine one forward over [B, R]
rows, each sequence with its own positions, cache length and tree mask; on the HF engine (any model, hybrid ones
included) each sequence's own forward in turn. On the fast engine the drafter runs once per step for the whole
batch too (fast/batch_drafter.py: every sequence's drafter context in a slot, one pass over all blocks, one
context extension for all committed rows; a lone sequence on `generate()`'s batch-1 drafter, as it verifies on
the target's batch-1 path); each sequence's proposer only turns its slot logits into its chain or tree. Elsewhere
each proposer drafts its own sequence. A lone greedy sequence on the fast engine runs `generate()`'s fused steps
(decoding/fused_steps.py: the draft, verify, walk and commit as two graph replays and one read a step).

Steps are pipelined one deep: `step()` reads the step in flight, commits it, launches the next, and only then hands
the commits to the sequences' hooks (the server's text work), which so run while the device works. Sequences join
while a step flies (its results are first copied out of the buffers the join's forwards write); one that its hook
ends leaves at the next read, the flying step's rows for it dropped. A lone sequence's fused steps run two deep: the
next is launched before the one in flight is read, so the host's graph launches overlap the device's work.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from blockdraft.decoding.draft import Draft, Proposer
from blockdraft.decoding.fused_steps import FusedSteps
from blockdraft.decoding.generate import OnCommit, check_context, check_prompt_ids
from blockdraft.decoding.sampling import SamplingParams, pick
from blockdraft.decoding.logprobs import position_logprobs, step_logprobs
from blockdraft.decoding.row_processing import processed_rows
from blockdraft.decoding.verify import Verdict, draft_picks, greedy_read, greedy_walks, verify
from blockdraft.engine import batch_drafts
from blockdraft.engine.deferred_taps import DeferredTaps
from blockdraft.engine.flight import Flight, FusedRead
from blockdraft.engine.lone_steps import LoneSteps
from blockdraft.engine.measured import MeasuredSchedule
from blockdraft.engine.candidate import Candidate
from blockdraft.engine.schedule import Schedule
from blockdraft.engine.sequence import Request, Sequence
from blockdraft.engine.switching import SwitchingProposer
from blockdraft.engine.verifiers import LoopVerifier, SlotVerifier, Verified
from blockdraft.synthetic_acceptance import check_greedy
from blockdraft.errors import BlockdraftError
from blockdraft.fast.batch_drafter import BatchDrafter
from blockdraft.fast.target import PREFILL_ROWS
from blockdraft.models.host_to_device import long_tensor
from blockdraft.models.target import Target


class BatchDecoder:
    """Up to `max_seqs` sequences decoded together; `new_proposer()` gives each joining sequence its own proposer
    (None for AR). With a `schedule`, every step's method is the schedule's pick for the running batch size (a
    MeasuredSchedule also hears how each step went), and the proposers must be SwitchingProposers."""

    def __init__(self, target: Target, new_proposer: Callable[[], Proposer | None], max_seqs: int,
                 schedule: Schedule | MeasuredSchedule | None = None) -> None:
        if max_seqs < 1:
            raise BlockdraftError(f"--batch-size {max_seqs} must be >= 1")
        self.target = target
        self.new_proposer = new_proposer
        self.max_seqs = max_seqs
        self.schedule = schedule
        self.verifier: SlotVerifier | LoopVerifier = (
            SlotVerifier(target, max_seqs) if target.batch_slots else LoopVerifier(target, max_seqs))
        self.running: list[Sequence] = []  # sequence i lives in cache slot i (and drafter slot i)
        self.drafting: BatchDrafter | None = None  # made by the first sequence that drafts on the fast engine
        self.last_method = ""  # the method of the last step read ("ar", "dflash", "ddtree", or a schedule's label)
        self.last_committed = 0  # the tokens the last step read committed, every sequence's together
        self.flight: Flight | None = None  # the step launched and not read back yet
        self.deferred = DeferredTaps()  # a schedule's AR steps' taps, until a step drafts
        self.lone = LoneSteps(target)  # a lone greedy sequence's fused steps

    def _batch_drafter(self, proposer: Proposer | None) -> BatchDrafter | None:
        """The batch's drafter, when the proposers draft with a drafter the batched pass can run
        (`Proposer.batch_drafter`) on a target whose slots hold it."""
        drafter = proposer.batch_drafter if proposer is not None else None
        if self.drafting is None and self.target.batch_slots and drafter is not None:
            self.drafting = BatchDrafter(drafter, self.target, self.max_seqs)  # type: ignore[arg-type]
        return self.drafting

    @property
    def free(self) -> int:
        return self.max_seqs - len(self.running)

    def reserve(self, positions: int) -> None:
        """K/V room for `positions` positions in every slot, the target's and the batch drafter's, now: a buffer that
        grows later drops every CUDA graph captured on it, and the next steps capture them again (a server reserves
        its --max-model-len before its warm-up captures, as vLLM allocates its KV cache at start-up)."""
        self.verifier.reserve(positions)
        drafting = self._batch_drafter(self.new_proposer())
        if drafting is not None:
            drafting.reserve(positions)

    def check(self, request: Request) -> None:
        """Refuse a request that cannot run (too long for the context, ids outside the vocabulary), as `generate()`
        does, before it joins: a bad request must not fail the others prefilled with it."""
        check_context(self.target, len(request.prompt_ids), request.max_new_tokens)
        check_prompt_ids(self.target.embedding_weight.shape[0], request.prompt_ids)
        check_greedy(self.target.synthetic, request.sampling.greedy)

    def join(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
             stop_token_ids: tuple[int, ...] = (), seed: int = 0, on_commit: OnCommit | None = None) -> Sequence:
        """`join_many` of one request."""
        return self.join_many([Request(prompt_ids, max_new_tokens, sampling, stop_token_ids, seed, on_commit)])[0]

    @torch.inference_mode()
    def join_many(self, requests: list[Request]) -> list[Sequence]:
        """Prefill new sequences (as `generate()` does) and add them to the batch; one that is done at its first
        token (a stop, max_new_tokens 1) is returned finished and never takes a slot. On the fast engine prompts
        are prefilled together, packed into forwards of up to PREFILL_ROWS rows (a lone prompt, or one too long to
        share, takes the batch-1 prefill)."""
        if len(requests) > self.free:
            raise BlockdraftError(f"the batch is full: room for {self.free} more of {self.max_seqs} sequences, not "
                                  f"{len(requests)}; wait for some to finish")
        for request in requests:
            self.check(request)
        flight = self.flight
        if flight is not None and self._counted(flight) and self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)  # the step's device work is its own, not the join's
        began = time.perf_counter()
        if flight is not None:
            flight.detach()
        joined: list[Sequence] = []
        before = len(self.running)
        try:
            for group in self._prefill_groups(requests):
                joined.extend(self._join_together(group) if len(group) > 1 else [self._join_alone(group[0])])
        except BaseException:  # all or none: the caller answers every request of a failed join
            del self.running[before:]
            raise
        finally:
            if flight is not None:
                flight.join_s += time.perf_counter() - began
        return joined

    def _counted(self, flight: Flight) -> bool:
        """Whether the measured schedule counts this step's time: a join while it flies then first waits for its
        device work, so the join's time can be taken out of the step's exactly. At concurrency 64 on the H200
        most steps carried a join; left uncounted, a phase ran DDTree@32 97 steps at 0.4x DFlash before it
        could drop it (benchmarks/RESULTS.md, 2026-12-03)."""
        return (self.schedule is not None and flight.candidate is not None
                and self.schedule.counting(len(flight.seqs)))

    def _prefill_groups(self, requests: list[Request]) -> list[list[Request]]:
        """Requests in arrival order, cut into groups whose packed prefill fits PREFILL_ROWS (each its own group
        where prompts cannot be prefilled together)."""
        if not self.verifier.shares_forward:
            return [[request] for request in requests]
        groups: list[list[Request]] = []
        rows = 0
        for request in requests:
            n = len(request.prompt_ids)
            if groups and rows + n <= PREFILL_ROWS:
                groups[-1].append(request)
                rows += n
            else:
                groups.append([request])
                rows = n
        return groups

    def _start(self, request: Request, logits: torch.Tensor, ttft_s: float, joined: float, proposer: Proposer | None,
               generator: torch.Generator) -> Sequence:
        """A joined sequence with its first token, picked from the prefill's last row `logits` [1, V] under its
        grammar and penalties (`processed_rows`)."""
        masked, picked = processed_rows(logits, [], [], [], request.prompt_ids, request.sampling,
                                        frozenset(request.stop_token_ids), request.grammar)
        first = int(pick(picked[0], request.sampling, generator).item())
        seq = Sequence(len(request.prompt_ids), request.max_new_tokens, request.sampling, generator,
                       frozenset(request.stop_token_ids), proposer, request.on_commit, [first], ttft_s, joined,
                       prompt=request.prompt_ids, grammar=request.grammar)
        if request.grammar is not None:
            request.grammar.accept([first])
        if request.sampling.logprobs is not None:
            seq.logprobs = request.logprobs_out if request.logprobs_out is not None else []
            seq.logprobs.extend(position_logprobs(masked, [first], request.sampling.logprobs))
        seq.stopped_on = first if first in seq.stops else None
        if proposer:
            proposer.observe([*request.prompt_ids, first])
            proposer.constrain(request.grammar)
        seq.ended_early = bool(request.on_commit and request.on_commit([first]))
        if seq.done:
            seq.finished = time.perf_counter()
        return seq

    def _new_proposer(self) -> Proposer | None:
        proposer = self.new_proposer()
        if proposer:
            proposer.reset()
        return proposer

    def _join_alone(self, request: Request) -> Sequence:
        """`generate()`'s own prefill (the target's batch-1 path), then the K/V into the sequence's slot."""
        target, device, prompt_ids = self.target, self.target.device, request.prompt_ids
        proposer = self._new_proposer()
        generator = torch.Generator(device=device).manual_seed(request.seed)
        joined = time.perf_counter()
        self.verifier.before_prefill()
        cache = target.new_cache()
        prompt = long_tensor(prompt_ids, device).unsqueeze(0)
        out = target.forward(prompt, torch.arange(len(prompt_ids), device=device), cache,
                             proposer.tap_layers if proposer else None, last_logits_only=True)
        seq = self._start(request, out.logits[0, -1:], time.perf_counter() - joined, joined, proposer, generator)
        if seq.done:
            return seq
        slot = len(self.running)
        if proposer:
            self._start_contexts([slot], [proposer], [out.taps])
        self.verifier.load(slot, cache)
        self.running.append(seq)
        return seq

    def _join_together(self, group: list[Request]) -> list[Sequence]:
        """One packed prefill forward for the whole group, into the slots after the running ones; those that go on
        are then packed into consecutive slots and their drafter contexts extended together."""
        assert self.verifier.shares_forward
        device, first = self.target.device, len(self.running)
        proposers = [self._new_proposer() for _ in group]
        generators = [torch.Generator(device=device).manual_seed(request.seed) for request in group]
        joined = time.perf_counter()
        tap_layers = proposers[0].tap_layers if proposers[0] else None
        logits, taps = self.verifier.prefill(first, [request.prompt_ids for request in group], tap_layers)
        seqs: list[Sequence] = []
        extended: list[int] = []
        drafting: list[Proposer] = []
        contexts: list[torch.Tensor] = []
        for b, (request, proposer, generator) in enumerate(zip(group, proposers, generators)):
            seq = self._start(request, logits[b : b + 1], time.perf_counter() - joined, joined, proposer, generator)
            seqs.append(seq)
            if seq.done:
                continue
            slot = len(self.running)
            if slot != first + b:
                self.verifier.move(first + b, slot)
            if proposer and taps is not None:
                extended.append(slot)
                drafting.append(proposer)
                contexts.append(taps[b])
            self.running.append(seq)
        if extended:
            self._start_contexts(extended, drafting, contexts)
        return seqs

    def _start_contexts(self, slots: list[int], proposers: list[Proposer], contexts: list[torch.Tensor]) -> None:
        """New sequences' drafter contexts from their prompts' taps: in the batch's drafter, one extension for all
        (the batched pass runs), else each proposer its own."""
        batch_drafter = self._batch_drafter(proposers[0])
        if batch_drafter is None:
            for proposer, context in zip(proposers, contexts):
                proposer.add_context(context)
            return
        for slot in slots:
            batch_drafter.reset(slot)
        batch_drafter.extend(slots, contexts)

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Read one draft -> verify step (launched now if none is in flight) and commit it, launch the next for the
        sequences that go on, then hand this step's commits to their hooks while the device runs that one; returns
        the sequences that finished (they left).

        Why the overlap: on the H200 a served step's device was busy a fifth to two fifths of it, the rest host work
        (benchmarks/RESULTS.md, 2026-12-02). A hook's work (the server's text, stop strings, the outbox) now runs
        while the device works, as vLLM's async scheduling does; a hook that ends its sequence (a stop string, a
        client gone) ends it at the next read, and what the step in flight computed for it is dropped. A lone
        sequence's fused steps go one further (`_launch_ahead`): its next step is launched before this one is read."""
        if self.flight is None:
            if not self.running:
                return []
            self.flight = self._launch()
        flight, self.flight = self.flight, None
        ahead = self._launch_ahead(flight)
        finished, reports = self._land(flight)
        if ahead is not None and any(seq is ahead.seqs[0] for seq in finished):  # it ended: the step after, dropped
            ahead.detach()
            ahead = None
        self.flight = ahead
        if self.flight is None and self.running:
            self.flight = self._launch()
        for seq, committed in reports:
            if seq.on_commit is not None and seq.on_commit(committed):
                seq.ended_early = True
        return finished

    def _launch(self) -> Flight:
        """Draft and verify every running sequence, reading nothing back (host-built trees read the drafter's scores)."""
        device, began, batch = self.target.device, time.perf_counter(), len(self.running)
        candidate = None
        if self.schedule is not None:
            candidate = self.schedule.pick(batch)
            for seq in self.running:
                switching: SwitchingProposer = seq.proposer  # type: ignore[assignment]  # a schedule's
                switching.use(candidate)
        proposer = self.running[0].proposer
        method = candidate.label if candidate is not None else proposer.name if proposer else "ar"
        deferring = candidate is not None and candidate.method == "ar"
        if candidate is not None and not deferring:
            self._catch_up()
        steps = self._lone_steps()
        if steps is not None:
            return self._launch_fused(steps, candidate, method, began)
        self.lone.laid_out_for = None
        starts = [seq.prompt_len + len(seq.tokens) - 1 for seq in self.running]
        tap_layers = proposer.tap_layers if proposer else None
        trees = None
        if self.drafting is not None and self.verifier.shares_forward:
            compiled = self.target.ops.compiled  # type: ignore[attr-defined]  # a static-cache target's units
            trees = batch_drafts.device_trees(self.drafting, self.running, starts, compiled)
        if trees is not None:
            verified = self.verifier.forward_rows(  # type: ignore[union-attr]
                trees.ids, trees.positions, trees.own, tap_layers)
            assert verified.logits is not None
            return Flight(list(self.running), starts, None, trees, verified,
                          trees.readout(verified.logits, self.target.synthetic),
                          candidate, deferring, method, began)
        drafts = batch_drafts.drafts(self.drafting, self.running, starts) if self.drafting is not None else [
            seq.proposer.propose(seq.tokens[-1], start, seq.max_new_tokens - len(seq.tokens), seq.sampling,
                                 seq.generator) if seq.proposer else Draft.empty(device)
            for seq, start in zip(self.running, starts)]
        verified = self.verifier.forward([seq.tokens[-1] for seq in self.running], drafts, starts, tap_layers)
        return Flight(list(self.running), starts, drafts, None, verified, self._greedy_read(drafts, verified),
                      candidate, deferring, method, began)

    def _launch_ahead(self, flight: Flight) -> Flight | None:
        """A lone sequence's next fused step, launched before `flight` (its fused step) is read when the sequence
        runs on alone with the same steps and a whole step's depth is left after this one's commit: the host's
        launches then overlap the device's work on `flight` instead of following its read (`generate()` runs its
        fused steps so, decoding/fused_steps.py). Not under a schedule, whose pick waits for this step's time."""
        if flight.fused is None or self.schedule is not None or len(self.running) != 1:
            return None
        seq, steps = self.running[0], flight.fused.steps  # the flight's own sequence: joins only append
        depth_left = seq.max_new_tokens - len(seq.tokens)  # before the flight's commit
        if seq.done or self._lone_steps() is not steps or not steps.whole_step(depth_left, unread=1):
            return None
        return self._launch_fused(steps, None, flight.method, time.perf_counter())

    def _lone_steps(self) -> FusedSteps | None:
        """The fused steps of this step's method when one sequence runs alone on a target with fused steps and a
        verifier whose lone sequence takes the batch-1 paths (`LoneSteps.steps`); None otherwise: the step below."""
        if len(self.running) != 1 or not self.target.fused or not self.verifier.shares_forward:
            return None
        return self.lone.steps(self.running[0], self.drafting)

    def _launch_fused(self, steps: FusedSteps, candidate: Candidate | None, method: str, began: float) -> Flight:
        """The lone sequence's fused step (`LoneSteps.launch`)."""
        verifier: SlotVerifier = self.verifier  # type: ignore[assignment]  # shares its forward: a lone sequence's
        return self.lone.launch(steps, self.running[0], verifier, self.drafting, candidate, method, began)

    def _greedy_read(self, drafts: list[Draft], verified: Verified) -> torch.Tensor | None:
        """The greedy sequences' verdicts as one device tensor to read back (`verify.greedy_read`; one argmax for the
        batch when its logits are one tensor); None when every sequence samples."""
        greedy = [b for b, seq in enumerate(self.running) if seq.raw_greedy]
        if not greedy:
            return None
        if verified.logits is not None:
            every = verified.logits.argmax(dim=-1)
            picks = [every[b, : len(drafts[b]) + 1] for b in greedy]
        else:
            picks = [verified.rows[b][0].argmax(dim=-1) for b in greedy]
        if self.target.synthetic is not None:  # benchmarks only: the verdicts follow a dialled profile
            picks = draft_picks(self.target.synthetic, [drafts[b] for b in greedy], picks)
        return greedy_read([drafts[b] for b in greedy], picks)

    def _land(self, flight: Flight) -> tuple[list[Sequence], list[tuple[Sequence, list[int]]]]:
        """Read a launched step back (the step's one wait for the device), commit each sequence's tokens (cut at
        its budget and stop ids), keep its cache rows, extend its drafter context, and let the finished leave;
        returns them and each committed chunk, for the hooks."""
        assert self.running[: len(flight.seqs)] == flight.seqs  # joins only append while a step is in flight
        if flight.fused is not None:
            return self._land_fused(flight, flight.fused)
        device = self.target.device
        read = None if flight.read is None else flight.read.tolist()
        if flight.trees is not None:  # every sequence greedy on the raw logits: nothing to process
            drafts, verdicts = flight.trees.walks(read)  # type: ignore[arg-type]
            seen = [logits for logits, _ in flight.verified.rows]
        else:
            assert flight.drafts is not None
            drafts = flight.drafts
            rows = [seq.processed(logits, draft) for seq, draft, (logits, _) in
                    zip(flight.seqs, drafts, flight.verified.rows)]
            verdicts = self._verdicts(flight, read, [picked for _, picked in rows])
            seen = [masked for masked, _ in rows]
        extended: list[int] = []
        kept_taps: list[torch.Tensor] = []
        reports: list[tuple[Sequence, list[int]]] = []
        whole = flight.verified.taps  # every sequence's kept taps its first rows: one copy for the batch
        base = self._defer(flight, whole) if flight.deferring else 0
        for slot, (seq, draft, start, verdict, logits, (_, taps)) in enumerate(
                zip(flight.seqs, drafts, flight.starts, verdicts, seen, flight.verified.rows)):
            if seq.ended_early:  # its hook ended it after this step was launched: nothing of the step is kept
                continue
            seq.draft_lengths.append(len(draft))
            top = seq.sampling.logprobs
            logprobs = None if top is None else step_logprobs(logits, verdict, top)
            committed = seq.commit(verdict.tokens + [verdict.bonus], logprobs)
            reports.append((seq, committed))
            produced = len(committed)
            rows = None if draft.is_chain else long_tensor(
                [0] + [node + 1 for node in verdict.accepted][: produced - 1], device)
            self.verifier.keep(slot, start, rows, produced)
            if seq.proposer and taps is not None:
                if flight.deferring:  # an AR step: its one token's taps wait in `deferred` for the next drafting step
                    if produced:
                        seq.pending.append(base + slot)
                    continue
                extended.append(slot)
                kept_taps.append(taps[:, :produced] if rows is None else taps[:, rows])
        if self.deferred.full:
            self._catch_up()
        chains = (whole is not None and not flight.deferring and extended == list(range(len(flight.seqs)))
                  and all(draft.is_chain for draft in drafts))
        self._extend(extended, kept_taps, whole if chains else None)
        return self._landed(flight, reports), reports

    def _land_fused(self, flight: Flight, fused: FusedRead) -> tuple[list[Sequence],
                                                                   list[tuple[Sequence, list[int]]]]:
        """A fused step's read: the cache and drafter context already hold its commit (its graphs wrote them)."""
        seq = flight.seqs[0]
        nodes, tokens = fused.take()
        reports: list[tuple[Sequence, list[int]]] = []
        if not seq.ended_early:
            seq.draft_lengths.append(nodes)
            reports.append((seq, seq.commit(tokens)))
        return self._landed(flight, reports), reports

    def _landed(self, flight: Flight, reports: list[tuple[Sequence, list[int]]]) -> list[Sequence]:
        """A read step's end: the finished leave, and the step's method, commit and time are recorded."""
        finished = self._leave()
        self.last_method = flight.method
        self.last_committed = sum(len(committed) for _, committed in reports)
        if self.schedule is not None and flight.candidate is not None:
            seconds = time.perf_counter() - flight.began - flight.join_s
            self.schedule.observe(len(flight.seqs), flight.candidate, seconds, self.last_committed)
        return finished

    def _extend(self, slots: list[int], taps: list[torch.Tensor], whole: torch.Tensor | None = None) -> None:
        """Write committed tokens' taps [1, t, k * hidden] into the drafter context of the sequences in `slots`
        (`whole`: BatchDrafter.extend's)."""
        if self.drafting is not None:
            self.drafting.extend(slots, taps, whole)
            return
        for slot, tap in zip(slots, taps):
            proposer = self.running[slot].proposer
            assert proposer is not None
            proposer.add_context(tap)

    def _defer(self, flight: Flight, whole: torch.Tensor | None) -> int:
        """A scheduled AR step's taps (every sequence's one row), copied out of the forward's buffers (a graph's are
        valid until its next replay) into the deferred taps in one copy for the batch; the index of its first
        row."""
        if whole is not None:
            return self.deferred.defer(whole[:, :1].clone())
        rows = [taps for _, taps in flight.verified.rows]
        assert all(taps is not None for taps in rows)  # a schedule's sequences all tap (SwitchingProposer)
        return self.deferred.defer(torch.cat([taps[:, :1] for taps in rows]))  # type: ignore[index]

    def _catch_up(self) -> None:
        """Before a step that drafts, and once PENDING_MAX AR steps wait: their context in one extension."""
        waiting = self.deferred.take(self.running)
        if waiting is not None:
            self._extend(*waiting)

    def _verdicts(self, flight: Flight, read: list[int] | None, picked: list[torch.Tensor]) -> list[Verdict]:
        """Each sequence's verdict: the raw-greedy ones from the step's read, the others from their rows as they
        pick from them (`picked`: under their grammar and penalties), the sampled ones each with its own generator,
        as alone."""
        assert flight.drafts is not None
        greedy = [b for b, seq in enumerate(flight.seqs) if seq.raw_greedy]
        walked = iter(greedy_walks([flight.drafts[b] for b in greedy], read or []))
        return [next(walked) if seq.raw_greedy else verify(draft, rows, seq.sampling, seq.generator,
                                                             self.target.synthetic)
                for seq, draft, rows in zip(flight.seqs, flight.drafts, picked)]

    def _leave(self) -> list[Sequence]:
        """Drop finished sequences; the last running sequence moves into each freed slot."""
        finished = [seq for seq in self.running if seq.done]
        now = time.perf_counter()
        for seq in finished:
            seq.finished = now
            slot, last = self.running.index(seq), len(self.running) - 1
            if slot != last:
                self.verifier.move(last, slot)
                if self.drafting is not None:
                    self.drafting.move(last, slot)
                self.running[slot] = self.running[last]
            self.running.pop()
        return finished

