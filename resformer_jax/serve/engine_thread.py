"""The engine in a thread of its own: HTTP handlers never wait on a device step. Submissions and cancellations
go in through a queue; each request's tokens come back through its callback, which hands them to the handler's
event loop."""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from resformer_jax.engine import Engine, FinishReason, NewToken, Output, Request, SamplingParams
from resformer_jax.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Handle:
    """A request as the server holds it: what was asked, and the engine's request once the thread has it."""

    prompt: list[int]
    params: SamplingParams
    on_output: Callable[[Request, Output], Any]
    request: Request | None = None
    cancelled: bool = False


class EngineThread:
    def __init__(self, engine: Engine, metrics: ServeMetrics):
        self.engine, self.metrics = engine, metrics
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._recent: collections.deque = collections.deque()  # (time, tokens) of the last steps, for tokens/s
        metrics.label(metrics.pages_total).set(engine.pool.usable)
        for counter in (metrics.prefix_queries, metrics.prefix_hits, metrics.preemptions):
            metrics.label(counter)  # exported from the start, at 0 (as vLLM's are)
        metrics.label(metrics.compiles_after_start).set(engine.compiles_after_start)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)

    def submit(self, prompt: list[int], params: SamplingParams, on_output) -> Handle:
        """Checks the request here (EngineError in the caller's thread), then hands it to the engine."""
        self.engine.check(prompt, params)
        h = Handle(prompt, params, on_output)
        self._commands.put(("submit", h))
        return h

    def cancel(self, h: Handle, reason: FinishReason = "cancelled", say: str | None = None) -> None:
        """Ends the request (at the thread's next turn); `say`: a line logged if this is what ends it (a request
        that finished meanwhile keeps its own reason, and says nothing)."""
        self._commands.put(("cancel", (h, reason, say)))

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not self.engine.busy)
                if self.engine.busy:
                    st = self.engine.stats
                    before = (st.generated_tokens, st.preemptions, st.prefix_queries, st.prefix_hits)
                    self.engine.step()
                    after = (st.generated_tokens, st.preemptions, st.prefix_queries, st.prefix_hits)
                    self._observe(*(a - b for a, b in zip(after, before)))
            except Exception:  # a failed step must not leave clients waiting forever: end what is running
                log.exception("engine step failed; ending the running requests")
                for r in list(self.engine.running) + list(self.engine.waiting):
                    self.engine.cancel(r, "error")

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = cmd
            if kind == "submit" and not arg.cancelled:
                arg.request = self.engine.submit(arg.prompt, arg.params, on_output=self._outputs_to(arg))
                self.metrics.label(self.metrics.prompt_tokens).inc(len(arg.prompt))
            elif kind == "cancel":
                h, reason, say = arg
                h.cancelled = True
                if say and (h.request is None or not h.request.done):
                    log.warning(say)
                if h.request is not None:
                    self.engine.cancel(h.request, reason)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self._gauges()

    def _outputs_to(self, h: Handle):
        m = self.metrics

        def on_output(r: Request, out: Output) -> None:
            if isinstance(out, NewToken):
                times = r.token_times_s
                if len(times) == 1:
                    m.label(m.ttft).observe(times[0] - r.submitted_s)
                else:
                    m.label(m.itl).observe(times[-1] - times[-2])
            else:
                m.label(m.requests, finished_reason=out.reason).inc()
            h.on_output(r, out)

        return on_output

    def _observe(self, tokens: int, preemptions: int, prefix_queries: int = 0, prefix_hits: int = 0) -> None:
        m, now = self.metrics, time.perf_counter()
        m.label(m.generation_tokens).inc(tokens)
        if preemptions:
            m.label(m.preemptions).inc(preemptions)
        if prefix_queries:
            m.label(m.prefix_queries).inc(prefix_queries)
            m.label(m.prefix_hits).inc(prefix_hits)
        self._recent.append((now, tokens))
        while self._recent and now - self._recent[0][0] > 5.0:
            self._recent.popleft()
        span = now - self._recent[0][0] if len(self._recent) > 1 else 0.0
        m.label(m.tokens_per_s).set(sum(t for _, t in self._recent) / span if span > 0 else 0.0)
        self._gauges()

    def _gauges(self) -> None:
        m, e = self.metrics, self.engine
        m.label(m.running).set(len(e.running))
        m.label(m.waiting).set(len(e.waiting))
        m.label(m.pages_used).set(e.pool.used)
        m.label(m.cache_usage).set(e.pool.used / e.pool.usable)
        m.label(m.most_running).set(e.stats.most_concurrent)
        m.label(m.compiles_after_start).set(e.compiles_after_start)
