"""Start engine workers (``miles serve``) and trainer ranks (``miles train``, torchrun-style env),
supervise them, and stop them all on success, failure or Ctrl-C/SIGTERM."""
from __future__ import annotations

import copy
import gc
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from miles import MilesError
from miles_procs import unused_port

from .config import LocalLauncherConfig
from .supervisor import Supervisor


class LocalLauncher:
    def __init__(self, cfg: LocalLauncherConfig):
        self.cfg = cfg

    def launch(self, config: Any, pm: Any, plugins: list[str]) -> int:
        run_dir = Path(config.run.out_dir)
        launch_dir = run_dir / "launch"
        launch_dir.mkdir(parents=True, exist_ok=True)
        sup = Supervisor(run_dir / "logs", self.cfg.max_engine_restarts)
        previous = {s: signal.signal(s, lambda signum, _f: setattr(sup, "stop_signal", signum))
                    for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            urls = self._start_engines(sup, config, pm, launch_dir)
            trainer_yaml = launch_dir / "trainer.yaml"
            trainer_yaml.write_text(yaml.safe_dump(self.trainer_config(config.raw, urls, plugins),
                                                   sort_keys=False))
            # trainers start while the engines boot (both spend seconds importing and building
            # models); their engine client waits for the servers, and so does this launcher
            self._start_trainers(sup, trainer_yaml)
            sup.wait_healthy(urls, self.cfg.startup_timeout_s)
            sup.supervise()
            return 0
        except KeyboardInterrupt:
            name = signal.Signals(sup.stop_signal or signal.SIGINT).name
            clean = sup.interrupt_trainers(self.cfg.shutdown_grace_s)
            how = "trainers checkpointed and stopped" if clean else "trainers were killed after the grace period"
            print(f"miles: {name}: {how}; rerun the same command to resume from {run_dir}", file=sys.stderr)
            return 128 + (sup.stop_signal or signal.SIGINT)
        finally:
            sup.stop_all()
            for s, h in previous.items():
                signal.signal(s, h)
            # `miles train` exits next: Python's final garbage collections would walk every object of
            # torch and transformers (seconds); frozen objects are skipped, as they stay until exit
            gc.freeze()

    # -- engines -----------------------------------------------------------------------------------
    def _start_engines(self, sup: Supervisor, config: Any, pm: Any, launch_dir: Path) -> list[str]:
        c = self.cfg
        if c.engines == 0:
            return []
        model_dir = launch_dir / "engine_model"
        if not model_dir.is_dir():
            from miles.loop import initial_model

            initial_model(pm, config, str(model_dir))
        raw = dict(config.raw.get("engine") or {})
        if raw.pop("name", "torch") != "torch":
            raise MilesError("launcher.engines > 0 starts `miles serve` workers (the torch engine); "
                             "set engine.name: torch, or point engine.name: sglang at your own servers "
                             "with launcher.engines: 0")
        urls = []
        for i in range(c.engines):
            port = unused_port(c.host)
            env = {"MILES_LAUNCHED": "1"}
            settings = dict(raw)
            if c.engine_devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(c.engine_devices[i])
                settings["device"] = "cuda"
            if c.engine_threads:
                env["OMP_NUM_THREADS"] = str(c.engine_threads)
            argv = [sys.executable, "-m", "miles.cli", "serve", str(model_dir), "--port", str(port),
                    "--host", c.host, *(f"{k}={_flat(v)}" for k, v in settings.items())]
            sup.start(f"engine {i}", "engine", argv, env, log=f"engine-{i}.log")
            urls.append(f"http://{c.host}:{port}")
        return urls

    # -- trainers ----------------------------------------------------------------------------------
    def trainer_config(self, raw: dict, urls: list[str], plugins: list[str]) -> dict:
        """The run's config as trainer ranks see it: no launcher, engines replaced by their URLs."""
        out = copy.deepcopy(raw)
        out.pop("launcher", None)
        if urls:  # ranks start before the engines answer: they wait as long as this launcher does
            out["engine"] = {"name": "sglang", "urls": urls, "startup_timeout_s": self.cfg.startup_timeout_s}
        if self.cfg.trainer_devices is not None:
            out.setdefault("trainer", {})["device"] = "cuda"
        if plugins:
            out["plugins"] = list(plugins)
        return out

    def _start_trainers(self, sup: Supervisor, trainer_yaml: Path) -> None:
        c = self.cfg
        master_port = unused_port()
        for r in range(c.trainer_ranks):
            env = {"MILES_LAUNCHED": "1", "RANK": str(r), "WORLD_SIZE": str(c.trainer_ranks),
                   "LOCAL_RANK": "0" if c.trainer_devices is not None else str(r),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
            if c.trainer_devices is not None:  # each rank sees only its own device, as cuda:0
                env["CUDA_VISIBLE_DEVICES"] = str(c.trainer_devices[r])
            argv = [sys.executable, "-m", "miles.cli", "train", str(trainer_yaml)]
            sup.start(f"trainer rank {r}", "trainer", argv, env, log=None if r == 0 else f"trainer-{r}.log")


def _flat(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
