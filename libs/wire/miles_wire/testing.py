"""Test doubles for weight-sync tests: ``EngineProcess``, a registered engine in a child process."""
from __future__ import annotations

from typing import Any

from miles.plugins import make_plugin_manager
from miles.testing import TinySpec


class EngineProcess:
    """A registered engine running in a child process, every method call forwarded over a pipe:
    the test double of a remote engine (``miles serve`` behind an HTTP client) for transport
    tests. ``remote = True`` tells transports not to hand tensors over by reference.

    ``corrupt_after_updates(name)`` makes the child change one value of tensor ``name`` after
    each weight update, to prove that ``transport.verify`` catches a bad engine copy.
    """

    remote = True
    restarts = 0  # a child that dies is not restarted (read by transports at every sync)

    def __init__(self, name: str = "torch", settings: dict | None = None, spec: Any = None, seed: int = 0):
        import multiprocessing
        import threading

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_process_main, daemon=True,
                                 args=(child, name, settings or {}, spec or TinySpec(), seed))
        self._proc.start()
        child.close()
        self._lock = threading.Lock()  # transports may call from several threads
        self._methods, self._attrs = self._call("__ready__")
        # the child's methods as real methods of a class of this proxy's own: the kernel's
        # runtime-checkable protocols look attributes up statically (Python >= 3.12), never
        # through __getattr__
        own = set(vars(EngineProcess))  # close() etc. stay this proxy's
        members = {n: _forward(n) for n in self._methods if n not in own}
        members.update({n: property(lambda self, n=n: self._call("__getattr__", n))
                        for n in self._attrs if n not in own})
        self.__class__ = type("EngineProcess", (EngineProcess,), members)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._conn.send((method, args, kwargs))
            ok, value = self._conn.recv()
        if not ok:
            raise value
        return value

    def __getattr__(self, name: str) -> Any:
        # only what the child's engine has: transports probe engines with hasattr()
        if name in self.__dict__.get("_methods", ()):
            return lambda *args, **kwargs: self._call(name, *args, **kwargs)
        if name in self.__dict__.get("_attrs", ()):
            return self._call("__getattr__", name)
        raise AttributeError(name)

    def corrupt_after_updates(self, name: str | None) -> None:
        self._call("__corrupt__", name)

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


def _forward(name: str) -> Any:
    def method(self: EngineProcess, *args: Any, **kwargs: Any) -> Any:
        return self._call(name, *args, **kwargs)
    method.__name__ = name
    return method


def _engine_process_main(conn: Any, name: str, settings: dict, spec: Any, seed: int) -> None:
    import torch

    torch.set_num_threads(1)
    pm = make_plugin_manager()
    comp = pm.registry("engines")[name]
    cfg = comp.config(**settings) if comp.config else settings
    engine = pm.create("engines", name, cfg, spec=spec, tokenizer=spec.build_tokenizer(), seed=seed)
    corrupt = None
    while (msg := conn.recv()) is not None:
        method, args, kwargs = msg
        try:
            if method == "__ready__":
                public = [n for n in dir(engine) if not n.startswith("_") and n != "remote"]
                value = ([n for n in public if callable(getattr(engine, n))],
                         [n for n in public if not callable(getattr(engine, n))])
            elif method == "__getattr__":
                value = getattr(engine, args[0])
            elif method == "__corrupt__":
                corrupt, value = args[0], None
            else:
                value = getattr(engine, method)(*args, **kwargs)
                if corrupt and method.startswith("update_weights"):
                    with torch.no_grad():
                        dict(engine.model.named_parameters())[corrupt].view(-1)[0] += 1.0
            conn.send((True, value))
        except Exception as e:  # noqa: BLE001 - handed back to the caller
            try:
                conn.send((False, e))
            except Exception:  # noqa: BLE001 - an exception that does not pickle
                conn.send((False, RuntimeError(f"{type(e).__name__}: {e}")))
