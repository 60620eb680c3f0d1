"""``AsyncLLMEngine``: one ``LLMEngine`` driven by a background thread, fed by asyncio code.

Invariants:
- The loop thread is the only thread that calls into the engine's scheduler and requests (``add_admitted``,
  ``abort_request``, ``step``, and whatever a ``call`` runs there between two steps). The KV cache alone is
  shared: a ``call_cache`` runs on a thread of its own under the engine's ``cache_lock``, which the loop thread
  holds for everything it does but a step's forward passes (``kvcache.cache_lock``). Other threads only read what
  ``LLMEngine.__init__`` fixed: ``admit``, ``resolve_request_backend`` and ``segment_key`` (pure functions of
  the model and config), ``max_model_len``, ``tokenizer``, the KV pool's geometry and tensors, and the
  thread-safe grammar compiler's cache. A cluster peer reaches the engine only through its two
  ports, ``engine.kv_port.KVPort`` and ``engine.request_port.RequestPort``, which follow these rules.
- A request is admitted (``admission.admit``) in ``generate``, on the caller's side, before it is queued; the
  loop thread adds it as admitted.
- Callers hand commands over through a deque guarded by a condition variable; the loop thread sleeps on it
  while the engine is idle (or holds only requests whose KV gate is shut), so an idle engine costs nothing and
  a new request, or a gate that opens, wakes it at once.
- Each request's outputs are delivered on the caller's own event loop (``call_soon_threadsafe``), in order;
  the last item is a finished ``RequestOutput`` or an exception, after which the request is forgotten.
- A request whose own work failed inside a step (``RequestOutput.error``) ends with ``EngineError``; the
  others go on. A ``step`` that raises is the engine's failure, not one request's: it fails every request in
  the engine with ``EngineError``, aborts them so their pages are freed, and the loop keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Mapping

import torch

from nebula_engine.config import EngineConfig
from nebula_engine.engine.admission import ENGINE_DEFAULT, AdmittedRequest, EnginePrompt, admit
from nebula_engine.engine.kv_plan import ORDINARY, KVPlan
from nebula_engine.engine.llm_engine import LLMEngine
from nebula_engine.engine.outputs import RequestOutput
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while serving a request (not the request's fault)."""


class EngineDeadError(EngineError):
    """The engine loop is shut down (or crashed) and accepts no more requests."""


@dataclass(frozen=True)
class EngineStats:
    """Load snapshot published by the loop thread after each step."""

    num_waiting: int = 0  # requests queued, not yet scheduled (includes preempted ones)
    num_running: int = 0  # requests holding KV pages, prefilling or decoding
    alive: bool = True  # False once the loop has stopped: no request will be served
    kv_cache_usage: float = 0.0  # fraction of the KV pool's pages held by requests (``Scheduler.kv_cache_usage``)
    # (kind "prefix" | "pic", tier "host" | "disk", tokens): reused KV found below the device and brought back, so far
    tier_hit_tokens: tuple[tuple[str, str, int], ...] = ()


_KIND_LABELS = {"pc": "prefix", "pic": "pic"}


def tier_hits(promoted: Mapping) -> tuple[tuple[str, str, int], ...]:
    """``CacheStore.promoted_tokens()`` as ``EngineStats.tier_hit_tokens``."""
    return tuple((_KIND_LABELS[kind.value], tier.value, tokens) for (kind, tier), tokens in sorted(promoted.items()))


@dataclass(frozen=True)
class _Add:
    request_id: str
    request: AdmittedRequest
    kv_plan: KVPlan = ORDINARY


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: object  # fn(engine) -> result, run on the loop thread between steps
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class _OutputChannel:
    """Hands items from the loop thread to one request's consumer on its own event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> bool:
        """False if the consumer's loop is gone (nobody will ever read this)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # loop closed
            return False
        return True


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._wakeup = threading.Condition()
        self._commands: deque[_Add | _Abort] = deque()  # guarded by _wakeup
        self._channels: dict[str, _OutputChannel] = {}  # guarded by _wakeup
        self._in_engine: set[str] = set()  # loop thread only: ids added to the engine, not yet finished
        self._stopping = False
        self._dead = False
        self._stats = EngineStats()
        self._cache_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nebula-engine-cache")
        self._thread = threading.Thread(target=self._run, name="nebula-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        return self._stats

    def admit(self, prompt: EnginePrompt, params: SamplingParams,
              pic_backend: str | None = ENGINE_DEFAULT) -> AdmittedRequest:
        """Check a request against this engine and resolve its backend (``admission.admit``); safe from any
        thread, as it reads only what the engine fixed when it was built. Raises ``ValueError`` on bad input."""
        return admit(self.engine, prompt, params, pic_backend)

    async def generate(self, request_id: str, prompt: EnginePrompt, params: SamplingParams,
                       pic_backend: str | None = ENGINE_DEFAULT, route: str | None = None,
                       kv_plan: KVPlan = ORDINARY) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of ``request_id`` as they are produced; the last one has ``finished`` set.

        Invalid input raises ``ValueError`` on the first iteration, before anything is queued. Leaving the
        iteration early (``aclose``, cancellation) aborts the request in the engine. ``kv_plan``
        (``engine.kv_plan``): its pages held after it finishes, a gate it waits for in the queue.
        """
        if route is not None:
            raise ValueError("prefill_peer needs a cluster; this server runs one engine")
        if params.structured_outputs is not None:  # compiling a grammar (first time: seconds) must not stall the loop
            request = await asyncio.to_thread(self.admit, prompt, params, pic_backend)
        else:
            request = self.admit(prompt, params, pic_backend)
        channel = _OutputChannel(asyncio.get_running_loop())
        if kv_plan.gate is not None:
            kv_plan.gate.on_open = self._wake
        self._submit(request_id, _Add(request_id, request, kv_plan), channel)
        async for item in self._drain(request_id, channel):
            yield item

    def _wake(self) -> None:
        """Let the loop look again for work (a KV gate opened while it slept)."""
        with self._wakeup:
            self._wakeup.notify()

    def _submit(self, request_id: str, command: _Add, channel: _OutputChannel) -> None:
        with self._wakeup:
            if self._stopping or self._dead:
                raise EngineDeadError("the engine is shut down")
            if request_id in self._channels:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._channels[request_id] = channel
            self._commands.append(command)
            self._wakeup.notify()

    async def call(self, fn):
        """Run ``fn(engine)`` on the loop thread between two steps and return its result (or raise its error).

        This is how other components (the engine's ports, ``KVPort`` and ``RequestPort``) touch engine state
        without racing the loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._wakeup:
            if self._stopping or self._dead:
                raise EngineDeadError("the engine is shut down")
            self._commands.append(_Call(fn, future, loop))
            self._wakeup.notify()
        return await future

    async def call_cache(self, fn):
        """Run ``fn(engine)`` holding the engine's ``cache_lock`` and return its result: it runs between two steps
        or while a step's forward computes, so it waits for the cache work of a step, not for the step. Cache
        calls run one at a time, in the order they were made, on a thread of their own (waiting for the lock
        holds up no other executor thread). ``fn`` may touch only ``engine.cache_store`` (its pool, PIC store,
        prefix tree and tiers): the scheduler and running requests are the loop thread's alone."""
        if self._stopping or self._dead:
            raise EngineDeadError("the engine is shut down")

        def locked():
            with self.engine.cache_lock:
                return fn(self.engine)

        return await asyncio.get_running_loop().run_in_executor(self._cache_thread, locked)

    async def prefill(self, request_id: str, prompt_token_ids: list[int]) -> RequestOutput:
        """Compute a plain prompt's K/V into the prefix cache without sampling (a ``prefill_only`` plan: no
        logits); its finished output, which carries no token."""
        request = self.admit(list(prompt_token_ids), SamplingParams(max_tokens=1, temperature=0.0), None)
        channel = _OutputChannel(asyncio.get_running_loop())
        self._submit(request_id, _Add(request_id, request, KVPlan(prefill_only=True)), channel)
        last = None
        async for last in self._drain(request_id, channel):
            pass
        return last

    async def generate_held(self, request_id: str, prompt: EnginePrompt, params: SamplingParams,
                            pic_backend: str | None = ENGINE_DEFAULT, kv_plan: KVPlan = KVPlan(hold=True)
                            ) -> RequestOutput:
        """Run a request whose plan holds its pages when it finishes (``LLMEngine.release_held`` frees them);
        returns its finished output."""
        if not kv_plan.hold:
            raise ValueError("generate_held takes a plan that holds the pages")
        last = None
        async for last in self.generate(request_id, prompt, params, pic_backend, kv_plan=kv_plan):
            pass
        return last

    async def generate_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token: int,
                                 first_logprob: float, params: SamplingParams, cached: tuple[int, ...],
                                 linear_state: Mapping[str, list[torch.Tensor]] | None = None,
                                 ) -> AsyncIterator[RequestOutput]:
        """Stream a request prefilled by another engine (``LLMEngine.add_prefilled``, with the linear-attention
        state after its prompt for hybrid models; its pages were reserved with ``reserve_prefilled`` and written).
        The first item is the output after its first token."""
        channel = _OutputChannel(asyncio.get_running_loop())
        with self._wakeup:
            if request_id in self._channels:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._channels[request_id] = channel

        def add(engine: LLMEngine) -> None:
            try:
                first = engine.add_prefilled(request_id, prompt_token_ids, first_token, first_logprob, params, cached,
                                             linear_state)
            except Exception as exc:
                engine.cancel_prefilled(request_id)
                self._deliver_last(request_id, exc)
                return
            if first.finished:
                self._deliver_last(request_id, first)
            else:
                self._in_engine.add(request_id)
                self._deliver(first)

        await self.call(add)
        async for item in self._drain(request_id, channel):
            yield item

    async def _drain(self, request_id: str, channel: _OutputChannel) -> AsyncIterator[RequestOutput]:
        """Items of ``channel`` until the finished output (or an error, raised); leaving early aborts."""
        done = False
        try:
            while not done:
                item = await channel.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
        finally:
            if not done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop ``request_id`` (no-op if unknown or finished); returns at once, its stream gets nothing more."""
        with self._wakeup:
            if self._channels.pop(request_id, None) is not None:
                self._commands.append(_Abort(request_id))
                self._wakeup.notify()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop thread; requests still in flight fail with ``EngineDeadError``."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join(timeout)
        self._cache_thread.shutdown(wait=False, cancel_futures=True)

    # ---- loop thread ----

    def _run(self) -> None:
        try:
            while (commands := self._next_commands()) is not None:
                for command in commands:
                    with self.engine.cache_lock:
                        self._apply(command)
                if self.engine.has_schedulable_requests():
                    self._step()
                scheduler = self.engine.scheduler
                self._stats = EngineStats(len(scheduler.waiting), len(scheduler.running),
                                          kv_cache_usage=scheduler.kv_cache_usage,
                                          tier_hit_tokens=tier_hits(self.engine.cache_store.promoted_tokens()))
        except BaseException:
            logger.exception("engine loop crashed; failing every request")
        finally:
            self._close(EngineDeadError("the engine loop has stopped"))

    def _next_commands(self) -> list[_Add | _Abort] | None:
        """Commands to apply now, waiting while there is nothing to do; None once shutdown is asked."""
        with self._wakeup:
            while not (self._commands or self._stopping or self.engine.has_schedulable_requests()):
                self._wakeup.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Call):
            try:
                result = command.fn(self.engine)
            except BaseException as exc:
                command.loop.call_soon_threadsafe(_settle, command.future, None, exc)
            else:
                command.loop.call_soon_threadsafe(_settle, command.future, result, None)
            return
        if isinstance(command, _Abort):
            if command.request_id in self._in_engine:
                self._in_engine.discard(command.request_id)
                self.engine.abort_request(command.request_id)
            return
        if not self._is_live(command.request_id):
            return  # aborted before it reached the engine
        try:
            self.engine.add_admitted(command.request_id, command.request, command.kv_plan)
        except Exception as exc:  # the request's fault (ValueError) or the engine's: either way only this one
            self._deliver_last(command.request_id, exc)
            return
        self._in_engine.add(command.request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the %d requests in flight", len(self._in_engine))
            self._fail_in_flight(EngineError(f"engine step failed: {exc!r}"))
            return
        for output in outputs:
            if output.error is not None:
                self._in_engine.discard(output.request_id)
                self._deliver_last(output.request_id, EngineError(output.error))
            elif output.finished:
                self._in_engine.discard(output.request_id)
                self._deliver_last(output.request_id, output)
            else:
                self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        with self._wakeup:
            channel = self._channels.get(output.request_id)
        if channel is not None and not channel.put(output):
            self.abort(output.request_id)

    def _deliver_last(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._wakeup:
            channel = self._channels.pop(request_id, None)
        if channel is not None:
            channel.put(item)

    def _is_live(self, request_id: str) -> bool:
        with self._wakeup:
            return request_id in self._channels

    def _fail_in_flight(self, error: EngineError) -> None:
        for request_id in list(self._in_engine):
            try:
                with self.engine.cache_lock:
                    self.engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort %r after the engine failure", request_id)
            self._deliver_last(request_id, error)
        self._in_engine.clear()

    def _close(self, error: EngineDeadError) -> None:
        for request_id in list(self._in_engine):  # leave the engine idle, as if those requests never came
            try:
                with self.engine.cache_lock:
                    self.engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort %r at shutdown", request_id)
        self._in_engine.clear()
        with self._wakeup:
            self._dead = True
            self._stats = EngineStats(alive=False)
            channels, self._channels = self._channels, {}
            calls = [c for c in self._commands if isinstance(c, _Call)]
            self._commands.clear()
        for call in calls:
            call.loop.call_soon_threadsafe(_settle, call.future, None, error)
        for channel in channels.values():
            channel.put(error)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
