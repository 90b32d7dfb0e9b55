"""Place a run on a Ray cluster: engine actors (``miles serve``) and trainer actors (``miles train``,
torchrun-style env), the trainers starting while the engines boot; watch them, and stop them all on
success, failure or Ctrl-C/SIGTERM, with the Ray instance this run started."""
from __future__ import annotations

import copy
import gc
import json
import os
import secrets
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml
from miles import MilesError

from .config import RayLauncherConfig

POLL_S = 0.2


class RayLauncher:
    def __init__(self, cfg: RayLauncherConfig):
        self.cfg = cfg
        self.trainers: list[Any] = []
        self.engines: list[Any] = []
        self.stop_signal: int | None = None
        self.restarting: set[str] = set()  # names of actors Ray is restarting
        self.cursors: dict[str, tuple] = {}  # per actor: (incarnation, events read, lines read)
        self.urls: list[str] = []  # the engines' current addresses
        self.urls_file: str | None = None
        self.api_key = secrets.token_urlsafe(24)  # the engines' key for this run only

    def launch(self, config: Any, pm: Any, plugins: list[str]) -> int:
        import ray

        run_dir = Path(config.run.out_dir).resolve()
        launch_dir = run_dir / "launch"
        launch_dir.mkdir(parents=True, exist_ok=True)
        model_dir = launch_dir / "engine_model"
        if self.cfg.engines and not (model_dir / "config.json").is_file():
            from miles.loop import initial_model

            initial_model(pm, config, str(model_dir))
        trainer_raw = self.trainer_config(config.raw, plugins)
        previous = {s: signal.signal(s, lambda signum, _f: setattr(self, "stop_signal", signum))
                    for s in (signal.SIGINT, signal.SIGTERM)}
        self._connect(ray, launch_dir)
        pg = None
        try:
            pg = self._place(ray)
            self.urls = self._start_engines(ray, pg, config, model_dir, run_dir)
            if self.urls:  # a restarted engine may come back at another address: ranks follow the file
                self.urls_file = str(launch_dir / "engine_urls.json")
                # ranks start while the engines boot: their engine client waits as long as this launcher
                trainer_raw["engine"] = {"name": "sglang", "urls": self.urls, "urls_file": self.urls_file,
                                         "startup_timeout_s": self.cfg.startup_timeout_s}
            self._start_trainers(ray, pg, trainer_raw, launch_dir / "trainer.yaml", run_dir)
            self._await_engines(ray, run_dir)
            self._supervise(ray)
            return 0
        except KeyboardInterrupt:
            name = signal.Signals(self.stop_signal or signal.SIGINT).name
            clean = self._interrupt_trainers(ray)
            how = "trainers checkpointed and stopped" if clean else "trainers were killed after the grace period"
            print(f"miles: {name}: {how}; rerun the same command to resume from {run_dir}", file=sys.stderr)
            return 128 + (self.stop_signal or signal.SIGINT)
        finally:
            self._stop_all(ray, pg)
            for s, h in previous.items():
                signal.signal(s, h)
            # `miles train` exits next: Python's final garbage collections would walk every object of
            # torch and transformers (seconds); frozen objects are skipped, as they stay until exit
            gc.freeze()

    # -- cluster -----------------------------------------------------------------------------------
    def _connect(self, ray: Any, launch_dir: Path) -> None:
        """Join ``address`` or start a local instance (stopped by ``ray.shutdown()`` at the end), then
        say where it is: on the console and in ``launch/ray.json``."""
        c = self.cfg
        kw: dict[str, Any] = {"namespace": f"miles-{uuid.uuid4().hex[:8]}", "log_to_driver": False,
                              "configure_logging": False}
        try:
            if c.address is None:
                # the dashboard's modules may start slowly on a busy machine: give them the run's
                # start-up time rather than Ray's 30 s (a user's setting wins)
                os.environ.setdefault("RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT",
                                      str(max(30.0, c.startup_timeout_s)))
                # "local": a new instance even where RAY_ADDRESS or a `ray start` on this machine names
                # another; include_dashboard None starts the dashboard without failing the run if it
                # cannot (its state is checked below)
                ctx = ray.init(address="local", num_cpus=c.num_cpus, num_gpus=c.num_gpus,
                               include_dashboard=None if c.dashboard else False,
                               dashboard_host="127.0.0.1", **kw)
            else:
                ctx = ray.init(address=c.address, **kw)
        except (ConnectionError, RuntimeError, ValueError) as e:
            where = f"the Ray cluster at {c.address!r} (launcher.address)" if c.address else "a local Ray instance"
            raise MilesError(f"could not start or join {where}: {e}") from None
        gcs = ctx.address_info.get("gcs_address") or ray.get_runtime_context().gcs_address
        dashboard = self._await_state_api() if c.dashboard or c.address is not None else None
        record_ray(launch_dir / "ray.json", gcs, dashboard, kw["namespace"], started=c.address is None)

    def _await_state_api(self) -> str | None:
        """The dashboard's URL once Ray's state API (`ray list actors`) answers through it, or None,
        with a warning, when it does not within launcher.startup_timeout_s (a few seconds on a joined
        cluster, whose dashboard is up or off already): the run goes on without it."""
        from ray._private import ray_constants
        from ray.experimental import internal_kv
        from ray.util.state import list_actors

        wait = self.cfg.startup_timeout_s if self.cfg.address is None else min(10.0, self.cfg.startup_timeout_s)
        deadline, error = time.monotonic() + wait, "it published no address"
        while True:
            # where Ray itself looks the dashboard up (the dashboard writes it once it serves)
            raw = internal_kv._internal_kv_get(ray_constants.DASHBOARD_ADDRESS,
                                               namespace=ray_constants.KV_NAMESPACE_DASHBOARD)
            if raw:
                url = f"http://{raw.decode()}"
                try:
                    list_actors(address=url, limit=1, timeout=10, raise_on_missing_output=False)
                    return url
                except Exception as e:  # noqa: BLE001 (any failure of the state API means: not yet)
                    error = f"{url}: {_first_line(e)}"
            elif self.cfg.address is not None:
                break  # a joined cluster without a dashboard: waiting brings none
            if time.monotonic() > deadline:
                break
            time.sleep(1.0)
        print(f"miles: warning: Ray's dashboard did not answer ({error}): `ray list actors` and the web "
              f"UI are unavailable for this run, which goes on", file=sys.stderr, flush=True)
        return None

    def bundles(self) -> list[dict[str, float]]:
        c = self.cfg
        strip = lambda r: {k: float(v) for k, v in r.items() if v > 0}  # noqa: E731
        return [strip(c.resources.trainer)] * c.trainer_ranks + [strip(c.resources.engine)] * c.engines

    def _place(self, ray: Any) -> Any:
        """One placement group for the run (PACK or SPREAD); fail fast when the cluster lacks a
        resource the actors ask for."""
        from ray.util.placement_group import placement_group

        bundles = self.bundles()
        have = ray.cluster_resources()
        need: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0.0) + v
        short = {k: v for k, v in need.items() if have.get(k, 0.0) < v}
        if short:
            raise MilesError(f"the Ray cluster has {_fmt(have, short)} but the run's actors need {_fmt(need, short)} "
                             f"(launcher.resources x launcher.trainer_ranks/engines); lower them or add nodes")
        strategy = "PACK" if self.cfg.placement == "colocated" else "SPREAD"
        pg = placement_group(bundles, strategy=strategy, name="miles-run")
        ready, _ = ray.wait([pg.ready()], timeout=self.cfg.startup_timeout_s)
        if not ready:
            raise MilesError(f"Ray could not place the run's actors ({bundles}, {strategy}) within "
                             f"{self.cfg.startup_timeout_s:.0f} s (launcher.startup_timeout_s)")
        return pg

    def _options(self, pg: Any, index: int, resources: dict[str, float], name: str, **kw: Any) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        custom = {k: float(v) for k, v in resources.items() if k not in ("CPU", "GPU", "memory") and v > 0}
        return dict(name=name, num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
                    memory=resources.get("memory") or None, resources=custom or None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=index), **kw)

    # -- engines -----------------------------------------------------------------------------------
    def _start_engines(self, ray: Any, pg: Any, config: Any, model_dir: Path, run_dir: Path) -> list[str]:
        from miles_procs import unused_port

        from .actors import EngineActor

        c = self.cfg
        if c.engines == 0:
            return []
        settings = dict(config.raw.get("engine") or {})
        if settings.pop("name", "torch") != "torch":
            raise MilesError("launcher.engines > 0 starts `miles serve` engines (the torch engine); set "
                             "engine.name: torch, or point engine.name: sglang at your own servers with "
                             "launcher.engines: 0")
        if c.resources.engine.get("GPU", 0) > 0:
            settings["device"] = "cuda"  # Ray sets the actor's CUDA_VISIBLE_DEVICES
        serve_args = [f"{k}={_flat(v)}" for k, v in settings.items()]
        # engines on other nodes unpack this copy; on this node (or shared disk) they read model_dir
        files = [ray.put(_read_tree(model_dir))] if _node_count(ray) > 1 else [None]
        env = {"MILES_LAUNCHED": "1", **_threads()}
        for i in range(c.engines):
            opts = self._options(pg, c.trainer_ranks + i, c.resources.engine, f"miles-engine-{i}",
                                 max_restarts=c.max_engine_restarts)
            self.engines.append(EngineActor.options(**opts).remote(
                i, str(model_dir), files, serve_args, unused_port(""), env, os.getcwd(), str(run_dir / "logs"),
                c.max_engine_restarts, self.api_key))
        return self._call(ray, self.engines, "address", "engine", timeout=c.startup_timeout_s)

    def _await_engines(self, ray: Any, run_dir: Path) -> None:
        """Block until every engine's server answers; fail fast if one dies or a trainer fails."""
        timeout = self.cfg.startup_timeout_s
        deadline = time.monotonic() + timeout
        while self.engines:
            self._check_all(ray)
            if all(self._call(ray, self.engines, "healthy", "engine", timeout=timeout)):
                return
            if time.monotonic() > deadline:
                raise MilesError(f"engine(s) at {', '.join(self.urls)} did not become healthy within "
                                 f"{timeout:.0f} s (launcher.startup_timeout_s); see "
                                 f"{run_dir / 'logs'} on their nodes")
            time.sleep(POLL_S)

    # -- trainers ----------------------------------------------------------------------------------
    def trainer_config(self, raw: dict, plugins: list[str]) -> dict:
        """The run's config as trainer ranks see it: no launcher (engines are set once placed)."""
        out = copy.deepcopy(raw)
        out.pop("launcher", None)
        if self.cfg.resources.trainer.get("GPU", 0) > 0:
            out.setdefault("trainer", {})["device"] = "cuda"
        if plugins:
            out["plugins"] = [str(Path(p).resolve()) if Path(p).exists() else p for p in plugins]
        return out

    def _start_trainers(self, ray: Any, pg: Any, raw: dict, path: Path, run_dir: Path) -> None:
        from .actors import TrainerActor

        c = self.cfg
        text = yaml.safe_dump(raw, sort_keys=False)
        path.write_text(text)
        for r in range(c.trainer_ranks):
            opts = self._options(pg, r, c.resources.trainer, f"miles-trainer-{r}", max_restarts=0)
            self.trainers.append(TrainerActor.options(**opts).remote(r, str(run_dir / "logs")))
        master, port = self._call(ray, self.trainers[:1], "rendezvous", "trainer", timeout=c.startup_timeout_s)[0]
        gpu = c.resources.trainer.get("GPU", 0) > 0
        refs = []
        for r, actor in enumerate(self.trainers):
            env = {"MILES_LAUNCHED": "1", "RANK": str(r), "WORLD_SIZE": str(c.trainer_ranks),
                   "LOCAL_RANK": "0" if gpu else str(r), "MASTER_ADDR": master, "MASTER_PORT": str(port),
                   "MILES_SGLANG_API_KEY": self.api_key,  # read by the sglang client; kept out of the yaml
                   **_threads()}
            refs.append(actor.start.remote(text, str(path), env, os.getcwd(), self.urls, self.urls_file))
        self._get(ray, refs, self.trainers, "trainer", c.startup_timeout_s)

    # -- supervision -------------------------------------------------------------------------------
    def _supervise(self, ray: Any) -> None:
        """Return when every trainer rank has exited 0; raise on the first failure."""
        while not all(st["rc"] == 0 for st in self._check_all(ray)):
            time.sleep(POLL_S)

    def _check_all(self, ray: Any) -> list[dict]:
        """Raise on Ctrl-C/SIGTERM or a failed child; the trainers' statuses otherwise."""
        if self.stop_signal is not None:
            raise KeyboardInterrupt
        self._check_engines(ray)
        states = self._statuses(ray, self.trainers, "trainer")
        for r, st in enumerate(states):
            if st["rc"] not in (None, 0):
                raise MilesError(f"{st['error']} (actor miles-trainer-{r}); rerun the same command to "
                                 f"resume from the last checkpoint")
        return states

    def _check_engines(self, ray: Any) -> None:
        for i, st in enumerate(self._statuses(ray, self.engines, "engine")):
            for event in st["events"]:
                print(f"miles: {event} (actor miles-engine-{i})", file=sys.stderr, flush=True)
            if st.get("new_incarnation"):
                self._follow_engine(ray, i)
            if st["rc"] is not None:
                n = st["restarts"] + 1
                tries = f"; it failed {n} times (launcher.max_engine_restarts)" if n > 1 else ""
                raise MilesError(f"{st['error']} (actor miles-engine-{i}){tries}")

    def _follow_engine(self, ray: Any, i: int) -> None:
        """A restarted engine actor (maybe on another node, or its port taken) serves at its new
        address: every trainer rank's engine client is told through its ``engine.urls_file``."""
        url = self._call(ray, self.engines[i:i + 1], "address", "engine", timeout=self.cfg.startup_timeout_s)[0]
        if not self.urls or url == self.urls[i]:  # still starting: start-up asks for addresses itself
            return
        print(f"miles: engine {i} moved from {self.urls[i]} to {url}", file=sys.stderr, flush=True)
        self.urls[i] = url
        self._get(ray, [t.engine_urls.remote(self.urls, self.urls_file) for t in self.trainers],
                  self.trainers, "trainer", self.cfg.startup_timeout_s)

    def _statuses(self, ray: Any, actors: list[Any], role: str) -> list[dict]:
        """Each actor's status; rank 0's console lines are printed here."""
        out = []
        for i, actor in enumerate(actors):
            st = self._status(ray, actor, role, i)
            for stream, line in st["output"]:
                (sys.stdout if stream == "stdout" else sys.stderr).write(line)
            if st["output"]:
                sys.stdout.flush()
                sys.stderr.flush()
            out.append(st)
        return out

    def _status(self, ray: Any, actor: Any, role: str, i: int, retry: bool = True) -> dict:
        """An actor Ray is restarting reads as alive; one that is gone for good is an error
        naming it (asked twice: a call in flight when the actor died may fail either way)."""
        name = f"miles-{role}-{i}"
        try:
            st = ray.get(actor.status.remote(*self.cursors.get(name, ())), timeout=60)
        except ray.exceptions.ActorUnavailableError:
            if name not in self.restarting:
                self.restarting.add(name)
                print(f"miles: actor {name} is unreachable; waiting while Ray restarts it if it died "
                      f"(launcher.max_engine_restarts)", file=sys.stderr, flush=True)
            return {"rc": None, "events": [], "output": [], "restarts": 0}
        except ray.exceptions.GetTimeoutError:
            raise MilesError(f"actor {name} did not answer within 60 s") from None
        except ray.exceptions.RayActorError as e:
            if retry and role == "engine" and self.cfg.max_engine_restarts:
                time.sleep(1.0)
                return self._status(ray, actor, role, i, retry=False)
            raise MilesError(f"actor {name} died: {_first_line(e)}") from None
        self.restarting.discard(name)
        known = self.cursors.get(name)
        if known and known[0] != st["cursor"][0]:  # a new incarnation: its process was replaced
            print(f"miles: actor {name} died; Ray restarted it (launcher.max_engine_restarts)",
                  file=sys.stderr, flush=True)
            st["new_incarnation"] = True
        self.cursors[name] = st["cursor"]  # acknowledges what this reply carried
        return st

    def _call(self, ray: Any, actors: list[Any], method: str, role: str, timeout: float) -> list[Any]:
        return self._get(ray, [getattr(a, method).remote() for a in actors], actors, role, timeout)

    def _get(self, ray: Any, refs: list[Any], actors: list[Any], role: str, timeout: float) -> list[Any]:
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise MilesError(f"{role} actors did not answer within {timeout:.0f} s "
                             f"(launcher.startup_timeout_s)") from None
        except ray.exceptions.RayError as e:
            raise MilesError(f"a {role} actor failed to start: {_first_line(e)}") from None

    # -- stopping ----------------------------------------------------------------------------------
    def _interrupt_trainers(self, ray: Any) -> bool:
        """Forward SIGTERM to trainer ranks (they checkpoint and exit); True if all exited in time."""
        deadline = time.monotonic() + self.cfg.shutdown_grace_s
        try:
            ray.get([t.interrupt.remote() for t in self.trainers], timeout=30)
            while time.monotonic() < deadline:
                states = self._statuses(ray, self.trainers, "trainer")
                if all(st["rc"] is not None for st in states):
                    return True
                time.sleep(POLL_S)
        except (MilesError, ray.exceptions.RayError):
            pass
        return False

    def _stop_all(self, ray: Any, pg: Any) -> None:
        """Stop every child (trainers first), kill the actors, release the placement group, and
        stop the Ray instance if this run started it."""
        for group, grace in ((self.trainers, 10.0), (self.engines, 5.0)):
            refs = [a.stop.remote(grace) for a in group]
            try:
                ray.get(refs, timeout=grace + 20)
            except ray.exceptions.RayError:
                pass  # a dead actor's child died with it (its death signal)
            for a in group:
                ray.kill(a, no_restart=True)
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pg)
        ray.shutdown()  # a local instance this run started stops with it; a joined cluster is only left


def record_ray(path: Path, gcs: str, dashboard: str | None, namespace: str, started: bool) -> None:
    """Where the run's Ray instance is, for a user's `ray list actors --address ...` or browser:
    printed on the console and kept in the run folder (``launch/ray.json``)."""
    info = {"address": gcs, "dashboard": dashboard, "namespace": namespace, "started_by_run": started}
    path.write_text(json.dumps(info, indent=1) + "\n")
    how = (f"; dashboard {dashboard}; its actors: ray list actors --address {dashboard}" if dashboard
           else "; no dashboard")
    print(f"miles: Ray at {gcs} (namespace {namespace}){how}; recorded in {path}", file=sys.stderr, flush=True)


def _read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _node_count(ray: Any) -> int:
    return sum(1 for n in ray.nodes() if n.get("Alive"))


def _fmt(res: dict[str, float], keys: dict[str, float]) -> str:
    return ", ".join(f"{k}={res.get(k, 0.0):g}" for k in sorted(keys))


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _flat(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _threads() -> dict[str, str]:
    """Children use torch's own thread count, as under the local launcher, unless the driver's
    environment caps it (Ray would otherwise hand every actor OMP_NUM_THREADS=1)."""
    n = os.environ.get("OMP_NUM_THREADS")
    return {"OMP_NUM_THREADS": n} if n else {}
