"""Receiving side of the ``p2p`` weight-sync transport: the trainer writes weights straight into
this engine's memory through a NIXL agent (UCX underneath: TCP, shared memory or RDMA).

Two calls, exposed by ``miles serve`` as ``POST /p2p/open`` and ``POST /p2p/commit``:

* ``p2p_open(tensors=[{"name", "dtype", "shape"}, ...], transport)`` registers a destination for
  every tensor the trainer will send and answers ``{"agent", "metadata" (base64 NIXL agent
  metadata), "session", "targets": [[address, bytes, device_id], ...] (one per tensor, in
  order), "mem_type" ("DRAM", or "VRAM" for an engine on a GPU), "direct"}``. A parameter that
  is contiguous, on the engine's device and of the wire's dtype and shape is its own destination
  (the bytes land in the model); any other tensor gets a slot in a registered staging buffer on
  that device.
* ``p2p_commit(weight_version, sessions)`` copies the staged tensors into their parameters and
  sets the weight version, when this engine's session is among ``sessions``; answers
  ``{"committed": bool, "weight_version"}`` (``"moved": true`` when a parameter moved since it
  was published: the trainer then opens afresh and writes again).

The same layout opened again (every sync after the first) answers the same registration, as
long as no parameter moved meanwhile (another transport may have re-pointed one). NIXL is
imported only when ``p2p_open`` is first called.
"""
from __future__ import annotations

import base64
import os
import secrets
from typing import Any, Sequence

import miles_wire as W
import torch
from miles import MilesError

# UCX transport lists per ``transport.transport``: tcp works on any host; rdma asks for verbs
# transports (and GPU copies) and fails where no RDMA device exists
UCX_TLS = {"tcp": "tcp,self", "rdma": "rc,ud,self,sm,cuda_copy,cuda_ipc", "auto": None}


class P2PState:
    """What the ``p2p`` transport keeps on one engine between calls (``TorchEngine.p2p_state``)."""

    def __init__(self):
        self.agent: Any = None
        self.name = ""
        self.transport = ""
        self.key: tuple | None = None  # the open layout: (names, dtypes, shapes)
        self.answer: dict | None = None
        self.regs: list = []  # NIXL registrations of the open layout
        self.pinned: list[tuple[torch.Tensor, int]] = []  # (direct destination, its data_ptr)
        self.staged: list[tuple[str, torch.Tensor]] = []  # (name, view of the staging buffer)
        self.staging: torch.Tensor | None = None
        self.session = ""
        self.kept: list[torch.Tensor] = []


def make_agent(name: str, transport: str, cuda: bool = False) -> Any:
    """A NIXL agent with the UCX backend, restricted to ``transport``'s UCX transports (UCX reads
    ``UCX_TLS`` when the agent is made); ``cuda``: GPU memory is registered too (UCX stages it
    through ``cuda_copy``)."""
    if transport not in UCX_TLS:
        raise MilesError(f"transport.transport: {transport!r} is not one of {', '.join(UCX_TLS)}")
    tls = UCX_TLS[transport]
    if tls:
        os.environ["UCX_TLS"] = tls + (",cuda_copy" if cuda and "cuda_copy" not in tls else "")
    api = _nixl()
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _nixl() -> Any:
    """NIXL's Python API: the CUDA 12 wheel, the CUDA 13 one, or the ``nixl`` meta-package."""
    import importlib

    for module in ("nixl_cu12", "nixl_cu13", "nixl._api"):
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    raise MilesError("transport.name=p2p needs NIXL: pip install 'nixl-cu12>=1.5.1,<1.6' (nixl-cu13 on "
                     "CUDA 13 hosts), or pip install -e plugins/transports/p2p")


def p2p_open(engine: Any, tensors: Sequence[dict], transport: str = "tcp") -> dict:
    """Register destinations for ``tensors`` (see the module docstring)."""
    _check_tensors(tensors)
    st = engine.p2p_state()
    dev = engine._param_device()  # CPU memory, or the GPU the parameters live on
    if st.agent is None:
        st.name = f"miles-engine-{os.getpid()}-{secrets.token_hex(4)}"
        st.agent = make_agent(st.name, transport, cuda=dev.type == "cuda")
        st.transport = transport
    elif transport != st.transport:
        raise MilesError(f"torch engine: p2p transport {transport!r} asked, but this engine's agent "
                         f"uses {st.transport!r} (restart the engine to change transport.transport)")
    names = [str(t["name"]) for t in tensors]
    dtypes = [str(t["dtype"]).removeprefix("torch.") for t in tensors]
    shapes = [tuple(int(d) for d in t["shape"]) for t in tensors]
    key = (tuple(names), tuple(dtypes), tuple(shapes))
    if key == st.key and all(p.data_ptr() == ptr for p, ptr in st.pinned):
        return st.answer
    _release(st)
    direct, staged_i = [], []
    targets: dict[str, torch.Tensor] = engine._targets
    adopted = engine._ws.adopted
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
        dst = targets.get(name)
        if dst is None:
            raise MilesError(f"torch engine: the model has no parameter or buffer named {name!r}")
        if tuple(dst.shape) != shape:
            raise MilesError(f"torch engine: {name!r} has shape {tuple(dst.shape)}, got {shape}")
        ok = (dst.dtype == W.to_dtype(dtype) and dst.is_contiguous() and dst.device == dev
              and dst.numel() > 0 and id(dst) not in adopted)
        (direct if ok else staged_i).append(i)
    slots: list[list[int]] = [[0, 0, 0] for _ in names]
    index = (dev.index or 0) if dev.type == "cuda" else 0  # NIXL's device id (0 for host memory)
    seen: dict[int, torch.Tensor] = {}
    for i in direct:
        dst = targets[names[i]].data
        seen.setdefault(dst.data_ptr(), dst)  # tied names share one parameter: registered once
        slots[i] = [dst.data_ptr(), W.nbytes(dst), index]
    st.pinned = [(targets[names[i]], targets[names[i]].data_ptr()) for i in direct]
    regions = list(seen.values())
    if staged_i:
        offsets, size = W.layout([dtypes[i] for i in staged_i], [shapes[i] for i in staged_i])
        st.staging = torch.empty(max(size, 1), dtype=torch.uint8, device=dev)
        views = W.views(st.staging, [dtypes[i] for i in staged_i], [shapes[i] for i in staged_i], offsets)
        st.staged = [(names[i], v) for i, v in zip(staged_i, views)]
        for i, off, v in zip(staged_i, offsets, views):
            slots[i] = [st.staging.data_ptr() + off, W.nbytes(v), index]
        regions.append(st.staging)
    st.regs = [st.agent.register_memory(regions)] if regions else []
    st.kept = regions  # registered memory stays allocated while registered, even if a parameter moves
    st.key, st.session = key, secrets.token_hex(8)
    st.answer = {"agent": st.name, "metadata": base64.b64encode(st.agent.get_agent_metadata()).decode(),
                 "session": st.session, "targets": slots, "direct": len(direct),
                 "mem_type": "VRAM" if dev.type == "cuda" else "DRAM"}
    return st.answer


@torch.no_grad()
def p2p_commit(engine: Any, weight_version: Any = None, sessions: Sequence[str] | None = None) -> dict:
    """Copy staged tensors in and take ``weight_version``, if this engine took part (its session
    is in ``sessions``; None: whatever is open)."""
    if weight_version is not None and not (isinstance(weight_version, int) and not isinstance(weight_version, bool)
                                           or isinstance(weight_version, str) and weight_version.isdigit()):
        raise ValueError(f"weight_version: {str(weight_version)[:50]!r} is not a version number")
    if sessions is not None and not (isinstance(sessions, list) and all(isinstance(s, str) for s in sessions)):
        raise ValueError("sessions: give the list of session ids /p2p/open answered")
    st = engine.p2p_state()
    if st.key is None and sessions is None:
        raise ValueError("nothing to commit: no p2p session is open on this engine (POST /p2p/open first)")
    if st.key is None or (sessions is not None and st.session not in sessions):
        return {"committed": False, "weight_version": engine.weight_version}
    if not all(p.data_ptr() == ptr for p, ptr in st.pinned):
        # another transport re-pointed a parameter since it was published: the bytes went to
        # its old memory; the trainer opens afresh and writes again
        _release(st)
        return {"committed": False, "moved": True, "weight_version": engine.weight_version}
    if st.staged:
        engine._assign_all(st.staged)
    engine._set_version(weight_version)
    return {"committed": True, "weight_version": engine.weight_version}


def _check_tensors(tensors: Any) -> None:
    """ValueError naming the first entry of ``tensors`` that is not ``{"name", "dtype", "shape"}``."""
    if not isinstance(tensors, list) or not tensors:
        raise ValueError('tensors: give a non-empty list of {"name", "dtype", "shape"}')
    for i, t in enumerate(tensors):
        shape = t.get("shape") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)
                and isinstance(shape, list) and all(isinstance(d, int) and 0 <= d < 2**40 for d in shape)):
            raise ValueError(f'tensors[{i}]: give {{"name": str, "dtype": str, "shape": [int, ...]}}')
        try:
            W.to_dtype(t["dtype"].removeprefix("torch."))
        except Exception:  # noqa: BLE001 - any unknown dtype name
            raise ValueError(f"tensors[{i}].dtype: {t['dtype'][:40]!r} is not a tensor dtype") from None


def _release(st: P2PState) -> None:
    for reg in st.regs:
        try:
            st.agent.deregister_memory(reg)
        except Exception:  # noqa: BLE001 - memory a failed open left half-registered
            pass
    st.regs, st.pinned, st.staged, st.staging, st.key, st.answer, st.kept = [], [], [], None, None, None, []


def mount_p2p_routes(app: Any, engine: Any, scheduler: Any) -> None:
    """``POST /p2p/open`` and ``POST /p2p/commit`` on ``miles serve``, run on the engine thread."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from .engine import TorchEngine
    from .server import json_body

    def route(fn: Any):
        async def handler(request: Request):
            if not isinstance(engine, TorchEngine):
                return JSONResponse({"success": False, "message": "this engine does not receive p2p "
                                     "weight transfers (the torch engine does)"}, status_code=400)
            try:
                body = await json_body(request)
                result = await scheduler.call(lambda: fn(engine, **body))
            except (ValueError, TypeError, MilesError) as e:
                return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}"}, status_code=400)
            return {"success": True, "message": "ok", **result}

        handler.__annotations__["request"] = Request  # a class, not this module's string annotation
        return handler

    app.post("/p2p/open")(route(p2p_open))
    app.post("/p2p/commit")(route(p2p_commit))
