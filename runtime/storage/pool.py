"""Fetch threads that never hold up a close or the interpreter's exit.

``DaemonPool`` is the part of ``ThreadPoolExecutor`` the shard supply uses (``submit``
returning a Future, ``shutdown`` cancelling what is queued) over daemon threads, and its
``shutdown`` waits a bounded time. A thread of ``ThreadPoolExecutor`` blocked in a
network read (a stalled server: up to the read timeout, for every attempt) held up
``close()`` and, through the executor's own exit hook, Ctrl-C for minutes; a daemon
thread still in such a read when its supply closes is left to end with its read, its
result discarded by the supply (runtime.storage.remote_supply), or with the process.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

from ..errors import kept

T = TypeVar("T")


class DaemonPool:
    """Up to ``threads`` daemon threads named ``name`` running submitted calls in order."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads = max(1, threads)
        self.name = name
        self.cond = threading.Condition()
        self.queue: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()
        self.running: list[threading.Thread] = []
        self.idle = 0
        self.closed = False

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        with self.cond:
            if self.closed:
                raise RuntimeError(f"{self.name}: cannot submit after shutdown")
            self.queue.append((future, fn, args))
            if self.idle == 0 and len(self.running) < self.threads:
                t = threading.Thread(target=self.run, name=self.name, daemon=True)
                self.running.append(t)
                t.start()
            self.cond.notify()
        return future

    def run(self) -> None:
        while True:
            with self.cond:
                self.idle += 1
                while not self.queue and not self.closed:
                    self.cond.wait()
                self.idle -= 1
                if not self.queue:  # closed
                    return
                future, fn, args = self.queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                got = fn(*args)
            except BaseException as e:
                with contextlib.suppress(InvalidStateError):  # answered meanwhile
                    future.set_exception(kept(e))
            else:
                with contextlib.suppress(InvalidStateError):
                    future.set_result(got)

    def shutdown(self, wait_s: float = 0.0, cancel_futures: bool = True) -> bool:
        """Takes no more calls, cancels the queued ones (``cancel_futures``) and waits up
        to ``wait_s`` seconds for the running ones; True when every thread ended."""
        with self.cond:
            self.closed = True
            if cancel_futures:
                while self.queue:
                    self.queue.popleft()[0].cancel()
            self.cond.notify_all()
            threads = [t for t in self.running if t is not threading.current_thread()]
        deadline = time.monotonic() + wait_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)
