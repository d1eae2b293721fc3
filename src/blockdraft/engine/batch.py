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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from blockdraft.decoding.ddtree import DDTreeProposer, DeviceTrees, build_trees, slot_log_probs, trees_on_device
from blockdraft.decoding.draft import DFlashProposer, Draft, DrafterProposer, Proposer
from blockdraft.decoding.fused_steps import AR_SHAPE, FusedSteps, StepShape, fused_steps, step_shape
from blockdraft.decoding.generate import GenerationResult, OnCommit, check_context, check_prompt_ids, until_stop
from blockdraft.decoding.lookup import LookupTreeProposer
from blockdraft.decoding.lookup_device import merged_trees
from blockdraft.decoding.sampling import SamplingParams, pick
from blockdraft.decoding.verify import Verdict, greedy_read, greedy_walks, verify
from blockdraft.engine.measured import MeasuredSchedule
from blockdraft.engine.schedule import Candidate, Schedule
from blockdraft.engine.switching import SwitchingProposer
from blockdraft.engine.verifiers import LoopVerifier, SlotVerifier, Verified
from blockdraft.errors import BlockdraftError
from blockdraft.metrics import SpecStats
from blockdraft.fast.batch_drafter import BatchDrafter
from blockdraft.fast.drafter import fast_drafter_problem
from blockdraft.fast.target import PREFILL_ROWS, FastTarget
from blockdraft.models.host_to_device import long_tensor
from blockdraft.fast.static_cache import StaticTargetCache
from blockdraft.models.target import Target


PENDING_MAX = 256  # scheduled AR steps whose taps may wait out of the drafter contexts (see BatchDecoder._catch_up)


@dataclass(frozen=True)
class Request:
    """What a sequence joins with: `generate()`'s arguments."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    on_commit: OnCommit | None = None


@dataclass
class Sequence:
    """One request in the batch: its ids so far, limits, sampling and drafting state, and its step record."""

    prompt_len: int
    max_new_tokens: int
    sampling: SamplingParams
    generator: torch.Generator
    stops: frozenset[int]
    proposer: Proposer | None
    on_commit: OnCommit | None
    tokens: list[int]
    ttft_s: float
    joined: float
    acceptance_lengths: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    stopped_on: int | None = None
    ended_early: bool = False
    finished: float | None = None
    pending: list[int] = field(default_factory=list)  # rows of the decoder's deferred taps: committed tokens not yet
    # in the drafter context (BatchDecoder._catch_up)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens or self.stopped_on is not None or self.ended_early

    def commit(self, committed: list[int]) -> list[int]:
        """Cut `committed` at the token budget and the first stop; record it; returns what was kept (for `on_commit`,
        which the decoder calls later, while the next step runs)."""
        committed, stopped_on = until_stop(committed, self.max_new_tokens - len(self.tokens), self.stops)
        if stopped_on is not None:
            self.stopped_on = stopped_on
        self.tokens.extend(committed)
        self.acceptance_lengths.append(len(committed))
        if self.proposer:
            self.proposer.observe(committed)
        return committed

    def result(self) -> GenerationResult:
        """What `generate()` returns for one sequence."""
        stats = SpecStats(
            method=self.proposer.name if self.proposer else "ar", num_prompts=1, prompt_tokens=self.prompt_len,
            generated_tokens=len(self.tokens), acceptance_lengths=list(self.acceptance_lengths),
            drafted_tokens=sum(self.draft_lengths), ttft_s=self.ttft_s,
            decode_s=(self.finished or time.perf_counter()) - self.joined - self.ttft_s,
        )
        return GenerationResult(token_ids=list(self.tokens), acceptance_lengths=list(self.acceptance_lengths),
                                stats=stats, stopped_on=self.stopped_on, draft_lengths=list(self.draft_lengths),
                                ended_early=self.ended_early)


@dataclass
class _FusedRead:
    """A lone sequence's fused step in flight (`BatchDecoder._launch_fused`): its steps and cache, and its read once
    taken, at the land or before a join's forwards (which move the lone K/V and drafter context by their host
    lengths, so those must follow the step's commit first)."""

    steps: FusedSteps
    cache: StaticTargetCache
    read: tuple[int, list[int]] | None = None

    def take(self) -> tuple[int, list[int]]:
        """(nodes drafted, tokens committed): the step's one wait for the device."""
        if self.read is None:
            self.read = self.steps.read(self.cache)
        return self.read


@dataclass
class _Flight:
    """A launched step not read back yet: the sequences it runs (slots 0.. at its launch), their starts and drafts
    (device trees: known at the read), the verify's output, the one tensor its read takes back, and what the
    schedule hears of it."""

    seqs: list[Sequence]
    starts: list[int]
    drafts: list[Draft] | None
    trees: DeviceTrees | None
    verified: Verified
    read: torch.Tensor | None
    candidate: Candidate | None
    deferring: bool
    method: str
    began: float
    join_s: float = 0.0  # seconds of joins run while it flew (their prefill), not the step's own
    fused: _FusedRead | None = None  # a lone sequence's fused step: nothing else of the flight is read

    def detach(self) -> None:
        """Before a join runs forwards: the verify's taps and the sampled sequences' logits copied out of the
        buffers those forwards may overwrite (the read tensor is a fresh one already); a fused step read now."""
        if self.fused is not None:
            self.fused.take()
            return
        self.verified = self.verified.detached({b for b, seq in enumerate(self.seqs) if not seq.sampling.greedy})


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
            SlotVerifier(target, max_seqs) if isinstance(target, FastTarget) else LoopVerifier(target, max_seqs))
        self.running: list[Sequence] = []  # sequence i lives in cache slot i (and drafter slot i)
        self.drafting: BatchDrafter | None = None  # made by the first sequence that drafts on the fast engine
        self.last_method = ""  # the method of the last step read ("ar", "dflash", "ddtree", or a schedule's label)
        self.last_committed = 0  # the tokens the last step read committed, every sequence's together
        self.flight: _Flight | None = None  # the step launched and not read back yet
        self.deferred: list[torch.Tensor] = []  # each scheduled AR step's taps [B, 1, *], read by _catch_up
        self.deferred_rows = 0  # rows in `deferred`: a sequence's `pending` index them as if concatenated
        self.fused: dict[StepShape, FusedSteps] = {}  # a lone sequence's fused steps, per method (`_lone_steps`)
        self.fused_for: tuple[Sequence, FusedSteps] | None = None  # whose next rows the last fused step laid out

    def _batch_drafter(self, proposer: Proposer | None) -> BatchDrafter | None:
        """The batch's drafter, when the proposers draft with a drafter the batched pass can run."""
        if (self.drafting is None and isinstance(self.target, FastTarget)
                and isinstance(proposer, (DFlashProposer, DDTreeProposer, SwitchingProposer))
                and fast_drafter_problem(proposer.drafter) is None):
            self.drafting = BatchDrafter(proposer.drafter, self.target, self.max_seqs)
        return self.drafting

    @property
    def free(self) -> int:
        return self.max_seqs - len(self.running)

    def reserve(self, positions: int) -> None:
        """K/V room for `positions` positions in every slot, the target's and the batch drafter's, now: a buffer that
        grows later drops every CUDA graph captured on it, and the next steps capture them again (a server reserves
        its --max-model-len before its warm-up captures, as vLLM allocates its KV cache at start-up)."""
        if not isinstance(self.verifier, SlotVerifier):
            return
        self.verifier.store.ensure(positions)
        drafting = self._batch_drafter(self.new_proposer())
        if drafting is not None:
            drafting.reserve(positions)

    def check(self, request: Request) -> None:
        """Refuse a request that cannot run (too long for the context, ids outside the vocabulary), as `generate()`
        does, before it joins: a bad request must not fail the others prefilled with it."""
        check_context(self.target, len(request.prompt_ids), request.max_new_tokens)
        check_prompt_ids(self.target.embedding_weight.shape[0], request.prompt_ids)

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

    def _counted(self, flight: _Flight) -> bool:
        """Whether the measured schedule counts this step's time: a join while it flies then first waits for its
        device work, so the join's time can be taken out of the step's exactly. At concurrency 64 on the H200
        most steps carried a join; left uncounted, a phase ran DDTree@32 97 steps at 0.4x DFlash before it
        could drop it (benchmarks/RESULTS.md, session 23)."""
        return (isinstance(self.schedule, MeasuredSchedule) and flight.candidate is not None
                and self.schedule.counting(len(flight.seqs)))

    def _prefill_groups(self, requests: list[Request]) -> list[list[Request]]:
        """Requests in arrival order, cut into groups whose packed prefill fits PREFILL_ROWS (each its own group
        where prompts cannot be prefilled together)."""
        if not isinstance(self.verifier, SlotVerifier):
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

    def _start(self, request: Request, first: int, ttft_s: float, joined: float, proposer: Proposer | None,
               generator: torch.Generator) -> Sequence:
        seq = Sequence(len(request.prompt_ids), request.max_new_tokens, request.sampling, generator,
                       frozenset(request.stop_token_ids), proposer, request.on_commit, [first], ttft_s, joined)
        seq.stopped_on = first if first in seq.stops else None
        if proposer:
            proposer.observe([*request.prompt_ids, first])
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
        first = int(pick(out.logits[0, -1], request.sampling, generator).item())
        seq = self._start(request, first, time.perf_counter() - joined, joined, proposer, generator)
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
        assert isinstance(self.verifier, SlotVerifier)
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
            token = int(pick(logits[b], request.sampling, generator).item())
            seq = self._start(request, token, time.perf_counter() - joined, joined, proposer, generator)
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
        (benchmarks/RESULTS.md, session 19). A hook's work (the server's text, stop strings, the outbox) now runs
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

    def _launch(self) -> _Flight:
        """Draft and verify every running sequence, reading nothing back (host-built trees read the drafter's scores)."""
        device, began, batch = self.target.device, time.perf_counter(), len(self.running)
        candidate = None
        if self.schedule is not None:
            candidate = self.schedule.pick(batch)
            for seq in self.running:
                assert isinstance(seq.proposer, SwitchingProposer)
                seq.proposer.use(candidate)
        proposer = self.running[0].proposer
        method = candidate.label if candidate is not None else proposer.name if proposer else "ar"
        deferring = candidate is not None and candidate.method == "ar"
        if candidate is not None and not deferring:
            self._catch_up()
        steps = self._lone_steps()
        if steps is not None:
            return self._launch_fused(steps, candidate, method, began)
        self.fused_for = None
        starts = [seq.prompt_len + len(seq.tokens) - 1 for seq in self.running]
        tap_layers = proposer.tap_layers if proposer else None
        trees = self._trees_on_device(starts)
        if trees is not None:
            verified = self.verifier.forward_rows(trees.ids, trees.positions, trees.own, tap_layers)
            assert verified.logits is not None
            return _Flight(list(self.running), starts, None, trees, verified, trees.readout(verified.logits),
                           candidate, deferring, method, began)
        drafts = self._drafts(starts) if self.drafting is not None else [
            seq.proposer.propose(seq.tokens[-1], start, seq.max_new_tokens - len(seq.tokens), seq.sampling,
                                 seq.generator) if seq.proposer else Draft.empty(device)
            for seq, start in zip(self.running, starts)]
        verified = self.verifier.forward([seq.tokens[-1] for seq in self.running], drafts, starts, tap_layers)
        return _Flight(list(self.running), starts, drafts, None, verified, self._greedy_read(drafts, verified),
                       candidate, deferring, method, began)

    def _launch_ahead(self, flight: _Flight) -> _Flight | None:
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
        """The fused steps (`decoding.fused_steps`) of this step's method when one greedy sequence runs alone on the
        fast engine with them on, with a whole step's depth left: two graph replays and one read a step, as
        `generate()` runs it (a lone request on the H200: AR 1.16x, DFlash 1.20x, DDTree@32 1.43x the tokens/s of
        the step below, benchmarks/RESULTS.md session 34). None otherwise: the step below, or a scheduled AR step
        (whose taps wait in `deferred`)."""
        target = self.target
        if (len(self.running) != 1 or not isinstance(target, FastTarget) or not target.fused
                or not isinstance(self.verifier, SlotVerifier)):
            return None
        seq = self.running[0]
        shape = _fused_shape(seq.proposer)
        if not seq.sampling.greedy or seq.pending or shape is None:
            return None
        if shape == AR_SHAPE:
            steps = fused_steps(target, None)
        elif self.drafting is None:
            return None
        else:
            if shape not in self.fused:
                self.fused[shape] = FusedSteps(target, self.drafting.lone_drafter(), seq.proposer.tap_layers, shape)
            steps = self.fused[shape]
        return steps if steps is not None and steps.whole_step(seq.max_new_tokens - len(seq.tokens)) else None

    def _launch_fused(self, steps: FusedSteps, candidate: Candidate | None, method: str, began: float) -> _Flight:
        """The lone sequence's fused step: its K/V and drafter context on the batch-1 paths, its rows laid out (by
        the last fused step's draft, or now), the verify and the next draft launched."""
        seq = self.running[0]
        cache = self.verifier.alone()  # type: ignore[union-attr]
        if steps.drafter is not None:
            assert self.drafting is not None
            self.drafting.alone()
        if self.fused_for is None or self.fused_for[0] is not seq or self.fused_for[1] is not steps:
            lookup = _lookup_trees(seq.proposer)
            steps.begin(seq.tokens[-1], cache, lookup.index.tokens if lookup is not None else None)
            self.fused_for = (seq, steps)
        steps.verify(cache)
        steps.draft(cache)
        return _Flight([seq], [seq.prompt_len + len(seq.tokens) - 1], None, None, Verified([]), None, candidate, False,
                       method, began, fused=_FusedRead(steps, cache))

    def _greedy_read(self, drafts: list[Draft], verified: Verified) -> torch.Tensor | None:
        """The greedy sequences' verdicts as one device tensor to read back (`verify.greedy_read`; one argmax for the
        batch when its logits are one tensor); None when every sequence samples."""
        greedy = [b for b, seq in enumerate(self.running) if seq.sampling.greedy]
        if not greedy:
            return None
        if verified.logits is not None:
            every = verified.logits.argmax(dim=-1)
            picks = [every[b, : len(drafts[b]) + 1] for b in greedy]
        else:
            picks = [verified.rows[b][0].argmax(dim=-1) for b in greedy]
        return greedy_read([drafts[b] for b in greedy], picks)

    def _land(self, flight: _Flight) -> tuple[list[Sequence], list[tuple[Sequence, list[int]]]]:
        """Read a launched step back (the step's one wait for the device), commit each sequence's tokens (cut at
        its budget and stop ids), keep its cache rows, extend its drafter context, and let the finished leave;
        returns them and each committed chunk, for the hooks."""
        assert self.running[: len(flight.seqs)] == flight.seqs  # joins only append while a step is in flight
        if flight.fused is not None:
            return self._land_fused(flight, flight.fused)
        device = self.target.device
        read = None if flight.read is None else flight.read.tolist()
        if flight.trees is not None:
            drafts, verdicts = flight.trees.walks(read)  # type: ignore[arg-type]
        else:
            assert flight.drafts is not None
            drafts, verdicts = flight.drafts, self._verdicts(flight, read)
        extended: list[int] = []
        kept_taps: list[torch.Tensor] = []
        reports: list[tuple[Sequence, list[int]]] = []
        whole = flight.verified.taps  # every sequence's kept taps its first rows: one copy for the batch
        base = self._defer(flight, whole) if flight.deferring else 0
        for slot, (seq, draft, start, verdict, (_, taps)) in enumerate(
                zip(flight.seqs, drafts, flight.starts, verdicts, flight.verified.rows)):
            if seq.ended_early:  # its hook ended it after this step was launched: nothing of the step is kept
                continue
            seq.draft_lengths.append(len(draft))
            committed = seq.commit(verdict.tokens + [verdict.bonus])
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
        if len(self.deferred) >= PENDING_MAX:
            self._catch_up()
        chains = (whole is not None and not flight.deferring and extended == list(range(len(flight.seqs)))
                  and all(draft.is_chain for draft in drafts))
        self._extend(extended, kept_taps, whole if chains else None)
        return self._landed(flight, reports), reports

    def _land_fused(self, flight: _Flight, fused: _FusedRead) -> tuple[list[Sequence],
                                                                      list[tuple[Sequence, list[int]]]]:
        """A fused step's read: the cache and drafter context already hold its commit (its graphs wrote them)."""
        seq = flight.seqs[0]
        nodes, tokens = fused.take()
        reports: list[tuple[Sequence, list[int]]] = []
        if not seq.ended_early:
            seq.draft_lengths.append(nodes)
            reports.append((seq, seq.commit(tokens)))
        return self._landed(flight, reports), reports

    def _landed(self, flight: _Flight, reports: list[tuple[Sequence, list[int]]]) -> list[Sequence]:
        """A read step's end: the finished leave, and the step's method, commit and time are recorded."""
        finished = self._leave()
        self.last_method = flight.method
        self.last_committed = sum(len(committed) for _, committed in reports)
        if isinstance(self.schedule, MeasuredSchedule) and flight.candidate is not None:
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

    def _defer(self, flight: _Flight, whole: torch.Tensor | None) -> int:
        """A scheduled AR step's taps (every sequence's one row), copied out of the forward's buffers (a graph's are
        valid until its next replay) into `deferred` in one copy for the batch; returns the index of its first row.
        A copy a sequence cost the scheduled AR step 0.7-1.2 ms at batch 64 on the H200 (RESULTS, session 23)."""
        if whole is not None:
            stash = whole[:, :1].clone()
        else:
            rows = [taps for _, taps in flight.verified.rows]
            assert all(taps is not None for taps in rows)  # a schedule's sequences all tap (SwitchingProposer)
            stash = torch.cat([taps[:, :1] for taps in rows])  # type: ignore[index]
        base = self.deferred_rows
        self.deferred.append(stash)
        self.deferred_rows += stash.shape[0]
        return base

    def _catch_up(self) -> None:
        """Before a step that drafts, and every PENDING_MAX AR steps: the context the scheduled AR steps since the
        last catch-up left pending, in one extension (each sequence's rows gathered in one index). An AR step that
        wrote it at once paid a drafter extension every step (the scheduled AR step served 0.79x the AR server on the
        H200, benchmarks/RESULTS.md session 16); deferred, it pays one launch for up to PENDING_MAX tokens, and the
        context is the same when drafting resumes."""
        if not self.deferred:
            return
        every = torch.cat(self.deferred) if len(self.deferred) > 1 else self.deferred[0]
        slots = [b for b, seq in enumerate(self.running) if seq.pending]
        taps = [every[long_tensor(self.running[b].pending, every.device)].reshape(1, -1, every.shape[-1])
                for b in slots]
        for b in slots:
            self.running[b].pending.clear()
        self.deferred.clear()
        self.deferred_rows = 0
        self._extend(slots, taps)

    def _verdicts(self, flight: _Flight, read: list[int] | None) -> list[Verdict]:
        """Each sequence's verdict: the greedy ones from the step's read, the sampled ones each with its own
        generator, as alone."""
        assert flight.drafts is not None
        greedy = [b for b, seq in enumerate(flight.seqs) if seq.sampling.greedy]
        walked = iter(greedy_walks([flight.drafts[b] for b in greedy], read or []))
        return [next(walked) if seq.sampling.greedy else verify(draft, logits, seq.sampling, seq.generator)
                for seq, draft, (logits, _) in zip(flight.seqs, flight.drafts, flight.verified.rows)]

    def _plans(self) -> list[tuple[int, int] | None]:
        """Each running sequence's (slots drafted, mask rows seen) this step, None where it drafts nothing."""
        return [seq.proposer.plan(seq.max_new_tokens - len(seq.tokens)) for seq in self.running]  # type: ignore

    def _trees_on_device(self, starts: list[int]) -> DeviceTrees | None:
        """This step's trees searched and laid out as verify rows on the device (ddtree.DeviceTrees: no read back
        between the drafter pass and the verify), when every running sequence builds a greedy DDTree of one budget
        from the batch's drafter; None otherwise, and the drafts are made on the host."""
        if self.drafting is None or not isinstance(self.verifier, SlotVerifier):
            return None
        budgets = {_tree_budget(seq.proposer) if seq.sampling.greedy else None for seq in self.running}
        budget = budgets.pop() if len(budgets) == 1 else None
        plans = self._plans() if budget is not None else []
        if budget is None or all(plan is None for plan in plans):
            return None
        logits = self._slot_logits(starts, plans)
        slots = [0 if plan is None else plan[0] for plan in plans]
        trees = trees_on_device(logits, slots, budget, [seq.tokens[-1] for seq in self.running], starts)
        lookups = [_lookup_trees(seq.proposer) for seq in self.running]
        chains = [lookup.lookup_chain(budget, n) if lookup is not None else [] for lookup, n in zip(lookups, slots)]
        return merged_trees(trees, chains, self.target.ops.compiled)  # type: ignore[attr-defined]

    def _slot_logits(self, starts: list[int], plans: list[tuple[int, int] | None]) -> torch.Tensor:
        """The batch's drafter pass for this step's plans: slot logits [n, B-1, V]."""
        assert self.drafting is not None
        return self.drafting.draft([seq.tokens[-1] for seq in self.running], starts,
                                   [0 if plan is None else plan[1] for plan in plans])

    def _drafts(self, starts: list[int]) -> list[Draft]:
        """Every running sequence's draft from one batched drafter pass (none when this step's method is AR)."""
        assert self.drafting is not None
        proposers: list[DrafterProposer] = [seq.proposer for seq in self.running]  # type: ignore[misc]
        plans = self._plans()
        device = self.target.device
        if all(plan is None for plan in plans):
            return [Draft.empty(device) for _ in plans]
        logits = self._slot_logits(starts, plans)
        drafts = self._trees(proposers, plans, logits)
        greedy = [b for b, (proposer, seq, plan) in enumerate(zip(proposers, self.running, plans))
                  if plan is not None and b not in drafts and seq.sampling.greedy and _plain_chain(proposer)]
        if greedy:  # one argmax for the batch's greedy chains (what each one's `finish` takes, one launch each)
            picks = logits.argmax(dim=-1)
            drafts.update((b, Draft.chain(picks[b, : plans[b][0]])) for b in greedy)  # type: ignore[index]
        return [drafts[b] if b in drafts else Draft.empty(device) if plan is None else
                proposer.finish(logits[b, : plan[0]], seq.sampling, seq.generator)
                for b, (proposer, seq, plan) in enumerate(zip(proposers, self.running, plans))]

    def _trees(self, proposers: list[DrafterProposer], plans: list[tuple[int, int] | None],
               logits: torch.Tensor) -> dict[int, Draft]:
        """The greedy sequences' DDTrees of this step, built together per budget (`ddtree.build_trees`: one top-k
        and one read for the batch, not one per sequence); what each proposer's own `finish` would build."""
        groups: dict[int, list[int]] = {}
        for b, (proposer, plan, seq) in enumerate(zip(proposers, plans, self.running)):
            budget = _tree_budget(proposer)
            if plan is not None and budget is not None and seq.sampling.greedy:
                groups.setdefault(budget, []).append(b)
        trees: dict[int, Draft] = {}
        for budget, members in groups.items():
            rows = logits if len(members) == logits.shape[0] else logits[long_tensor(members, logits.device)]
            slots = [plan[0] for plan in (plans[b] for b in members) if plan is not None]
            trees.update(zip(members, build_trees(slot_log_probs(rows, SamplingParams()), slots, budget)))
            for b, n in zip(members, slots):
                lookup = _lookup_trees(proposers[b])
                if lookup is not None:
                    trees[b] = lookup.merged(trees[b], budget, n)
        return trees

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


def _fused_shape(proposer: Proposer | None) -> StepShape | None:
    """The fused step's shape of this proposer's method this step; None where fused steps do not run it (another
    proposer, a scheduled AR step)."""
    if isinstance(proposer, SwitchingProposer):
        candidate, chain = proposer.candidate, proposer.tree.chain
        if candidate.method == "ar":
            return None
        if candidate.method == "dflash":
            return StepShape(*chain.block_rows(chain.block_size, candidate.draft_tokens))
        slots, visible = chain.block_rows(chain.block_size)
        lookup = proposer.lookup_trees
        room = lookup.room(candidate.budget, slots) if lookup is not None else 0  # type: ignore[arg-type]
        return StepShape(slots, visible, candidate.budget, room)
    if proposer is None or type(proposer) in (DFlashProposer, DDTreeProposer, LookupTreeProposer):
        return step_shape(proposer)  # type: ignore[arg-type]
    return None


def _lookup_trees(proposer: Proposer | None) -> LookupTreeProposer | None:
    """The proposer whose trees hold a lookup chain this step (its own, or a schedule's DDTree step's), if any."""
    if isinstance(proposer, SwitchingProposer):
        return proposer.lookup_trees
    return proposer if isinstance(proposer, LookupTreeProposer) else None


def _plain_chain(proposer: Proposer | None) -> bool:
    """Whether this proposer's draft this step is the DFlash chain (its greedy `finish`: the argmax of each slot)."""
    if isinstance(proposer, SwitchingProposer):
        return proposer.candidate.method == "dflash"
    return type(proposer) is DFlashProposer


def _tree_budget(proposer: Proposer | None) -> int | None:
    """The budget of the plain DDTree this proposer builds from its slot logits this step, if it builds one."""
    if isinstance(proposer, SwitchingProposer):
        return proposer.candidate.budget if proposer.candidate.method == "ddtree" else None
    return proposer.budget if type(proposer) in (DDTreeProposer, LookupTreeProposer) else None


def generate_batch(target: Target, prompts: list[list[int]], new_proposer: Callable[[], Proposer | None],
                   batch_size: int, max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
                   stop_token_ids: tuple[int, ...] = (), seed: int = 0) -> Iterator[tuple[int, GenerationResult]]:
    """Decode every prompt with up to `batch_size` at a time, new ones joining (prefilled together) as soon as
    some finish; yields (prompt index, result) in finishing order. Each prompt's ids equal `generate()`'s on it
    alone with `seed`."""
    yield from decode_batch(BatchDecoder(target, new_proposer, batch_size), prompts, max_new_tokens, sampling,
                            stop_token_ids, seed)


def decode_batch(decoder: BatchDecoder, prompts: list[list[int]], max_new_tokens: int = 128,
                 sampling: SamplingParams = SamplingParams(), stop_token_ids: tuple[int, ...] = (),
                 seed: int = 0) -> Iterator[tuple[int, GenerationResult]]:
    """`generate_batch` on a decoder of one's own (one warmed before, whose graphs the decode then reuses)."""
    pending = list(enumerate(prompts))
    owner: dict[int, int] = {}
    while pending or decoder.running:
        joining, pending = pending[: decoder.free], pending[decoder.free :]
        seqs = decoder.join_many([Request(ids, max_new_tokens, sampling, stop_token_ids, seed) for _, ids in joining])
        for (index, _), seq in zip(joining, seqs):
            if seq.done:
                yield index, seq.result()
            else:
                owner[id(seq)] = index
        for seq in decoder.step():
            yield owner.pop(id(seq)), seq.result()


def warm_buckets(decoder: BatchDecoder, prompt_ids: list[int], tokens: int,
                 prepare: Callable[[Sequence], None] | None = None) -> None:
    """Decode `tokens` tokens of the prompt at every batch bucket the decoder's graphs are captured for (1, 2, 4,
    ... its max_seqs sequences at once), so that what each size first meets (compiling, tuning, graph
    capture) is paid here and not by the decodes that follow; `prepare` sees each joined sequence first (a
    schedule's warm-up picks its candidate there)."""
    for size in bucket_sizes(decoder.max_seqs):
        for seq in decoder.join_many([Request(prompt_ids, tokens)] * size):
            if prepare is not None:
                prepare(seq)
        while decoder.running:
            decoder.step()


def kv_cache_bytes(target: Target, sequences: int, length: int) -> int:
    """K/V bytes of `sequences` sequences of `length` tokens on this target (its attention layers only: a hybrid
    target's linear-attention states do not grow with the length)."""
    config = target.model.config.get_text_config(decoder=True)
    attention = sum(kind in ("full_attention", "sliding_attention") for kind in target.layer_types)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    element = torch.finfo(target.dtype).bits // 8
    return sequences * length * attention * 2 * kv_heads * head_dim * element


def bucket_sizes(most: int) -> list[int]:
    """1, 2, 4, ... up to `most` (which ends the list whether a power of two or not): the batch sizes the batched
    engine's graphs are captured for, and those a schedule is tuned at."""
    sizes = [1]
    while sizes[-1] < most:
        sizes.append(min(2 * sizes[-1], most))
    return sizes


DEFAULT_MAX_NUM_SEQS = 64  # serve's continuous batch when not given, on a GPU with the fast engine


def default_max_num_seqs(target: Target, length: int, free_bytes: int | None = None) -> int:
    """--max-num-seqs when not given: continuous batching where a batch shares one forward (the fast engine on a
    GPU: on the H200 it served 2-3x the tokens/s of one request at a time from 4 concurrent requests on, session 15),
    up to DEFAULT_MAX_NUM_SEQS sequences and as many as 90% of the free memory holds at `length` tokens each; one
    at a time elsewhere (the HF engine interleaves requests without sharing a forward; a CPU gains nothing).
    `free_bytes` overrides the device's free memory (tests)."""
    if not isinstance(target, FastTarget):
        return 1
    if free_bytes is None:
        if target.device.type != "cuda":
            return 1
        free_bytes = torch.cuda.mem_get_info(target.device)[0]
    fits = int(0.9 * free_bytes) // max(kv_cache_bytes(target, 1, length), 1)
    seqs = min(DEFAULT_MAX_NUM_SEQS, fits)
    return seqs if seqs >= 2 else 1


def check_kv_room(target: Target, sequences: int, length: int, free_bytes: int | None = None) -> None:
    """Refuse a batch whose K/V at full length cannot fit in the device's free memory (vLLM refuses at start-up
    too): one line now rather than an out-of-memory error that fails every running request later. Only on CUDA,
    where the free memory is known; `free_bytes` overrides it (tests)."""
    if free_bytes is None:
        if target.device.type != "cuda":
            return
        free_bytes = torch.cuda.mem_get_info(target.device)[0]
    need = kv_cache_bytes(target, sequences, length)
    if need > free_bytes:
        raise BlockdraftError(
            f"--max-num-seqs {sequences} x --max-model-len {length} needs {need / 2**30:.2f} GiB of KV cache and the "
            f"device has {free_bytes / 2**30:.2f} GiB free; lower --max-num-seqs or --max-model-len"
        )
