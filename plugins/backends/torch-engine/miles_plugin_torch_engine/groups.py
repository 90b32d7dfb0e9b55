"""``/init_weights_update_group`` off the engine thread, bounded: the trainer's store must accept a
TCP connection within a short connect timeout (a dead address fails then, not after the join
timeout), the join itself has a deadline, and one join runs at a time (a second one is refused
while the first still holds its thread), so requests to dead addresses cannot pile up threads."""
from __future__ import annotations

import asyncio
import inspect
import socket
import threading
import time
from typing import Any, Callable

from .limits import GROUP_JOIN_TIMEOUT_S


class JoinBusy(Exception):
    """A join is still running (answered 409)."""


class StoreUnreachable(ConnectionError):
    """Nothing accepted a connection at the group's master address in time."""


def check_join_args(kwargs: dict) -> None:
    """ValueError (a 400) naming a field of the join request that cannot be right."""
    addr, port = kwargs.get("master_address"), kwargs.get("master_port")
    if not isinstance(addr, str) or not addr or len(addr) > 253:
        raise ValueError("master_address: give the trainer's host name or IP address as a string")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"master_port: {port!r} is not a TCP port (1-65535)")
    world, rank = kwargs.get("world_size"), kwargs.get("rank_offset")
    if not isinstance(world, int) or isinstance(world, bool) or not 2 <= world <= 65536:
        raise ValueError(f"world_size: {world!r}; give the group's rank count (>= 2: the trainer and "
                         f"this engine)")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank < world:
        raise ValueError(f"rank_offset: {rank!r}; give this engine's rank in [1, world_size) (the "
                         f"trainer is rank 0)")


def wait_for_listener(host: str, port: int, timeout_s: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; TimeoutError after ``timeout_s``
    (the trainer opens its store before it asks engines to join, so this is quick when it is up);
    StoreUnreachable after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            why = f" ({last.strerror or last})" if last else ""
            raise StoreUnreachable(f"no weights-update store accepts connections at {host}:{port} within "
                               f"{timeout_s:g} s{why}; start the trainer's group first, or check "
                               f"master_address and master_port")
        try:
            socket.create_connection((host, port), timeout=min(left, 5.0)).close()
            return
        except OSError as e:
            last = e
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


class GroupJoins:
    """Runs joins (see the module docstring); ``state`` is what ``/health`` reports."""

    def __init__(self, timeout_s: float = GROUP_JOIN_TIMEOUT_S, connect_timeout_s: float = 10.0):
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.state: dict[str, Any] = {"state": "none"}
        self._thread: threading.Thread | None = None
        self._waiting: set[asyncio.Future] = set()

    def stop(self) -> None:
        """The server is shutting down: waiting handlers answer now (a join thread still blocked
        in torch is a daemon and ends with the process)."""
        for future in self._waiting:
            if not future.done():
                future.set_exception(ConnectionAbortedError("the server is shutting down"))

    async def join(self, fn: Callable[..., Any], kwargs: dict) -> Any:
        if self._thread is not None and self._thread.is_alive():
            raise JoinBusy(f"a weights-update group join ({self.state.get('group_name')!r}) is still "
                           f"running; wait for it to finish or fail (GET /health shows it)")
        if "timeout_s" in inspect.signature(fn).parameters:
            kwargs = {"timeout_s": self.timeout_s, **kwargs}
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run() -> None:
            try:
                wait_for_listener(kwargs["master_address"], kwargs["master_port"], self.connect_timeout_s)
                result, error = fn(**kwargs), None
            except BaseException as e:  # noqa: BLE001 - handed to the waiting handler
                result, error = None, e
            try:
                loop.call_soon_threadsafe(lambda: future.done() or (
                    future.set_exception(error) if error else future.set_result(result)))
            except RuntimeError:  # the server shut down meanwhile: nobody waits for the answer
                pass

        name = kwargs.get("group_name")
        self.state = {"state": "joining", "group_name": name, "since": time.time()}
        self._thread = threading.Thread(target=run, name="miles-group-join", daemon=True)
        self._thread.start()
        self._waiting.add(future)
        try:
            result = await asyncio.wait_for(asyncio.shield(future),
                                            self.connect_timeout_s + self.timeout_s + 5.0)
        except asyncio.TimeoutError:
            self.state = {"state": "failed", "group_name": name,
                          "message": f"no answer from the group's peers within {self.timeout_s:.0f} s"}
            raise TimeoutError(self.state["message"]) from None
        except Exception as e:
            self.state = {"state": "failed", "group_name": name,
                          "message": f"{type(e).__name__}: {str(e)[:300]}"}
            raise
        finally:
            self._waiting.discard(future)
        self.state = {"state": "ready", "group_name": name}
        return result
