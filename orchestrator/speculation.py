"""The orchestrator: a request in, its chunks out.

It admits the request (admission.RequestSlots), checks it (request_checks), makes its run (run.py)
and its proposer (orchestrator.drafting), and loops: plan → draft → verify → settle, one iteration
at a time. The loop is the one writer of the run's state (RunState): output.absorb and
accounting.account return what an iteration adds, proposers put their counts in the iteration's
Step, and the loop applies them. The engines' info, availability and health are the EngineLink's
(engine_link.py); calls to them follow the session protocol (sessions.py). Every iteration's
progress is saved before its chunk is yielded, so a request whose client or orchestrator goes away
can be resumed (docs/reliability.md).

Why the loop is exact whatever it decides: docs/algorithms.md §8.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from orchestrator import scheduling
from orchestrator.accounting import CALIBRATION_FLUSH_ITERATIONS, Tally, account, flush_calibration
from orchestrator.adaptation import PairEstimates, SourceEstimates
from orchestrator.admission import CallerLimit, RequestSlots, paced
from orchestrator.clients.base import DrafterClient, VerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.drafting import PROPOSERS, DraftingContext, proposer_for
from orchestrator.drafting.base import Draft, Plan, Proposer, Step, target_only_draft
from orchestrator.engine_link import EngineLink
from orchestrator.failover import DrafterDown
from orchestrator.health import Dependencies
from orchestrator.output import PARTIAL, Absorbed, absorb, context_full, text_delta
from orchestrator.probes import IterationProbe, LoopObserver, RequestProbe
from orchestrator.request_checks import check_prompt, check_request, check_request_id
from orchestrator.run import Run, RunState, cache_partition, new_run
from orchestrator.sessions import RunSessions
from orchestrator.store import RequestRecord, Store, StoreOutage, open_store
from orchestrator.timeline import Timeline
from orchestrator.turn_close import CLOSING_FINISHES, turn_close
from specdec.defaults import ANONYMOUS
from specdec.engine.api import ModelInfo, TextCursor
from specdec.errors import AlreadyExists, InvalidRequest, NotFound, StillRunning, StoreUnavailable
from specdec.generation import (
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    IterationRecord,
)
from specdec.methods import AUTOREGRESSIVE, get_method
from specdec.model_free import SuffixCaches
from specdec.sampling_params import SamplingParams

log = logging.getLogger(__name__)
FINAL_SAVE_RETRY_S = 0.25  # between tries of a finished request's save while the store is down
# The warm-up's prompt (Orchestrator.warm_up): code with a repeat in it, so that it drafts from the model
# and from its own n-grams and steps alone, at a few pass widths, as users' requests do.
WARM_UP_PROMPT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
                  "def mul(a, b):\n    return a * b\n\n\ndef")
WARM_UP_OWNER = "specdec:warm-up"  # its record's owner: no caller's identity, so no caller sees it
WARM_UP_TIMEOUT_S = 120.0
TURN_CLOSE_TIMEOUT_S = 30.0  # a chat turn's close (render + one pass of a few rows) takes under a second


class Orchestrator:
    """Generation over one drafter (None = target only) and one verifier.

    on_iteration, if given, is called with every IterationRecord as soon as it is complete; the
    records are also on GenerationResult.iterations. observer, if given, gets spans and metrics of
    requests, iterations and calls (orchestrator.probes). At most config.max_active_requests
    requests run at once (`admission`).
    """

    def __init__(
        self,
        drafter: DrafterClient | None,
        verifier: VerifierClient,
        config: OrchestratorConfig | None = None,
        *,
        store: Store | None = None,
        on_iteration: Callable[[IterationRecord], None] | None = None,
        observer: LoopObserver | None = None,
    ) -> None:
        config = config or OrchestratorConfig()
        self.store = store if store is not None else open_store(config.store_url, config.request_ttl_seconds,
                                                                config.store_timeout_s)
        self.link = EngineLink(drafter, verifier, config, self.store)
        self.on_iteration = on_iteration
        self.observer = observer
        self.admission = RequestSlots(config.max_active_requests, config.queue_timeout_s)
        self.callers = CallerLimit(config.max_requests_per_caller)
        self._estimates: dict[str, PairEstimates] = {}  # per model pair and method (adaptation.py)
        self._unobserved: set[str] = set()  # request ids the observer does not see (the warm-up)
        # Model-free drafting (orchestrator.drafting): the caches of recent requests' tokens, per process
        # (per replica) and partition (caller and cache_salt), and what each model-free source is worth.
        self.suffix_caches = SuffixCaches(config.suffix_cache_partitions,
                                          max_requests=config.suffix_cache_requests,
                                          max_tokens=config.suffix_cache_tokens,
                                          max_depth=config.suffix_max_nodes)
        self.source_estimates = SourceEstimates()
        self._turn_closes: set[asyncio.Task[None]] = set()  # sessions released after their turn's close

    # the engines, as the link sees them ----------------------------------------------------------
    @property
    def config(self) -> OrchestratorConfig:
        """The model pair's configuration (calibrated once both engines' infos are read)."""
        return self.link.config

    @property
    def drafter(self) -> DrafterClient | None:
        return self.link.drafter

    @property
    def verifier(self) -> VerifierClient:
        return self.link.verifier

    @verifier.setter
    def verifier(self, client: VerifierClient) -> None:
        self.link.verifier = client

    @property
    def target_info(self) -> ModelInfo | None:
        return self.link.target_info

    @property
    def draft_info(self) -> ModelInfo | None:
        return self.link.draft_info

    @property
    def dependencies(self) -> Dependencies:
        return self.link.dependencies

    @property
    def pair_key(self) -> str:
        return self.link.pair_key

    async def start(self) -> None:
        """Read both engines' info (EngineLink.start: a pair of different vocabularies is refused)."""
        await self.link.start()

    async def ensure_serving(self) -> None:
        await self.link.ensure_serving()

    async def check_dependencies(self) -> bool:
        return await self.link.check_dependencies()

    def dependency_status(self) -> dict:
        return self.link.dependency_status()

    async def close(self) -> None:
        await self.settle_turn_closes()
        await self.link.close()
        await self.store.close()

    async def settle_turn_closes(self) -> None:
        """Wait for the chat turns' closes still running (orchestrator.turn_close), each bounded."""
        while self._turn_closes:
            await asyncio.gather(*self._turn_closes, return_exceptions=True)

    async def warm_up(self, max_new_tokens: int | None = None,
                      timeout_s: float = WARM_UP_TIMEOUT_S) -> GenerationResult | None:
        """Measure before the first user's request: generate `max_new_tokens` (config.warm_up_tokens)
        of WARM_UP_PROMPT through the loop as a request with no knobs would, so the estimates its
        choices read (W(n) of steps and model-free drafts, the draft model's W(k) and T_q, the
        drafter's pass time behind its catch-up's expected cost) are measured, not priors; then
        forget what its acceptance taught (the users' prompts are not this one). A fresh server's
        first request otherwise explored on the user's time (bench/RESULTS.md "The first requests of a
        fresh server"). The request is private: no observer sees it (request and iteration metrics,
        spans), its cache salt is its own and its suffix-cache partition is dropped afterwards, its
        record belongs to WARM_UP_OWNER. The engines' own call counters do count its calls. None
        (logged): it failed or ran past `timeout_s`; serving goes on without it."""
        tokens = self.config.warm_up_tokens if max_new_tokens is None else max_new_tokens
        if tokens <= 0:
            return None
        name = f"specdec-warm-up-{uuid.uuid4().hex}"
        request = GenerationRequest(prompt=WARM_UP_PROMPT, max_new_tokens=tokens, stop_token_ids=[],
                                    sampling=SamplingParams(temperature=0.0), request_id=name,
                                    cache_salt=name)
        self._unobserved.add(name)
        try:
            result = await asyncio.wait_for(self.generate(request, owner=WARM_UP_OWNER), timeout_s)
        except Exception as exc:  # a warm-up that failed measured less, nothing worse
            log.warning("warm-up request failed (%s: %s); the first requests measure instead",
                        type(exc).__name__, exc)
            return None
        finally:
            self._unobserved.discard(name)
            self.suffix_caches.drop(cache_partition(WARM_UP_OWNER, name))
            self.source_estimates.forget_acceptance()
            for estimates in self._estimates.values():
                estimates.forget_acceptance()
        return result

    # public API --------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest, *, owner: str = ANONYMOUS,
                       caller: str | None = None) -> GenerationResult:
        return await _last_result(self.generate_stream(request, owner=owner, caller=caller, streamed=False))

    async def generate_stream(
        self, request: GenerationRequest, *, owner: str = ANONYMOUS, caller: str | None = None,
        streamed: bool = True,
    ) -> AsyncIterator[GenerationChunk]:
        """The request's chunks; it first waits for a request slot (Overloaded when none frees up in
        time), held while the run runs: a run whose reader falls behind pauses and gives its slot
        back (admission.paced), and one whose stream is closed ends at once. Its record is created
        bound to `owner` (the caller's identity, specdec.rpc.security), in owner's namespace of
        request ids: an id that owner already used is refused (AlreadyExists) and its stored progress
        left as it was; another owner's record of the same id is neither seen nor touched. `caller`: the
        key the per-caller cap counts the call under, as the door knows the caller (its owner, or
        "peer:<address>" for an anonymous one); None counts it under `owner`. `streamed`: the caller
        reads the chunks as they come (False: it waits for the result, as `generate` does), so its
        first token is not held back by a draft (Run.streamed)."""
        async with contextlib.aclosing(self._paced(self._generate(request, owner, streamed), caller or owner,
                                                   request.request_id)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _generate(self, request: GenerationRequest, owner: str,
                        streamed: bool) -> AsyncIterator[GenerationChunk]:
        if self.target_info is None:
            await self.start()
        run = await self._new_run(request, owner)
        run.streamed = streamed
        async with contextlib.aclosing(self._run(run)) as chunks:  # closed with this stream
            async for chunk in chunks:
                yield chunk

    async def _paced(self, source: AsyncIterator[GenerationChunk], caller: str,
                     name: str | None) -> AsyncIterator[GenerationChunk]:
        """`source` under the caller's cap (CallerLimit, counted under `caller`) and paced by its reader
        (admission.paced): it holds a request slot only while it runs, and is closed after
        stream_idle_timeout_s without a chunk taken."""
        with self.callers.hold(caller):
            async with contextlib.aclosing(paced(source, self.admission, name=name or "",
                                                 idle_timeout_s=self.config.stream_idle_timeout_s)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def resume(self, request_id: str, *, owner: str = ANONYMOUS,
                     caller: str | None = None) -> GenerationResult:
        """Continue a stored request from its stored tokens (a finished one is returned as is)."""
        return await _last_result(self.resume_stream(request_id, owner=owner, caller=caller, streamed=False))

    async def resume_stream(
        self, request_id: str, *, owner: str = ANONYMOUS, caller: str | None = None, streamed: bool = True,
    ) -> AsyncIterator[GenerationChunk]:
        """As generate_stream, from `owner`'s stored request (it takes a request slot the same way).

        The first chunk carries the tokens stored so far, so the chunks put together are the whole
        output. NotFound when `owner` has no such request (another owner's reads the same);
        StillRunning while a live run holds the record's lease (docs/reliability.md).
        """
        if not request_id:
            raise InvalidRequest("request_id: give the id of the stored request to resume")
        check_request_id(request_id, self.config.max_request_id_chars)  # before the store reads it
        async with contextlib.aclosing(self._paced(self._resume(request_id, owner, streamed), caller or owner,
                                                   request_id)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _resume(self, request_id: str, owner: str, streamed: bool) -> AsyncIterator[GenerationChunk]:
        if self.target_info is None:
            await self.start()
        record = await self.store.get_request(request_id, owner)  # only owner's ids are seen
        if record is None or record.owner != owner:
            raise NotFound(f"request_id: no stored request {request_id!r}")
        run = Run.from_record(record)
        run.streamed = streamed
        state = run.state
        if record.status == "done":
            state.finish_reason = record.finish_reason or "length"
            state.text = record.text
            yield GenerationChunk(list(state.generated), state.text, run.result())
            return
        await self._resume_text(run)
        await self._claim(run, record)
        stored = GenerationChunk(list(state.generated), state.text) if state.generated else None
        async with contextlib.aclosing(self._run(run, stored)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _resume_text(self, run: Run) -> None:
        """The stored tokens' text, settled up to the last whole character, and the TextCursor the
        next verify decodes from (a resume's only Decode calls: one, or a few when the stored tokens
        end inside a character)."""
        state, start = run.state, len(run.settings.prompt_ids)
        read = len(state.generated)
        text = full = await self.verifier.decode(state.generated) if read else ""
        while text.endswith(PARTIAL) and read > 0:
            read -= 1
            text = await self.verifier.decode(state.generated[:read]) if read else ""
        state.text, state.text_tail, state.text_sent = text, full[len(text):], len(text)
        state.text_cursor = TextCursor(start, start + read, start + read)

    def admission_stats(self) -> dict[str, int]:
        """Requests running, waiting for a slot, refused so far, and the limit; streams paused for their
        reader (no slot held), closed after the idle timeout, and refused by the per-caller cap (read by
        /metrics)."""
        slots = self.admission
        return {"active": slots.active, "waiting": slots.waiting, "rejected": slots.rejected,
                "limit": slots.limit, "paused": slots.paused, "idle_closed": slots.idle_closed,
                "caller_refused": self.callers.refused}

    # request set-up ----------------------------------------------------------------------------
    async def _new_run(self, request: GenerationRequest, owner: str) -> Run:
        target = self.target_info
        assert target is not None
        method = check_request(request, self.config, target, has_drafter=self.drafter is not None,
                               sources=tuple(PROPOSERS))
        prompt_ids = await self._prompt_ids(request)
        check_prompt(prompt_ids, target)
        rank_acceptance = await self._rank_acceptance(method)
        run = new_run(request, method=method, prompt_ids=prompt_ids, rank_acceptance=rank_acceptance,
                      config=self.config, target=target, owner=owner)
        if not await self.store.create_request(self._record(run, "running")):
            raise AlreadyExists(f"request_id {run.request_id!r} already exists; Resume continues it")
        return run

    async def _claim(self, run: Run, record: RequestRecord) -> None:
        """Take a stored request over for this run: refused while another run holds its lease, and
        by compare-and-set, so of two Resumes racing for it one wins."""
        now = time.time()
        if record.lease_until > now:
            raise StillRunning(
                f"request_id {run.request_id!r} is still running (last progress "
                f"{now - record.updated_at:.1f} s ago); Resume it once it has stopped, or after "
                f"{record.lease_until - now:.1f} s without progress"
            )
        claimed = self._record(run, "running")
        if not await self.store.replace_request(claimed, if_updated_at=record.updated_at):
            raise StillRunning(f"request_id {run.request_id!r} was taken over by another run just now")

    async def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_ids and request.prompt:
            raise InvalidRequest("prompt: give either prompt text or prompt_ids, not both")
        if request.prompt_ids:
            return [int(t) for t in request.prompt_ids]
        if request.messages:  # checked (check_request): the only prompt, within the size limits
            ids = await self.verifier.apply_chat_template(list(request.messages), self.config.chat_template)
            if ids:
                return list(ids)
        if request.prompt:  # its size was checked first (check_request: max_prompt_bytes)
            try:
                ids = await self.verifier.tokenize(request.prompt)
            except InvalidRequest as exc:  # e.g. too long for the context: the client sent a prompt
                raise InvalidRequest(f"prompt: {str(exc).removeprefix('text: ')}") from None
            if ids:
                return list(ids)
        raise InvalidRequest("prompt: the prompt is empty (give prompt text or prompt_ids)")

    async def _rank_acceptance(self, method: str) -> list[float]:
        """R(j) for tree shapes: configured, or measured for this pair once there are enough samples."""
        config = self.config
        rank_acceptance = list(config.rank_acceptance)
        if config.calibration_min_samples <= 0 or not get_method(method).drafts_trees:
            return rank_acceptance
        counts = await self.store.get_calibration(self.pair_key)
        prefix = f"{method}:"
        return scheduling.rank_acceptance_from_calibration(
            {key[len(prefix):]: v for key, v in counts.items() if key.startswith(prefix)},
            rank_acceptance,
            config.calibration_min_samples,
        )

    def _pair_estimates(self, method: str) -> PairEstimates:
        key = f"{self.pair_key}|{method}"
        estimates = self._estimates.get(key)
        if estimates is None:
            estimates = self._estimates[key] = PairEstimates(alone=self.source_estimates)
        return estimates

    # the loop ----------------------------------------------------------------------------------
    async def _run(self, run: Run, first: GenerationChunk | None = None) -> AsyncIterator[GenerationChunk]:
        """`first`, then the run's chunks. A run closed before its end (its client went away) hands
        its lease back at once, so the request can be resumed without waiting for the lease to pass."""
        stream = self._drive(run)
        ended = False
        try:
            if first is not None:
                yield first
            async for chunk in stream:
                yield chunk
            ended = True
        except Exception:
            ended = True  # _drive recorded the failure, which holds no lease
            raise
        finally:
            await stream.aclose()
            if not ended and not run.finished:
                await self._release(run)

    async def _drive(self, run: Run) -> AsyncIterator[GenerationChunk]:
        """Iterate until a stop condition; one chunk per iteration, the last carries the result.

        The record is saved before each chunk is yielded. A consumer that goes away (or an
        orchestrator that dies) leaves it "running" with everything produced so far: resumable.
        While the store fails, the run generates on and its chunks wait for a save that succeeds,
        for at most store_outage_grace_s (_save_through; docs/reliability.md "When Redis hangs").
        """
        state = run.state
        seconds_before = state.stats.seconds
        sessions = RunSessions(run, self.drafter, self.verifier, draft_rows=self.config.draft_rows,
                               watch=self.link)
        method = run.settings.method
        proposer = proposer_for(run, DraftingContext(
            self.config, lambda: self._pair_estimates(method), has_drafter=self.drafter is not None,
            suffix_cache=self.suffix_caches.of(run.settings.cache_partition),
            source_estimates=self.source_estimates, active_requests=lambda: self.admission.active))
        error: BaseException | None = None
        outage = StoreOutage(self.config.store_outage_grace_s)
        sent = len(state.generated)  # the tokens the client has (a resume's first chunk carries them)
        if self.observer is not None and run.request_id not in self._unobserved:
            run.probe = _observe_start(run, self.observer)
        try:
            if context_full(run, self.link.max_context()):  # e.g. a resumed request that filled the window
                state.finish_reason = "length"
                await self._save_through(run, True, outage)
                yield GenerationChunk([], _stream_text(run, True), run.result())
                return
            while True:
                await self._iteration(run, sessions, proposer)
                state.stats.seconds = seconds_before + time.perf_counter() - state.perf0
                final = run.finished
                if not await self._save_through(run, final, outage):
                    continue  # the store is down: generate on; the chunk waits for a save that succeeds
                if state.stats.iterations % CALIBRATION_FLUSH_ITERATIONS == 0:
                    await flush_calibration(_take_calibration(state), self.store, self.pair_key)
                yield GenerationChunk(state.generated[sent:], _stream_text(run, final),
                                      run.result() if final else None)
                sent = len(state.generated)
                if final:
                    return
        except Exception as exc:
            error = exc
            try:
                if not outage.active:  # in an outage the last saved record stays, resumable
                    await self._save(run, "failed", error=f"{type(exc).__name__}: {exc}")
            except StoreUnavailable:  # the store is what failed (it logs its outage once); raise exc
                pass
            except Exception:
                log.exception("could not record the failure of request %s", run.request_id)
            raise
        finally:
            try:
                proposer.close(run.committed)
            except Exception:  # the suffix cache is an optimisation: never fail a request for it
                log.exception("proposer failed to close for request %s", run.request_id)
            if error is None and self._closes_turn(run):
                task = asyncio.create_task(self._close_turn(run, sessions))
                self._turn_closes.add(task)
                task.add_done_callback(self._turn_closes.discard)
            else:
                await sessions.close()
            if not outage.active:  # else the counts are dropped, as in any outage, without a wait
                await flush_calibration(_take_calibration(state), self.store, self.pair_key)
            if run.probe is not None:
                _observe_end(run, run.probe, error)

    def _closes_turn(self, run: Run) -> bool:
        """Whether the ended run is a chat turn whose close goes through the target before its
        sessions are released (orchestrator.turn_close): its answer is whole, and no other request holds
        a slot (an ended run's clean-up holds none: admission.paced), so the pass takes no one's time."""
        return (self.config.close_chat_turns and bool(run.messages) and self.admission.active == 0
                and run.state.finish_reason in CLOSING_FINISHES)

    async def _close_turn(self, run: Run, sessions: RunSessions) -> None:
        """Render the chat with its answer as the last turn, pass what the verifier's session lacks
        through the target unless a request came in meanwhile, then release the sessions. Never raises:
        the close is an optimisation, and the session is released whatever happens."""
        try:
            async with asyncio.timeout(TURN_CLOSE_TIMEOUT_S):
                answer = ChatMessage("assistant", run.state.text + run.state.text_tail)
                rendered = await self.verifier.apply_chat_template([*run.messages, answer],
                                                                   self.config.chat_template)
                close = turn_close(run.settings.prompt_ids, run.state.generated, rendered)
                if close is not None and self.admission.active == 0:
                    await sessions.pass_turn_close(close)
        except Exception as exc:  # noqa: BLE001 - the next turn then computes these rows itself
            log.debug("the close of chat turn %s was not passed: %s", run.request_id, exc)
        finally:
            await sessions.close()

    async def _iteration(self, run: Run, sessions: RunSessions, proposer: Proposer) -> None:
        started = time.perf_counter()
        if run.probe is None:
            await self._iterate(run, sessions, proposer, None, started)
            return
        with run.probe.iteration(run.state.stats.iterations, started) as probe:  # its span is current inside
            await self._iterate(run, sessions, proposer, probe, started)

    async def _iterate(self, run: Run, sessions: RunSessions, proposer: Proposer,
                       probe: IterationProbe | None, started: float) -> None:
        """One iteration: plan → draft → verify → settle."""
        await self.link.ensure_serving()  # a verifier lost or changed under the run fails it (UNAVAILABLE)
        link = self.link
        step = Step(run, sessions, run.committed, Timeline(probe), link.depth_cap, link.drafter_lost)
        step.score_ahead = self._scores_ahead(run)
        draft = await self._draft(proposer, step, proposer.plan(step))
        outcome = await proposer.verify(step, draft)
        if not outcome.tokens:
            raise RuntimeError("verifier emitted no token")
        absorbed = await absorb(run, outcome, decode=self.verifier.decode, max_context=link.max_context())
        _take_output(run.state, absorbed)
        tally = account(run, position=step.position, tree=draft.tree, outcome=outcome, emitted=absorbed.kept,
                        method=AUTOREGRESSIVE if draft.target_only else run.settings.method,
                        k=draft.plan.k if draft.plan is not None else 0, heads=draft.heads,
                        fallback=draft.fallback, source=draft.source, started=started, timeline=step.timeline)
        proposer.settle(step, draft, outcome, tally.record)
        _take_counts(run.state, tally, step.counts)
        self._report(tally.record, probe, draft.tree.max_depth)

    def _scores_ahead(self, run: Run) -> bool:
        """Whether this iteration's verify asks the verifier to score the next one ahead
        (VerifyRequest.score_ahead): the run's method never drafts (every iteration is a target-only step
        of one token), a next iteration is sure to follow (two tokens left, and room for them in the
        context window; a stop token may still end the run, and then one pass is lost), and no other
        request runs (beside others the verifier's passes are batched and its idle time is theirs)."""
        if not self.config.score_ahead or run.settings.spec.speculative or self.admission.active > 1:
            return False
        after = len(run.settings.prompt_ids) + len(run.state.generated) + 2
        max_context = self.link.max_context()
        return (run.settings.max_new_tokens - len(run.state.generated) >= 2
                and (not max_context or after <= max_context))

    async def _draft(self, proposer: Proposer, step: Step, plan: Plan | None) -> Draft:
        """The plan's draft; a target-only step when the plan has none, or when the drafter is away
        or lost meanwhile (nothing was verified: the attempt is dropped, IterationRecord.fallback)."""
        if plan is not None and (not plan.needs_drafter or await self.link.drafter_ready()):
            try:
                return await proposer.draft(step, plan)
            except DrafterDown as exc:
                self.link.drafter_lost(exc.cause)
        return target_only_draft(step, fallback=plan is not None)

    # records and observers ---------------------------------------------------------------------
    async def _save_through(self, run: Run, final: bool, outage: StoreOutage) -> bool:
        """Save the iteration's progress through a store outage. True: saved, its chunk may go out.
        False: the store failed (within the grace: the run generates on, its record dirty, and the
        next iteration saves again). A final record is retried until it is saved, since the final
        chunk never goes out unsaved. Past the grace: StoreUnavailable (UNAVAILABLE), the record
        as last saved (resumable; every token the client got is in it, since chunks wait for saves)."""
        while True:
            try:
                await self._save(run, "done" if final else "running")
            except StoreUnavailable:
                outage.failed()  # raises once the outage has lasted the grace
                if not final:
                    return False
                await asyncio.sleep(min(FINAL_SAVE_RETRY_S, outage.left()))
                continue
            if outage.active:
                log.info("request %s saved again after a store outage of %.1f s", run.request_id,
                         outage.lasted())
                outage.ended()
            return True

    async def _save(self, run: Run, status: str, error: str | None = None) -> None:
        """Write the run's progress; a run whose record another run has taken over (it stalled past
        its lease and the request was resumed) stops here with StillRunning."""
        if not await self.store.put_request(self._record(run, status, error)) and status != "failed":
            raise StillRunning(f"request_id {run.request_id!r} was taken over by another run (Resume) "
                               f"after this run made no progress for its lease")

    def _record(
        self, run: Run, status: str, error: str | None = None, *, lease: bool = True
    ) -> RequestRecord:
        """The run's record; a running one is leased to this run for resume_lease_seconds from now."""
        record = run.to_record(status, error)
        if status == "running" and lease:
            record.lease_until = time.time() + self.config.resume_lease_seconds
        return record

    async def _release(self, run: Run) -> None:
        """Save the run's progress with no lease (a Resume may take it over at once)."""
        try:
            await self.store.put_request(self._record(run, "running", lease=False))
        except StoreUnavailable:  # logged by the store; the lease then runs out by itself
            pass
        except Exception:
            log.exception("could not release the record of request %s", run.request_id)

    def _report(self, record: IterationRecord, probe: IterationProbe | None, depth: int) -> None:
        if self.on_iteration is not None:
            try:
                self.on_iteration(record)
            except Exception:
                log.exception("on_iteration callback failed")
        if probe is not None:
            try:
                probe.finished(record, depth)
            except Exception:
                log.exception("observer failed at the end of an iteration")


def _observe_start(run: Run, observer: LoopObserver) -> RequestProbe | None:
    settings = run.settings
    try:
        return observer.request_started(run.request_id, run.epoch, {
            "method": settings.method, "k": settings.k, "a": settings.a, "tree_budget": settings.tree_budget,
            "max_new_tokens": settings.max_new_tokens, "prompt_tokens": len(settings.prompt_ids),
            "resumed_tokens": len(run.state.generated), "seed": settings.seed, "session_id": run.session_id,
            "temperature": settings.sampling.temperature, "top_p": settings.sampling.top_p,
            "top_k": settings.sampling.top_k, "chat": settings.chat,
        })
    except Exception:  # observability never fails a request
        log.exception("observer failed at the start of request %s", run.request_id)
        return None


def _observe_end(run: Run, probe: RequestProbe, error: BaseException | None) -> None:
    try:
        probe.finished(run.result() if error is None and run.finished else None, error)
    except Exception:
        log.exception("observer failed at the end of request %s", run.request_id)


async def _last_result(stream: AsyncIterator[GenerationChunk]) -> GenerationResult:
    result = None
    async for chunk in stream:
        if chunk.result is not None:
            result = chunk.result
    if result is None:
        raise RuntimeError("generation stream ended without a result")
    return result


# the one writer of RunState: what an iteration returned, applied ----------------------------------
def _take_output(state: RunState, absorbed: Absorbed) -> None:
    state.generated.extend(absorbed.kept)
    state.text, state.text_tail, state.text_cursor = absorbed.text, absorbed.text_tail, absorbed.text_cursor
    if absorbed.finish_reason is not None:
        state.finish_reason = absorbed.finish_reason


def _take_counts(state: RunState, tally: Tally, proposers: GenerationStats) -> None:
    state.stats.add(tally.stats)
    state.stats.add(proposers)
    state.stats.new_tokens = len(state.generated)
    state.calibration.update(tally.calibration)
    state.iterations.append(tally.record)


def _take_calibration(state: RunState) -> dict[str, int]:
    """The acceptance counts not yet in the store, taken out of the state."""
    counts = dict(state.calibration)
    state.calibration.clear()
    return counts


def _stream_text(run: Run, final: bool) -> str:
    """The chunk's text (output.text_delta), counted as sent."""
    delta, run.state.text_sent = text_delta(run, final)
    return delta
