"""Several jobs on one generator: their turns on the one engine, by fair share.

A generator of the fleet serves every job its engine can serve together (ARCHITECTURE.md, "Several
jobs on one fleet"), each job in a thread of its own (broker/fleet.py `serve_all`). The engine runs
one call at a time; `FairGate` decides whose call goes next when several jobs wait: the job with the
least engine time per unit of its `share` (the spec's weight), start-time fair queueing. A job that
has nothing to generate (its trainer has not fed it) does not wait at the gate, so its share goes
to the others; when it comes back it starts level with the jobs that kept going (no credit for the
time it did not use). `EngineView` is the engine as one job sees it: every call takes that job's
turn and uses its adapter, and what the calls cost is counted per job (seconds, tokens): the
figures the beacon shows (GET /fleet) and the samples' `gen_seconds` record (the ledger).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Usage:
    """What one job used of the engine here."""

    share: float = 1.0
    seconds: float = 0.0
    tokens: int = 0
    calls: int = 0


@dataclass
class FairShares:
    """Start-time fair queueing over engine seconds: pure bookkeeping, no clock and no threads.

    Each job has a virtual time, its engine seconds divided by its share. `pick` takes the waiting
    job with the least virtual time (the earliest arrival on a tie); `merged` the waiting jobs
    close enough to it to share its call; `charge` adds a finished turn's seconds / share. A job
    that comes back from idle (it had nothing to generate) is lifted to the least virtual time of
    the jobs active meanwhile (`start` with a `floor`), so time it did not use is not owed to it;
    a busy job that was only away between its calls keeps its place (no floor)."""

    vtime: dict[str, float] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)

    def join(self, job: str, share: float, floor: float = 0.0) -> None:
        if share <= 0:
            raise ValueError(f"job {job}: share must be > 0, got {share}")
        self.shares[job] = share
        self.vtime.setdefault(job, floor)

    def leave(self, job: str) -> None:
        self.shares.pop(job, None)
        self.vtime.pop(job, None)

    def start(self, job: str, floor: float | None = None) -> None:
        """`job` comes to the gate; `floor`: the least virtual time of the jobs active while it
        was idle (None: it was not idle, or no one else was active)."""
        current = self.vtime.get(job, 0.0 if floor is None else floor)
        self.vtime[job] = current if floor is None else max(current, floor)

    def pick(self, waiting: list[str]) -> str:
        """The waiting job to go next (`waiting` in arrival order)."""
        return min(waiting, key=lambda j: self.vtime.get(j, 0.0))  # min keeps the first on a tie

    def merged(self, head: str, generating: list[str], window: float) -> list[str]:
        """The jobs whose waiting generate calls run in one engine call with `head`'s (the job
        `pick` chose): those of `generating` (in arrival order, `head` among them) within
        `window` of `head`'s virtual time."""
        lead = self.vtime.get(head, 0.0)
        return [j for j in generating if self.vtime.get(j, 0.0) <= lead + window]

    def charge(self, job: str, seconds: float) -> None:
        self.vtime[job] = self.vtime.get(job, 0.0) + seconds / self.shares.get(job, 1.0)


@dataclass
class _Wait:
    """One job's request for the engine: an exclusive turn (a swap, a probe: `gen` None) or a
    generate call (`gen`: its prompts, params and n, run merged with other jobs' calls)."""

    job: str
    gen: tuple[list, list, list[int]] | None = None
    result: list | None = None
    error: BaseException | None = None
    done: bool = False


class FairGate:
    """The engine's calls, granted by `FairShares`, with several jobs' generate calls merged.

    Waiting requests are served in fair order: the one of the job with the least virtual time
    first. An exclusive turn (a weight swap, a probe) runs alone. A generate call runs as one engine
    call together with every other job's waiting generate call whose virtual time is within the last
    merged call's duration of it (vLLM batches requests of different adapters in one step: for LoRA
    jobs over one base this is the multi-LoRA throughput), so jobs of equal share are merged every
    time and a job far ahead of its share waits out a call or more: over time each job gets engine
    seconds in proportion to its share whichever way the calls were merged. A merged call's seconds
    are charged to its jobs by their completion tokens. Counts each job's `Usage`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, max_hold_s: float = 1.0):
        self._clock, self.max_hold_s = clock, max_hold_s
        self._cv = threading.Condition()
        self._fair = FairShares()
        self._waiting: list[_Wait] = []
        self._busy = False
        self._window = 0.0  # the last merged call's seconds: how far apart merged jobs may be
        self._free_at = 0.0  # time.monotonic() when the engine last became free
        self._last_gen: dict[str, float] = {}  # time.monotonic() each job's last generate call ended
        self._running: set[str] = set()  # the jobs of the call on the engine now
        self.usage: dict[str, Usage] = {}

    def join(self, job: str, share: float = 1.0) -> None:
        with self._cv:
            floor = self._floor(job)
            self._fair.join(job, share, 0.0 if floor is None else floor)
            self.usage[job] = Usage(share=share)

    def _recent(self, job: str, now: float) -> bool:
        """Whether `job` generated within the last two calls' time: a busy job between its calls."""
        at = self._last_gen.get(job)
        return at is not None and now - at < 2 * self._window + 0.5

    def _floor(self, job: str) -> float | None:
        """Where `job` starts on coming to the gate: None when it is busy (it keeps its place),
        else the least virtual time of the jobs active now (waiting, on the engine, or busy)."""
        now = time.monotonic()
        if self._recent(job, now):
            return None
        waiting = {w.job for w in self._waiting}
        active = [
            j for j in self._fair.shares if j != job and (j in waiting or j in self._running or self._recent(j, now))
        ]
        return min(self._fair.vtime.get(j, 0.0) for j in active) if active else None

    def leave(self, job: str) -> None:
        with self._cv:
            self._fair.leave(job)
            self.usage.pop(job, None)
            self._last_gen.pop(job, None)

    def _head(self) -> _Wait:
        """The waiting request served next (call with the lock held, something waiting)."""
        job = self._fair.pick([w.job for w in self._waiting])
        return next(w for w in self._waiting if w.job == job)

    def _enter(self, me: _Wait) -> list[_Wait] | None:
        """Wait until `me` is served: the requests to run now when this thread runs them (its
        own, and for a generate call the other jobs' merged with it), None when another thread
        ran `me` in its merged call. Call with the lock held."""
        self._fair.start(me.job, self._floor(me.job))
        self._waiting.append(me)
        self._cv.notify_all()  # a leader holding the engine for a job on its way comes back here
        while not me.done:
            if not self._busy and self._head() is me:
                if me.gen is not None and (left := self._anticipate(me)) > 0:
                    self._cv.wait(timeout=left)
                    continue
                if me.gen is None:
                    batch = [me]
                else:
                    jobs = self._fair.merged(me.job, [w.job for w in self._waiting if w.gen is not None], self._window)
                    batch = [w for w in self._waiting if w.job in jobs and w.gen is not None]
                for w in batch:
                    self._waiting.remove(w)
                self._running = {w.job for w in batch}
                self._busy = True
                return batch
            self._cv.wait()
        return None

    def _anticipate(self, head: _Wait) -> float:
        """Seconds to hold the free engine for a generating job on its way back to the gate.

        A busy job is away from the gate between its calls (publishing what it generated, reading
        its next prompts): without a wait, every call would start without it, and a job whose
        share entitles it to every call would get only the calls it happens to be back for. So a
        merged call waits, up to the last call's duration (at most `max_hold_s`) after the engine
        became free, for a job that generated within the last two calls' time and whose virtual
        time would merge it into this call. A job that stays away longer (it waits on its
        trainer) is not waited for again until it generates again."""
        now = time.monotonic()
        waiting = {w.job for w in self._waiting}
        lead = self._fair.vtime.get(head.job, 0.0)
        away = [
            j
            for j in self._last_gen
            if j not in waiting
            and j in self._fair.shares
            and self._recent(j, now)
            and self._fair.vtime.get(j, 0.0) <= lead + self._window
        ]
        return self._free_at + min(self.max_hold_s, self._window) - now if away else 0.0

    @contextmanager
    def turn(self, job: str) -> Iterator[Usage]:
        """The engine is `job`'s alone for the `with` block; its seconds are charged to the job."""
        me = _Wait(job)
        with self._cv:
            self._enter(me)
        t0 = self._clock()
        usage = self.usage.setdefault(job, Usage())
        try:
            yield usage
        finally:
            self._finish([me], [self._clock() - t0])

    def generate(
        self, job: str, call: tuple[list, list, list[int]], run: Callable[[list[tuple[str, tuple]]], list]
    ) -> list:
        """`job`'s generate call (prompts, params, n), merged with the other jobs' waiting ones:
        `run` takes [(job, call), ...] and returns each call's result (per prompt, its samples)."""
        me = _Wait(job, gen=call)
        with self._cv:
            batch = self._enter(me)
        if batch is not None:  # this thread runs the merged call
            t0 = self._clock()
            try:
                results = run([(w.job, w.gen) for w in batch if w.gen is not None])
                for w, res in zip(batch, results, strict=True):
                    w.result = res
            except BaseException as exc:  # noqa: BLE001 - every merged job gets the engine's error
                for w in batch:
                    w.error = exc
            dt = self._clock() - t0
            tokens = [sum(len(s.completion_ids) for group in (w.result or []) for s in group) for w in batch]
            total = sum(tokens)
            self._finish(
                batch,
                [dt * (t / total if total else 1 / len(batch)) for t in tokens],
                tokens,
                window=dt,
            )
        if me.error is not None:
            raise me.error
        assert me.result is not None
        return me.result

    def _finish(
        self,
        batch: list[_Wait],
        seconds: list[float],
        tokens: list[int] | None = None,
        window: float | None = None,
    ) -> None:
        with self._cv:
            for i, (w, dt) in enumerate(zip(batch, seconds, strict=True)):
                self._fair.charge(w.job, dt)
                usage = self.usage.setdefault(w.job, Usage())
                usage.seconds += dt
                usage.calls += 1
                if tokens is not None:
                    usage.tokens += tokens[i]
                w.done = True
            if window is not None:
                self._window = window
                now = time.monotonic()
                self._last_gen.update((w.job, now) for w in batch)
            self._free_at = time.monotonic()
            self._running = set()
            self._busy = False
            self._cv.notify_all()

    def load(self) -> dict[str, dict[str, Any]]:
        """Per job: share, engine seconds and tokens so far (the beacon's `load`)."""
        with self._cv:
            return {
                j: {"share": u.share, "seconds": round(u.seconds, 3), "tokens": u.tokens, "calls": u.calls}
                for j, u in self.usage.items()
            }


class EngineView:
    """The engine as one job (`tenant`) sees it: each call waits for the job's turn at the gate,
    applies the job's adapter, and is counted to the job. Has the methods of `Engine` the
    generator's parts call, so they take a view where they took the engine."""

    def __init__(self, engine: Any, gate: FairGate, tenant: str):
        self.engine, self.gate, self.tenant = engine, gate, tenant

    @property
    def busy_s(self) -> float:
        """Engine seconds this job used here so far."""
        u = self.gate.usage.get(self.tenant)
        return 0.0 if u is None else u.seconds

    def generate(self, prompts: list, params: list, n: list[int]) -> list:
        """The job's generate call, run in one engine call with the other jobs' waiting ones."""
        return self.gate.generate(self.tenant, (prompts, params, n), self._run_merged)

    def _run_merged(self, calls: list[tuple[str, tuple]]) -> list:
        """One engine call for several jobs' calls, each prompt with its job's adapter; the
        samples split back per call."""
        prompts, params, n, tenants, sizes = [], [], [], [], []
        for job, (p, sp, k) in calls:
            prompts += p
            params += sp
            n += k
            tenants += [job] * len(p)
            sizes.append(len(p))
        out = self.engine.generate(prompts, params, n, tenant=tenants if len(calls) > 1 else calls[0][0])
        split, at = [], 0
        for size in sizes:
            split.append(out[at : at + size])
            at += size
        return split

    def load_version(self, transport: str, address: str, manifest: Any, adapter: Any = None) -> dict:
        with self.gate.turn(self.tenant):
            return self.engine.load_version(transport, address, manifest, adapter, tenant=self.tenant)  # type: ignore[no-any-return]

    def score(self, token_ids: list[int]) -> list[float]:
        with self.gate.turn(self.tenant):
            return self.engine.score(token_ids, tenant=self.tenant)  # type: ignore[no-any-return]

    def fingerprint(self) -> str:
        with self.gate.turn(self.tenant):
            return self.engine.fingerprint(tenant=self.tenant)  # type: ignore[no-any-return]

    def adapter_name(self) -> str:
        return self.engine.adapter_name(self.tenant)  # type: ignore[no-any-return]

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()
