"""The post-training loop: tasks -> rollout -> rewards -> filters -> advantages -> train -> sync.

SPMD across trainer ranks (torchrun-style, env ``RANK``/``WORLD_SIZE``): every rank runs this loop;
rank 0 alone owns the engines, rolls out, evaluates, logs and seals checkpoints; the other ranks
receive each step's samples through ``trainer.broadcast_object`` and join every collective call
(train step, log-probs, weight sync, checkpoint writes).
"""
from __future__ import annotations

import gc
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import yaml

import miles.runfolder as runfolder
from miles_telemetry import RunRecorder

from .config import Config
from .errors import EngineRestarted, MilesError
from .plugins import MilesPluginManager
from .protocols import (BuildsBatches, Console, CriticAlgorithm, Distributed, ExactScoring, Exports, ExportsDraft, Mode,
                        OffersTokenizer, Prepares, ReceivesWeights, ScoresBatches, SupportsCritic,
                        SendsPacked, SuppliesSamples, SyncFilter, UsesTokenizer)
from .protocols import EngineStats, Recorder
from .rewardclock import StepShare
from .syncviews import PackedView, SyncView
from .rollouts import ModeContext, RolloutService
from .taskorder import TaskOrder
from .types import Batch, Sample, SamplingParams


@dataclass
class Components:
    """The components of one run, built from the config (``Loop.components``)."""

    env: Any
    spec: Any
    tokenizer: Any
    algorithm: Any
    engine: Any
    transport: Any
    trainer: Any = None


class Interrupted(MilesError):
    """The run stopped on SIGINT/SIGTERM after checkpointing; the message is a one-line summary."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def initial_model(pm: MilesPluginManager, cfg: Config, path: str) -> None:
    """A Hugging Face folder of the run's architecture and tokenizer for the engines a launcher
    starts to boot from; the first weight sync replaces its weights."""
    loop = Loop(pm, cfg)
    loop.build(with_engine=False)
    loop.export(path, why=", which launcher.engines > 0 needs; use launcher.engines: 0")


class Loop:
    """One run (``miles.protocols.RunContext``): builds its components, then ``run()`` trains."""

    components: Components  # made by build()

    def __init__(self, pm: MilesPluginManager, cfg: Config) -> None:
        self.pm, self.cfg = pm, cfg
        self.seed = cfg.run.seed
        self.version = 0
        # the eval metrics of a weight version: a warm start's last evaluation is step 0's
        self._evaluated: tuple[int, dict[str, float]] | None = None
        self.loggers: list[Any] = []
        self.rank = int(os.environ.get("RANK", "0"))
        self.main = self.rank == 0
        self.stop_signal: int | None = None  # set by SIGINT/SIGTERM during run()
        self.mode: Mode | None = None  # run.mode, made by build()
        self.bad_steps = self.nonfinite_total = 0
        self._previous: dict[int, Any] = {}
        self._synced_once = False
        self._resumed_step: int | None = None  # the checkpoint restore() resumed from
        self._reward_share = StepShare(self.console)  # warns once when rewards take most of a step
        t = cfg.run.telemetry  # rank 0 records what miles dashboard shows
        self.recorder: Recorder = RunRecorder(t.enabled and self.main, t.samples, t.max_mb, t.devices_every, self.seed)

    def build(self, with_engine: bool = True) -> Components:
        import torch

        cfg, pm = self.cfg, self.pm
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        torch.manual_seed(self.seed)
        env = pm.create("envs", cfg.name("env"), cfg.settings("env"), seed=self.seed)
        spec = pm.create("model_specs", cfg.name("model"), cfg.settings("model"), pm=pm)
        tokenizer = spec.build_tokenizer(env.tokenizer() if isinstance(env, OffersTokenizer) else None)
        if isinstance(env, UsesTokenizer):  # e.g. prompts dropped over a token length
            env.use_tokenizer(tokenizer)
        algorithm = pm.create("algorithms", cfg.name("algorithm"), cfg.settings("algorithm"))
        if algorithm.needs_critic and not isinstance(algorithm, CriticAlgorithm):
            raise MilesError(f"algorithm {cfg.name('algorithm')!r} sets needs_critic but has no critic_lr and "
                             f"value_loss (miles.protocols.CriticAlgorithm); its plugin must provide them")
        engine = None
        if with_engine and self.main:
            engine = pm.create("engines", cfg.name("engine"), cfg.settings("engine"), spec=spec,
                               tokenizer=tokenizer, seed=self.seed)
        transport = pm.create("transports", cfg.name("transport"), cfg.settings("transport"), out_dir=cfg.run.out_dir)
        self.components = Components(env, spec, tokenizer, algorithm, engine, transport)
        r = cfg.rollout
        stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.params = SamplingParams(r.temperature, r.top_p, r.top_k, r.max_new_tokens, stops)
        self.eval_params = SamplingParams(0.0, 1.0, 0, r.eval_max_new_tokens or r.max_new_tokens, stops)
        self.rollout_component = rollout = pm.create("rollouts", r.name, cfg.rollout_settings,
                                                      out_dir=cfg.run.out_dir)
        self.rollouts = RolloutService(pm, rollout, engine, env, tokenizer, algorithm, self.console,
                                       recorder=self.recorder, reward_budget=r.reward_budget) \
            if engine is not None else None
        self.task_order = order = TaskOrder.for_env(env, self.seed)  # its cursor goes into checkpoints
        ctx = ModeContext(cfg.mode_settings, r, self.rollouts, transport, [engine] if engine is not None else [],
                          order.tasks, self.params, self.seed, algorithm.uses_rollout,
                          isinstance(engine, ReceivesWeights) and bool(engine.remote),
                          version_fn=lambda: self.version, console=self.console, order=order)
        self.mode = pm.create("modes", cfg.run.mode, cfg.mode_settings, ctx=ctx)
        return self.components

    def new_trainer(self, found: Any = None, settings: Any = None, algorithm: Any = None,
                    total_steps: int | None = None) -> Any:
        """A fresh trainer for the run, holding checkpoint ``found`` (``runfolder.latest``'s answer)
        if given. A phase (the warm start) passes its own trainer settings, algorithm and LR span."""
        self.components.trainer = self.pm.create(
            "trainers", self.cfg.name("trainer"), settings or self.cfg.settings("trainer"), spec=self.components.spec,
            tokenizer=self.components.tokenizer, seed=self.seed, algorithm=algorithm or self.components.algorithm,
            total_steps=self.cfg.run.steps if total_steps is None else total_steps,
            draft=self.cfg.raw.get("draft"))  # the draft: section (a trainer that trains a draft reads it)
        if found:
            try:
                self.components.trainer.load(str(found[0] / "trainer"))
            except MilesError:
                raise
            except Exception as e:  # an edited checkpoint (recomputed checksums), or another model's
                raise MilesError(f"checkpoint {found[0]} cannot be loaded by trainer {self.cfg.name('trainer')!r}: "
                                 f"{type(e).__name__}: {e}. It was edited or written for another model: move it "
                                 f"aside to resume from an older one, or pick a new run.out_dir") from e
            self.version = found[1]["weight_version"]
        return self.components.trainer

    def export(self, path: str, why: str = "") -> None:
        """A Hugging Face folder at ``path`` (which must not exist yet) of the trainer's weights, or
        of a freshly initialised model when the run has no trainer (an initial model for engines).
        ``why``: what needs the folder, for the error of a spec that cannot write one."""
        c = self.components
        if not isinstance(c.spec, Exports):
            raise MilesError(f"model spec {self.cfg.name('model')!r} cannot write a Hugging Face folder "
                             f"(miles.protocols.Exports){why}")
        draft = isinstance(c.trainer, ExportsDraft)  # its draft head goes beside the model, not into it
        weights = (c.trainer.model_weights() if draft else c.trainer.named_weights()) if c.trainer is not None \
            else c.spec.build_model(c.tokenizer).state_dict().items()
        if isinstance(c.trainer, SendsPacked) and c.trainer.packed_formats:  # the weights rollout served
            weights = c.trainer.served_weights(weights)
        try:  # one shard: transformers' "Writing model shards" progress bar is noise
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass
        c.spec.save_pretrained(weights, c.tokenizer, path)
        if draft:
            c.trainer.export_draft(path)

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the eval split (a reward >= 1 is correct), the mean reward and the
        rollout component's own metrics prefixed ``eval_``, rolled out by rank 0 and shared with
        every rank (an engine that restarted meanwhile is re-synced first, as in a training step).
        A weight version is evaluated once: asked again (the first RL step after a warm start that
        ended on an evaluation), the same metrics come back."""
        if self._evaluated is not None and self._evaluated[0] == self.version:
            return dict(self._evaluated[1])
        self.mode.finish_push()

        def run() -> dict[str, float]:
            with self.mode.lock_engines(), self.recorder.span("eval"):
                groups = self.rollouts.run(list(self.components.env.tasks("eval")), 1, self.eval_params)
            rewards = [g.samples[0].reward for g in groups]
            extra = self.rollouts.metrics([g.samples[0] for g in groups])  # e.g. a rollout's diversity
            return {"eval_accuracy": sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
                    "eval_reward_mean": sum(rewards) / max(len(rewards), 1),
                    **{f"eval_{k}": v for k, v in extra.items()}}
        m = self.gather(run)
        self._evaluated = (self.version, dict(m))
        return m

    def sync(self, wait: bool = True) -> dict[str, float]:
        """Push the trainer's weights to the engines as ``self.version``, through the run mode:
        ``wait=False`` (a training step's push) lets it finish later (``Mode.push``)."""
        c = self.components
        trainer = c.trainer
        if isinstance(trainer, SendsPacked) and trainer.packed_formats:
            trainer = PackedView(trainer)
        if isinstance(c.spec, SyncFilter) and self._synced_once:  # LoRA: the base went with the first sync
            trainer = SyncView(trainer, c.spec.sync_filter)
        self._synced_once = True
        return self.mode.push(trainer, [c.engine] if c.engine is not None else [], self.version, wait)

    def share(self, obj: Any) -> Any:
        """``obj`` as rank 0 has it, on every trainer rank."""
        return self.components.trainer.broadcast_object(obj) if self.distributed else obj

    @property
    def distributed(self) -> bool:
        return isinstance(self.components.trainer, Distributed) and self.components.trainer.world_size > 1

    def loss_fn(self, algorithm: Any) -> Callable[[Batch, Any], tuple[Any, dict[str, float]]]:
        def fn(batch: Batch, logprobs: Any) -> tuple[Any, dict[str, float]]:
            batch, extra = self.mode.reweight(batch, logprobs)  # e.g. async: stale samples
            custom = self.pm.hook.miles_loss(batch=batch, logprobs=logprobs)
            if custom is not None and not (isinstance(custom, tuple) and len(custom) == 2
                                           and hasattr(custom[0], "backward") and isinstance(custom[1], dict)):
                who = ", ".join(self.pm.describe(i.plugin) for i in self.pm.hook.miles_loss.get_hookimpls())
                raise MilesError(f"miles_loss (plugin {who}) returned {type(custom).__name__} {custom!r:.80}; "
                                 f"it must return (loss tensor, metrics dict), or None to keep the algorithm's")
            loss, metrics = custom if custom is not None else algorithm.loss(batch, logprobs)
            if getattr(logprobs, "requires_grad", False) and not getattr(loss, "requires_grad", True):
                plugins = ", ".join(self.pm.describe(i.plugin) for i in self.pm.hook.miles_loss.get_hookimpls())
                who = f"miles_loss (plugin {plugins})" if custom is not None \
                    else f"algorithm {self.cfg.name('algorithm')!r}"
                raise MilesError(f"{who} returned a loss that does not depend on the log-probs (no grad): "
                                 f"nothing would train. Build the loss from the logprobs argument (not a detached "
                                 f"copy or a constant), or return None to keep the algorithm's")
            self.recorder.train_logprobs(batch.samples, logprobs)  # the sample browser's token pairs
            if batch.samples and batch.samples[0].logprobs:
                diff = (logprobs.detach() - batch.rollout_logprobs).abs()
                m = batch.loss_mask
                metrics = {**metrics, "train_rollout_logprob_abs_diff": float((diff * m).sum() / m.sum().clamp(min=1))}
            return loss, {**metrics, **extra}
        return fn

    def update(self, samples: list[Sample], advantages: list, algorithm: Any,
               temperature: float = 1.0, minibatches: int | None = None) -> dict[str, float]:
        """Optimizer step(s) on the samples: ``rollout.minibatches`` steps per batch (or ``minibatches``).
        ``temperature``: the one the samples were generated at (log-probs are scored at it)."""
        trainer = self.components.trainer
        build = algorithm.make_batch if isinstance(algorithm, BuildsBatches) else Batch.from_samples
        batch = build(samples, self.components.tokenizer.pad_token_id, advantages)  # e.g. SFT's packed rows
        batch.temperature = temperature or 1.0
        if algorithm.needs_reference:
            batch.ref_logprobs = trainer.logprobs(batch, "ref")
        k = max(1, min(minibatches or self.cfg.rollout.minibatches, len(batch)))
        if k > 1:
            batch.old_logprobs = trainer.logprobs(batch, "policy")
        critic = isinstance(algorithm, CriticAlgorithm) and algorithm.needs_critic \
            and isinstance(trainer, SupportsCritic)
        if critic:  # the critic's V_t before the update (PPO's GAE)
            batch.extras["values"] = trainer.values(batch)
        # optional whole-batch step: token advantages needing ref/old/values (KL in reward, GAE)
        prepared = algorithm.prepare(batch) if isinstance(algorithm, Prepares) else {}
        order = list(range(len(batch)))
        random.Random(self.seed + self.version).shuffle(order)
        chunks = [order[i::k] for i in range(k)] if k > 1 else [order]
        totals: dict[str, float] = {}
        for idx in chunks:
            mb = batch.select(sorted(idx)).as_global() if k > 1 else batch
            if self.cfg.rollout.true_on_policy and algorithm.uses_rollout:
                mb = self.engine_scored(mb)
            for key, v in trainer.train_step(mb, self.loss_fn(algorithm)).items():
                totals[key] = totals.get(key, 0.0) + v / len(chunks)
            for key, v in (trainer.train_critic(mb, algorithm.value_loss) if critic else {}).items():
                totals[key] = totals.get(key, 0.0) + v / len(chunks)
        return {**prepared, **totals}

    def engine_scored(self, mb: Batch) -> Batch:
        """True on-policy: the engine's log-probs of exactly this mini-batch, computed by the trainer's own
        routine (``trainer.response_logprobs``) on the engine's weights, which this step has not changed yet:
        bitwise equal to the trainer's on the first mini-batch, and the old policy's for the later ones."""
        fn = self.components.trainer.response_logprobs if isinstance(self.components.trainer, ExactScoring) else None
        if self.main and (fn is None or not isinstance(self.components.engine, ScoresBatches)):
            raise MilesError(f"rollout.true_on_policy needs a trainer with response_logprobs and an "
                             f"engine with score(batch, fn); {self.cfg.name('trainer')!r} / "
                             f"{self.cfg.name('engine')!r} lack them")
        with self.mode.lock_engines():
            lp = self.share(self.components.engine.score(mb, fn) if self.main else None)
        return replace(mb, rollout_logprobs=lp, old_logprobs=lp)

    def console(self, text: str, progress: tuple[str, int, int] | None = None) -> None:
        """A line on the console, or (``progress=(phase, done, total)``) a long phase's progress."""
        for lg in self.loggers:
            if isinstance(lg, Console):
                lg.progress(*progress) if progress else lg.message(text)

    def rl_step(self, step: int) -> dict[str, Any]:
        """One RL step. The run mode's ``take`` covers tasks -> rollout -> rewards -> filters
        (sync: in order; async: from its workers' buffer); a step whose groups were all dropped is
        logged without an update."""
        t0 = time.perf_counter()
        rng = random.Random(self.seed * 1_000_003 + step)
        params = replace(self.params, seed=rng.randrange(2**31))
        with self.recorder.span("rollout"):
            groups, m = self.gather(lambda: self.mode.take(rng, params))  # tasks, rollout, rewards, filters
        t_train = time.perf_counter()
        if groups:
            advantages = [a for per_group in self.components.algorithm.advantages(groups) for a in per_group]
            samples = [s for g in groups for s in g.samples]
            self.recorder.pick(step, samples, advantages)
            with self.recorder.span("train"):
                m.update(self.update(samples, advantages, self.components.algorithm, params.temperature))  # train
            m.update(self._after_update(t_train))  # a new weight version, pushed to the engines
        return {**m, "weight_version": self.version, "step_seconds": time.perf_counter() - t0}

    def supervised_step(self, step: int) -> dict[str, Any]:
        """One step of a supervised algorithm (``uses_rollout`` False) on the samples it supplies
        (``SuppliesSamples``: e.g. a dataset file, or the env's demonstrations) instead of rollouts."""
        algo, t0 = self.components.algorithm, time.perf_counter()
        rng, n = random.Random(self.seed * 1_000_003 + step), self.cfg.rollout.batch_size * self.cfg.rollout.n
        samples = algo.supervised_samples(self.components.tokenizer, n, rng, self.version, env=self.components.env,
                                          rollout=self.rollout_component) if isinstance(algo, SuppliesSamples) else None
        if samples is None:
            raise MilesError(f"algorithm {self.cfg.name('algorithm')!r} trains without rollouts but supplied no "
                             f"samples (miles.protocols.SuppliesSamples); give it data or an env with demonstrations")
        if self.rollouts is not None:
            for s in samples:
                self.rollouts.score(s)
        with self.recorder.span("train"):
            m = self.update(samples, [0.0] * n, algo)
        m.update(self._after_update(t0), reward_mean=sum(s.reward or 0.0 for s in samples) / n)
        return {**m, "weight_version": self.version, "step_seconds": time.perf_counter() - t0}

    def gather(self, produce: Any) -> Any:
        """Rank 0 runs ``produce()`` and shares its result with every rank. An engine that
        restarted without the current weights makes every rank re-sync, then rank 0 retries."""
        while True:
            if not self.main:
                kind, out = self.share(None)
            else:
                try:
                    kind, out = self.share(("data", produce()))
                except EngineRestarted as e:
                    self.console(f"{e}: pushing weight version {self.version} again")
                    kind, out = self.share(("resync", None))
            if kind == "data":
                return out
            self.sync()  # then rank 0 takes again

    def _after_update(self, t_train: float) -> dict[str, Any]:
        """Timing of the update just made, then a new weight version pushed to the engines."""
        return {"train_seconds": time.perf_counter() - t_train, **self.publish(wait=False)}

    def publish(self, wait: bool = True) -> dict[str, float]:
        """The trainer's weights become a new weight version, pushed to the engines (``sync``)."""
        self.version += 1
        with self.recorder.span("weight_sync"):
            return self.sync(wait)

    def stopping(self) -> bool:
        """Whether SIGINT/SIGTERM asked the run to stop (rank 0's answer, on every rank)."""
        return bool(self.share(self.stop_signal))

    def _check_finite(self, step: int, m: dict[str, Any]) -> None:
        """The trainer skips a step whose loss or gradient is NaN/inf (metric ``nonfinite_skipped``);
        ``run.max_nonfinite_steps`` of them in a row end the run after checkpointing (the skipped
        steps left the weights as the last good step made them)."""
        self.bad_steps = self.bad_steps + 1 if m.get("nonfinite_skipped") else 0
        self.nonfinite_total += bool(m.get("nonfinite_skipped"))
        m["nonfinite_steps"] = self.nonfinite_total
        k = self.cfg.run.max_nonfinite_steps
        if self.bad_steps >= k:
            self.log(step, m)
            self.save(step)
            raise MilesError(f"{k} training steps in a row (steps {step - k + 1}-{step}) had a NaN/inf "
                             f"loss or gradient and were skipped; the last good weights are checkpointed "
                             f"at step {step} in {self.cfg.run.out_dir}. Lower trainer.lr, check rewards "
                             f"and custom losses, or raise run.max_nonfinite_steps")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.main:
            return
        metrics.update(self.recorder.step_end(step, metrics))
        for lg in self.loggers:
            lg.log(step, metrics)
        self.pm.hook.miles_on_step_end(step=step, metrics=metrics)

    def save(self, step: int) -> None:
        """Every rank writes its part into rank 0's temp folder; rank 0 seals it atomically."""
        tmp = self.share(runfolder.begin(self.cfg.run.out_dir, step) if self.main else None)
        with runfolder.disk_errors(tmp.parent, tmp if self.main else None):  # a full disk: a clear error
            self.components.trainer.save(os.path.join(tmp, "trainer"))
        if self.distributed:
            self.components.trainer.barrier()
        if self.main:
            runfolder.commit(tmp, step, {"weight_version": self.version, "tasks_consumed": self.task_order.consumed},
                             self.cfg.run.keep_checkpoints)
        if self.distributed:
            self.components.trainer.barrier()

    def open_loggers(self) -> None:
        """The configured loggers first (a factory that fails leaves metrics.jsonl as it was), then
        metrics.jsonl, cut back to the checkpoint resumed from (later rows are redone)."""
        run = self.cfg.run
        if self.main:  # metrics.jsonl always; a configured "jsonl" is that same file
            others = [self.pm.create("loggers", name, settings, out_dir=run.out_dir, total_steps=run.steps,
                                     config=self.cfg.raw)
                      for name, settings in self.cfg.loggers if name != "jsonl"]
            os.makedirs(run.out_dir, exist_ok=True)
            runfolder.truncate_metrics(os.path.join(run.out_dir, "metrics.jsonl"), self._resumed_step)
            self.loggers = [runfolder.MetricsLog(out_dir=run.out_dir), *others]

    def restore(self) -> int:
        """Resume from the newest intact checkpoint; the first step still to run. Nothing is written
        here: rows logged after it are dropped when the loggers open (they are redone)."""
        out = self.cfg.run.out_dir
        found = runfolder.latest(out)
        runfolder.check_resumable(out, found)
        if found:
            self.new_trainer(found)  # a checkpoint that does not fit the model stops here
            self.task_order.consumed = found[1].get("tasks_consumed", 0)  # epochs go on where the run was
        self._resumed_step = found[1]["step"] if found else None  # open_loggers cuts metrics.jsonl back to it
        if not found:
            return 0
        self.sync()
        return found[1]["step"] + 1

    def _catch_signals(self) -> None:
        """First SIGINT/SIGTERM: finish the current step, checkpoint, stop. A second: abandon now."""
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum: int, _frame: Any) -> None:
            if self.stop_signal is not None:
                raise KeyboardInterrupt
            self.stop_signal = signum
            self.console(f"{signal.Signals(signum).name}: stopping after this step (again to abandon it)")
        self._previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        if not os.environ.get("MILES_LAUNCHED"):  # a launcher checked these before writing its logs there
            runfolder.check_out_dir(cfg.run.out_dir)
            note, finished = runfolder.check_resume(cfg.run.out_dir, cfg.resolved(), cfg.run.steps)
            if note:
                print(note)
            if finished:
                return []
        self._catch_signals()
        with runfolder.leave_as_found(cfg.run.out_dir, self.main):  # a run that fails to start leaves no trace
            self.build()
            start = self.restore()
            self.open_loggers()
            if self.main:  # last: a rerun rejected above keeps the run's config.yaml
                runfolder.write_atomic(os.path.join(cfg.run.out_dir, "config.yaml"),
                                        yaml.safe_dump(cfg.resolved(), sort_keys=False))
        c = self.components
        self.recorder.open(cfg.run.out_dir, c.tokenizer,
                           c.engine.engine_stats if isinstance(c.engine, EngineStats) else None)
        history = []
        try:
            if start == 0:
                # a supervised phase (miles-plugin-sft's) trains a trainer of its own; the run's starts from it
                warm = cfg.run.warm_start is not None \
                    and self.pm.hook.miles_warm_start(run=self, settings=cfg.run.warm_start)
                weights = dict(self.components.trainer.named_weights()) if warm else None
                self.new_trainer()
                if weights is not None:
                    self.components.trainer.load_weights(weights.items())
                if self.components.algorithm.needs_reference:
                    self.components.trainer.snapshot_reference()
                self.sync()
                m = self.evaluate()
                self.log(0, m)
                history.append({"step": 0, **m})
                self.save(0)
                start = 1
            else:
                self.console(f"resuming from step {start - 1} in {cfg.run.out_dir}")
            gc.freeze()  # the run's long-lived objects: collections skip them (a full one took ~0.2 s)
            step_fn = self.rl_step if self.components.algorithm.uses_rollout else self.supervised_step
            for step in range(start, cfg.run.steps + 1):
                m = step_fn(step)
                self._check_finite(step, m)
                self._reward_share.check(step, m)
                if step % cfg.run.eval_every == 0 or step == cfg.run.steps:
                    m.update(self.evaluate())
                self.log(step, m)
                history.append({"step": step, **m})
                if step % cfg.run.checkpoint_every == 0 or step == cfg.run.steps or self.stopping():
                    self.save(step)
                if self.stopping():
                    raise Interrupted(f"{signal.Signals(self.stop_signal or signal.SIGTERM).name} after "
                                      f"step {step}: checkpoint written; rerun the same command to resume "
                                      f"from {cfg.run.out_dir}", 128 + (self.stop_signal or signal.SIGTERM))
            self.mode.finish_push()  # the engines end on the last version
            if self.distributed:  # no rank leaves while another is still in a collective
                self.components.trainer.barrier()
        finally:
            gc.unfreeze()
            self.mode.close()
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self.recorder.close()
            for lg in self.loggers:
                lg.close()
        return history
