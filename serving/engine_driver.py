"""`EngineDriver`: one thread owns the `Engine` and serves every connection of the server.

The engine is not thread-safe. The driver thread loops ``engine.step()`` while work exists and
sleeps otherwise; other threads hand it commands (add, abort, a call to run when idle) through
a thread-safe queue, and get each request's outputs back through the ``sink`` given with it
(the server's sinks put them on an asyncio queue with ``loop.call_soon_threadsafe``). Requests
from concurrent clients are therefore batched by the scheduler as `LLM.generate`'s are.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from serving.engine import Engine
from serving.outputs import RequestOutput
from serving.sampling_params import SamplingParams

__all__ = ["EngineDriver"]

# a request's sink: called on the driver thread with each of its outputs, or an exception
Sink = Callable[[RequestOutput | BaseException], None]


class EngineDriver:
    """The engine loop on its own thread (docs/server.md).

    Args:
        engine: the engine it owns from `start` on (nothing else may call it meanwhile, except
            through `call_when_idle`).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # called on the driver thread after every step with that step's outputs
        self.observers: list[Callable[[Engine, list[RequestOutput]], None]] = []
        self.error: BaseException | None = None  # what stopped the loop, if it failed
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, Sink] = {}
        self._idle_calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._flush = False  # step once more: aborted requests' final outputs wait in the engine
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="dsv4-engine", daemon=True)

    # ---------------------------------------------------------------- any thread

    def start(self) -> EngineDriver:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        sink: Sink,
        *,
        prompt: str | None = None,
    ) -> None:
        """Queue a request (`Engine.add_request`'s arguments); its outputs, or the ValueError
        that refused it, go to ``sink`` on the driver thread."""
        self._command(("add", request_id, list(prompt_token_ids), params, prompt, sink))

    def abort(self, request_id: str) -> None:
        """Abort a request added before (a finished one is ignored); its blocks are freed on
        the driver's next turn."""
        self._command(("abort", request_id))

    def call_when_idle(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the driver thread once no request is running (e.g. `LLM.generate`
        on the same engine); returns a future of its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._command(("call", fn, future))
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Abort every request, finish the loop and join the thread."""
        self._command(("stop",))
        self._thread.join(timeout)

    def _command(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---------------------------------------------------------------- the driver thread

    def _run(self) -> None:
        try:
            with self.engine.serving_loop():
                while self._turn():
                    pass
        except BaseException as exc:  # the engine failed: every waiting client hears of it
            self.error = exc
            self._stopping = True
            for sink in self._sinks.values():
                sink(exc)
            self._sinks.clear()
            for _, future in self._idle_calls:
                future.set_exception(exc)
            raise

    def _turn(self) -> bool:
        """One turn of the loop: take the commands, then step, run the idle calls, or sleep.
        Returns False when the driver should stop."""
        self._take_commands()
        engine = self.engine
        if engine.has_unfinished_requests() or self._flush:
            self._flush = False
            outputs = engine.step()
            for observe in self.observers:
                observe(engine, outputs)
            self._deliver(outputs)
            return True
        if self._idle_calls:
            calls, self._idle_calls = self._idle_calls, []
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except Exception as exc:
                    future.set_exception(exc)
            return True
        if self._stopping:
            return False
        self._wake.wait()
        self._wake.clear()
        return True

    def _take_commands(self) -> None:
        while not self._commands.empty():  # this thread is the only reader
            command = self._commands.get_nowait()
            kind, args = command[0], command[1:]
            if kind == "add":
                self._add(*args)
            elif kind == "abort":
                self._abort(args[0])
            elif kind == "call":
                self._idle_calls.append(args)
            else:  # stop
                self._stopping = True
                for request_id in list(self._sinks):
                    self._abort(request_id)

    def _add(self, request_id, prompt_ids, params, prompt, sink: Sink) -> None:
        if self._stopping:
            sink(RuntimeError("the server is shutting down"))
            return
        try:
            self.engine.add_request(request_id, prompt_ids, params, prompt=prompt)
        except (ValueError, TypeError) as exc:
            sink(exc)
            return
        self._sinks[request_id] = sink

    def _abort(self, request_id: str) -> None:
        if request_id not in self._sinks:
            return  # finished already (or refused)
        self.engine.abort_request(request_id)
        self._flush = True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = (
                self._sinks.pop(out.request_id) if out.finished else self._sinks.get(out.request_id)
            )
            if sink is not None:
                sink(out)
