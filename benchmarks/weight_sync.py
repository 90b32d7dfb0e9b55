"""Weight-sync transports against the raw primitive each one is built on, measured in one run.

A trainer (this process) holds a random Qwen2-shaped model of about ``--mb`` MiB; a torch engine
runs in another process (``miles_wire.testing.EngineProcess``: every engine method over a pipe, as
``miles serve`` would take it over HTTP). After two warm-up syncs (segments, groups and page
faults of a first sync are not steady-state costs), rounds of one raw primitive run and one sync
per setting alternate ``--repeat`` times (load from other processes then hits both alike); the
best time of each is kept, and the ratio is the setting's GB/s over the raw primitive's GB/s on
the same bytes in the same rounds. The raw primitives:

* tensor: one memcpy of the bytes into a (warm) shared memory segment; on CUDA a device copy
  (what the engine's copy out of a CUDA IPC handle costs);
* broadcast: one torch.distributed broadcast of the bytes to another process, until that
  process has them (gloo on CPU; NCCL between two GPUs with --device cuda);
* disk: writing the bytes to a file (fsync, as the transport does) and reading them back;
* p2p: one NIXL write of the bytes from a registered buffer of this process into the
  destinations a ``miles serve`` engine registered for them (the transport's own endpoint,
  ``/p2p/open``), in one transfer. The p2p transport syncs through that server and the ``sglang``
  client (HTTP), so a broadcast through the same server is timed in the same rounds and the
  p2p/broadcast time ratio is printed.

    python benchmarks/weight_sync.py [--mb 256] [--repeat 5] [--device cpu|cuda]
        [--shape qwen2-0.5b] [--dtype bfloat16]

``--shape qwen2-0.5b`` replaces the ``--mb`` model with Qwen2-0.5B's shape (494M parameters,
tied embeddings: 290 tensors); ``--dtype`` is the dtype of trainer and engine weights.

The last line reads ``weight_sync ratios vs raw: tensor R broadcast R disk R p2p R`` (transport
GB/s over raw GB/s, default settings; ``--only`` adds p2p, which needs ``nixl-cu12``). Rows in
brackets are the other settings, for comparison.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def _spec(mb: int, shape: str | None, quick: bool = False):
    from miles.testing import TinySpec

    if quick:  # hidden 256, 2 layers: about 4 MiB in float32
        return TinySpec(hidden=256, layers=2, heads=8, kv_heads=2, seed=1)
    if shape == "qwen2-0.5b":
        return TinySpec(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, seed=1)
    # hidden 1024 (32 heads, 8 kv heads): one layer is ~26 MiB of float32, in 9 tensors
    return TinySpec(hidden=1024, layers=max(1, round(mb / 26)), heads=32, kv_heads=8, seed=1)


def _sync(dev: str):
    return (lambda: torch.cuda.synchronize()) if dev.startswith("cuda") else (lambda: None)


class RawMemcpy:
    """One copy of the bytes into a warm shared memory segment (CUDA: a device-to-device copy)."""

    def __init__(self, nbytes: int, dev: str):
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
        self.shm = None
        if dev.startswith("cuda"):
            self.dst = torch.empty_like(self.src)
        else:
            from multiprocessing import shared_memory

            self.shm = shared_memory.SharedMemory(create=True, size=nbytes)
            self.dst = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        self.sync = _sync(dev)

    def once(self) -> None:
        self.dst.copy_(self.src)
        self.sync()

    def close(self) -> None:
        del self.dst
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()


def _raw_peer(port: int, nbytes: int, backend: str, dev: str, conn) -> None:
    import miles_wire as W

    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    group = W.new_group(W.open_store("127.0.0.1", port, 2, is_master=False, timeout_s=300),
                        1, 2, "raw", backend, 300)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    done = torch.ones(1, dtype=torch.uint8, device=dev)
    # between rounds this process waits on the pipe, not in a collective: a waiting NCCL kernel
    # spins on its GPU, which the engine under test shares
    while conn.recv():
        W.broadcast(group, buf)
        W.broadcast(group, done, root=1)  # "all bytes are here"


class RawBroadcast:
    """One broadcast of the bytes to another process, until that process has them all."""

    def __init__(self, nbytes: int, dev: str, peer_dev: str):
        import multiprocessing

        import miles_wire as W

        self.W, backend = W, ("nccl" if dev.startswith("cuda") else "gloo")
        store = W.open_store("127.0.0.1", 0, 2, is_master=True, timeout_s=300)
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.peer = ctx.Process(target=_raw_peer, args=(store.port, nbytes, backend, peer_dev, theirs),
                                daemon=True)
        self.peer.start()
        self.group = W.new_group(store, 0, 2, "raw", backend, 300)
        self.buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
        self.done = torch.ones(1, dtype=torch.uint8, device=dev)
        self.sync = _sync(dev)

    def once(self) -> None:
        self.conn.send(True)
        self.W.broadcast(self.group, self.buf)
        self.W.broadcast(self.group, self.done, root=1)
        self.sync()

    def close(self) -> None:
        self.conn.send(False)
        self.peer.join(60)


class RawDisk:
    """Write the bytes to a file (with fsync, as the transport does) and read them back."""

    def __init__(self, nbytes: int, folder: str):
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        self.back = torch.empty_like(self.src)
        self.path = os.path.join(folder, "raw.bin")

    def once(self) -> None:
        with open(self.path, "wb") as f:
            f.write(memoryview(self.src.numpy()))
            f.flush()
            os.fsync(f.fileno())
        with open(self.path, "rb") as f:
            f.readinto(memoryview(self.back.numpy()))

    def close(self) -> None:
        os.unlink(self.path)


class Served:
    """A ``miles serve`` process over the model (exported to a folder) and a ``sglang`` client."""

    def __init__(self, model, tokenizer, dtype: str, folder: str):
        import subprocess
        import sys
        import threading

        from miles import make_plugin_manager

        path = os.path.join(folder, "served")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        self.proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "serve", path, "--port", "0",
                                      f"dtype={dtype}"], stdout=subprocess.PIPE,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
                                     stderr=open(os.path.join(folder, "serve.log"), "w"))
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(300)
        if not line or "listening on" not in line[0]:
            self.proc.kill()
            raise RuntimeError(f"miles serve did not start: see {folder}/serve.log")
        pm = make_plugin_manager()
        cfg = pm.registry("engines")["sglang"].config(urls=[line[0].strip().rsplit(" ", 1)[1]],
                                                      timeout_s=600)
        self.client = pm.create("engines", "sglang", cfg, spec=None, tokenizer=None, seed=0)

    def close(self) -> None:
        self.client.close()
        self.proc.kill()
        self.proc.wait(30)


class RawNixl:
    """One NIXL write of the bytes into the destinations the engine registered for them."""

    def __init__(self, client, weights: list, transport: str = "tcp"):
        import base64

        from miles_plugin_p2p.transport import make_agent

        layout = [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                  for n, t in weights]
        info = client.p2p_open(tensors=layout, transport=transport)[0]
        self.agent = make_agent("miles-bench-raw", transport)
        self.agent.add_remote_agent(base64.b64decode(info["metadata"]))
        self.remote = info["agent"]
        targets = [tuple(t) for t in info["targets"]]
        self.src = torch.randint(0, 255, (sum(t[1] for t in targets),), dtype=torch.uint8)
        self.reg = self.agent.register_memory(self.src)
        offsets = [0]
        for t in targets[:-1]:
            offsets.append(offsets[-1] + t[1])
        self.local = self.agent.get_xfer_descs([(self.src.data_ptr() + o, t[1], 0)
                                                for o, t in zip(offsets, targets)], "DRAM")
        self.dst = self.agent.get_xfer_descs(targets, info["mem_type"])

    def once(self) -> None:
        h = self.agent.initialize_xfer("WRITE", self.local, self.dst, self.remote)
        state = self.agent.transfer(h)
        while state == "PROC":
            state = self.agent.check_xfer_state(h)
        self.agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL write: {state}")

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)


class Sync:
    """Syncs of one transport (a new version each time) to one engine."""

    def __init__(self, name: str, settings: dict, trainer, engine, folder: str):
        from miles import make_plugin_manager

        pm = make_plugin_manager()
        comp = pm.registry("transports")[name]
        self.tr = pm.create("transports", name, comp.config(**settings), out_dir=folder)
        self.trainer, self.engine, self.version = trainer, engine, 0
        self.parts: dict[str, float] = {}  # the sync's own timings (weight_sync_*_seconds), last run

    def once(self) -> None:
        self.version += 1
        m = self.tr.sync(self.trainer, [self.engine], self.version)
        self.parts = {k[12:-8] or "total": v for k, v in m.items()
                      if k.startswith("weight_sync_") and k.endswith("_seconds")}

    def close(self) -> None:
        import miles_wire as W

        self.once()
        want = {n: W.checksum(x) for n, x in self.trainer.named_weights()}
        W.verify([self.engine], want, self.version)  # what was timed moved every byte exactly
        if hasattr(self.tr, "close"):
            self.tr.close()


def measure(rows: list[tuple[str, object]], repeat: int, warmups: int = 2) -> dict[str, float]:
    """Best seconds per row, rounds interleaved so that load from other processes hits all rows
    alike. ``warmups`` untimed warm-ups each (connections, segments, first-touch page faults)."""
    for _, item in rows:
        for _ in range(warmups):
            item.once()
    best = {label: float("inf") for label, _ in rows}
    for _ in range(repeat):
        for label, item in rows:
            t0 = time.perf_counter()
            item.once()
            best[label] = min(best[label], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="approximate model size in MiB (float32)")
    ap.add_argument("--repeat", type=int, default=5, help="timed rounds (best is kept per row)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--only", default="tensor,broadcast,disk", help="comma-separated transports "
                    "(tensor, broadcast, disk, p2p)")
    ap.add_argument("--shape", choices=["qwen2-0.5b"], default=None, help="a real model shape instead of --mb")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--quick", action="store_true", help="a 4 MiB model, 1 warm-up, 1 round, CPU (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.repeat, args.device, args.shape = 4, 1, "cpu", None
    torch.set_num_threads(1)
    from miles.testing import char_tokenizer
    from miles_wire.testing import EngineProcess

    spec = _spec(args.mb, args.shape, args.quick)
    cuda = args.device == "cuda"
    dev = "cuda:0" if cuda else "cpu"
    model = spec.build_model(char_tokenizer()).to(dev, getattr(torch, args.dtype))
    # a trainer that keeps its state dict: building one walks 291 modules (~3 ms for the 0.5B
    # shape), the trainer's cost, not the transport's
    weights = list(model.state_dict().items())
    trainer = type("Trainer", (), {"named_weights": lambda self: iter(weights)})()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    other = "cuda:1" if cuda and torch.cuda.device_count() > 1 else dev
    print(f"model: {nbytes / 2**20:.0f} MiB in {len(model.state_dict())} tensors, device {args.device}; "
          f"best of {args.repeat}", flush=True)
    table, ratios, times = [], {}, {}
    folder = tempfile.mkdtemp(prefix="miles-bench-")
    colocated = EngineProcess(settings={"device": dev, "dtype": args.dtype}, spec=spec)
    apart = (EngineProcess(settings={"device": other, "dtype": args.dtype}, spec=spec)
             if other != dev else colocated)
    plans = {  # name: (raw primitive, its label, engine, [(settings, is the default)])
        "tensor": (lambda: RawMemcpy(nbytes, dev), "device copy" if cuda else "memcpy into shm",
                   colocated, [({}, True)] + ([] if cuda else [({"adopt": False}, False)])),
        "broadcast": (lambda: RawBroadcast(nbytes, dev, other), "nccl broadcast" if cuda else
                      "gloo broadcast", apart, [({}, True), ({"pack_mb": 0}, False),
                                                ({"pack_mb": 16 if cuda else 1e6}, False)]),
        "disk": (lambda: RawDisk(nbytes, folder), "file write+fsync+read", apart,
                 [({"dir": os.path.join(folder, "w")}, True)]),
    }
    served = None
    if "p2p" in args.only.split(","):
        if cuda:
            raise SystemExit("--only p2p: CPU engines only (GPU memory registration is not done)")
        # both through one `miles serve` process and the sglang client (HTTP), in the same rounds
        served = Served(model, char_tokenizer(), args.dtype, folder)
        plans["p2p"] = (lambda: RawNixl(served.client, weights), "one NIXL write (UCX tcp)", served.client,
                        [({}, True), ({"via": "broadcast"}, False)])
    try:
        for name in [n for n in plans if n in args.only.split(",")]:
            make_raw, raw_label, engine, variants = plans[name]
            raw = make_raw()
            try:
                for settings, default in variants:
                    # each setting against the raw primitive measured in the same rounds
                    via = settings.get("via", name)
                    label = name if default else (f"[{via} via miles serve]" if via != name
                                                  else f"[{name} {settings}]")
                    sync = Sync(via, {k: v for k, v in settings.items() if k != "via"}, trainer, engine, folder)
                    try:
                        best = measure([("raw", raw), (label, sync)], args.repeat, 1 if args.quick else 2)
                        print(f"  {label}: last sync " + ", ".join(f"{k} {v * 1e3:.1f} ms"
                                                                  for k, v in sync.parts.items()), flush=True)
                    finally:
                        sync.close()
                    raw_gbs, gbs = nbytes / best["raw"] / 1e9, nbytes / best[label] / 1e9
                    table.append((label, gbs, raw_gbs, gbs / raw_gbs))
                    if default:
                        ratios[name] = gbs / raw_gbs
                    times[label] = best[label]
            finally:
                raw.close()
            table.append((f"  (raw: {raw_label})", None, None, None))
    finally:
        colocated.close()
        if apart is not colocated:
            apart.close()
        if served is not None:
            served.close()
    print(f"{'':36s} {'GB/s':>8s} {'raw GB/s':>9s} {'vs raw':>7s}")
    for label, gbs, raw_gbs, ratio in table:
        if gbs is None:
            print(label)
        else:
            print(f"{label:36s} {gbs:8.2f} {raw_gbs:9.2f} {ratio:7.2f}")
    if "p2p" in times:
        other = times["[broadcast via miles serve]"]
        print(f"p2p / broadcast time through one miles serve: {times['p2p'] / other:.2f} "
              f"({times['p2p'] * 1e3:.0f} ms / {other * 1e3:.0f} ms)")
    print("weight_sync ratios vs raw: " + " ".join(f"{n} {r:.2f}" for n, r in ratios.items()))


if __name__ == "__main__":
    main()
