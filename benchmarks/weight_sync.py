"""Weight-sync transports against the raw primitive each one is built on, measured in one run.

A trainer (this process) holds a random Qwen2-shaped model of about ``--mb`` MiB; a torch engine
runs in another process (``miles.testing.EngineProcess``: every engine method over a pipe, as
``miles serve`` would take it over HTTP). Each transport syncs it ``--repeat`` times after a
warm-up sync (segments, groups and page faults of a first sync are not steady-state costs); the
best time is compared with the best time of its raw primitive on the same bytes:

* tensor: one memcpy of the bytes into a (warm) shared memory segment; on CUDA a device copy
  (what the engine's copy out of a CUDA IPC handle costs);
* broadcast: one torch.distributed broadcast of the bytes to another process, until that
  process has them (gloo on CPU; NCCL between two GPUs with --device cuda);
* disk: writing the bytes to a file (fsync, as the transport does) and reading them back.

    python benchmarks/weight_sync.py [--mb 256] [--repeat 3] [--device cpu|cuda]

The last line reads ``weight_sync ratios vs raw: tensor R broadcast R disk R`` (transport GB/s
over raw GB/s, default settings). Rows in brackets are the other settings, for comparison.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def _spec(mb: int):
    from miles.testing import TinySpec

    # hidden 1024 (32 heads, 8 kv heads): one layer is ~26 MiB of float32, in 9 tensors
    return TinySpec(hidden=1024, layers=max(1, round(mb / 26)), heads=32, kv_heads=8, seed=1)


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _sync(dev: str):
    return (lambda: torch.cuda.synchronize()) if dev.startswith("cuda") else (lambda: None)


def raw_memcpy(nbytes: int, dev: str, repeat: int) -> float:
    sync = _sync(dev)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    if dev.startswith("cuda"):
        dst = torch.empty_like(src)
        return _best(lambda: (dst.copy_(src), sync()), repeat + 1)
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    try:
        dst = torch.frombuffer(shm.buf, dtype=torch.uint8)
        dst.copy_(src)  # first touch allocates the pages: not part of a steady-state copy
        t = _best(lambda: dst.copy_(src), repeat + 1)
        del dst
    finally:
        shm.close()
        shm.unlink()
    return t


def _raw_peer(port: int, nbytes: int, repeat: int, backend: str, dev: str) -> None:
    from miles import weights as W

    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    store = W.open_store("127.0.0.1", port, 2, is_master=False, timeout_s=300)
    group = W.new_group(store, 1, 2, "raw", backend, 300)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    ack = torch.zeros(1, dtype=torch.uint8, device=dev)
    for _ in range(repeat + 1):
        W.broadcast(group, buf)
        W.broadcast(group, ack, root=1)  # "all bytes are here"


def raw_broadcast(nbytes: int, dev: str, peer_dev: str, repeat: int) -> float:
    import multiprocessing

    from miles import weights as W

    backend = "nccl" if dev.startswith("cuda") else "gloo"
    store = W.open_store("127.0.0.1", 0, 2, is_master=True, timeout_s=300)
    peer = multiprocessing.get_context("spawn").Process(
        target=_raw_peer, args=(store.port, nbytes, repeat, backend, peer_dev), daemon=True)
    peer.start()
    group = W.new_group(store, 0, 2, "raw", backend, 300)
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    ack = torch.zeros(1, dtype=torch.uint8, device=dev)
    sync = _sync(dev)

    def once():
        W.broadcast(group, buf)
        W.broadcast(group, ack, root=1)
        sync()

    once()  # connection set-up and first-touch of the peer's buffer
    t = _best(once, repeat)
    peer.join(60)
    return t


def raw_disk(nbytes: int, folder: str, repeat: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    back = torch.empty_like(src)
    path = os.path.join(folder, "raw.bin")

    def once():
        with open(path, "wb") as f:
            f.write(memoryview(src.numpy()))
            f.flush()
            os.fsync(f.fileno())
        with open(path, "rb") as f:
            f.readinto(memoryview(back.numpy()))

    once()
    t = _best(once, repeat)
    os.unlink(path)
    return t


def transport(name: str, settings: dict, trainer, engine, repeat: int, folder: str) -> float:
    from miles import make_plugin_manager
    from miles import weights as W

    pm = make_plugin_manager()
    comp = pm.registry("transports")[name]
    tr = pm.create("transports", name, comp.config(**settings), out_dir=folder)
    version = [0]

    def once():
        version[0] += 1
        tr.sync(trainer, [engine], version[0])

    once()  # connect / create segments / first touch
    once()  # tensor with adopt alternates two segment sets: the second is new too
    t = _best(once, repeat)
    want = {n: W.checksum(x) for n, x in trainer.named_weights()}
    W.verify([engine], want, version[0])  # what was timed moved every byte exactly
    if hasattr(tr, "close"):
        tr.close()
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="approximate model size in MiB (float32)")
    ap.add_argument("--repeat", type=int, default=3, help="timed syncs per row (best is kept)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--only", default="tensor,broadcast,disk", help="comma-separated transports")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from miles.testing import EngineProcess, char_tokenizer

    spec = _spec(args.mb)
    cuda = args.device == "cuda"
    dev = "cuda:0" if cuda else "cpu"
    model = spec.build_model(char_tokenizer()).to(dev)
    trainer = type("Trainer", (), {"named_weights": lambda self: iter(model.state_dict().items())})()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    other = "cuda:1" if cuda and torch.cuda.device_count() > 1 else dev
    only = args.only.split(",")
    print(f"model: {nbytes / 2**20:.0f} MiB in {len(model.state_dict())} tensors, device {args.device}; "
          f"best of {args.repeat}", flush=True)
    rows, ratios = [], {}
    folder = tempfile.mkdtemp(prefix="miles-bench-")
    colocated = EngineProcess(settings={"device": dev}, spec=spec)
    apart = EngineProcess(settings={"device": other}, spec=spec) if other != dev else colocated
    try:
        plans = {
            "tensor": (lambda: raw_memcpy(nbytes, dev, args.repeat), "memcpy into shm" if not cuda
                       else "device copy", colocated,
                       [({}, True)] + ([({"adopt": False}, False)] if not cuda else [])),
            "broadcast": (lambda: raw_broadcast(nbytes, dev, other, args.repeat),
                          "nccl broadcast" if cuda else "gloo broadcast", apart,
                          [({}, True), ({"pack_mb": 0}, False), ({"pack_mb": 1e6}, False)]),
            "disk": (lambda: raw_disk(nbytes, folder, args.repeat), "file write+fsync+read", apart,
                     [({"dir": os.path.join(folder, "w")}, True)]),
        }
        for name in [n for n in plans if n in only]:
            raw_fn, raw_name, engine, variants = plans[name]
            raw = nbytes / raw_fn() / 1e9
            rows.append((f"raw: {raw_name}", raw, None))
            for settings, default in variants:
                gbs = nbytes / transport(name, settings, trainer, engine, args.repeat, folder) / 1e9
                label = f"{name} {settings}" if settings and not default else name
                rows.append((label if default else f"[{label}]", gbs, gbs / raw))
                if default:
                    ratios[name] = gbs / raw
    finally:
        colocated.close()
        if apart is not colocated:
            apart.close()
    print(f"{'':40s} {'GB/s':>8s} {'vs raw':>7s}")
    for label, gbs, ratio in rows:
        print(f"{label:40s} {gbs:8.2f} {'' if ratio is None else f'{ratio:7.2f}'}")
    print("weight_sync ratios vs raw: " + " ".join(f"{n} {r:.2f}" for n, r in ratios.items()))


if __name__ == "__main__":
    main()
