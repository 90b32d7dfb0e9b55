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
from typing import Any, Sequence

import yaml

from . import builtin, checkpoint
from .builtin import encode_prompts, single_turn
from .config import Config
from .errors import EngineRestarted, MilesError
from .plugins import MilesPluginManager, call_all, call_first
from .protocols import Mode
from .types import Batch, Group, Sample, SamplingParams, Task


@dataclass
class Parts:
    """The components of one run, built from the config."""

    env: Any
    spec: Any
    tokenizer: Any
    algorithm: Any
    engine: Any
    transport: Any
    trainer: Any = None


class Interrupted(MilesError):
    """The run stopped on SIGINT/SIGTERM after checkpointing; the message is a one-line summary."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class SyncView:
    """The trainer as a transport sees it when the model spec has a ``sync_filter(name)``: only
    the weights it accepts (those training changes) are sent; everything else is the trainer's."""

    def __init__(self, trainer: Any, keep: Any):
        self._trainer, self._keep = trainer, keep

    def named_weights(self):
        return ((n, t) for n, t in self._trainer.named_weights() if self._keep(n))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)


class Loop:
    def __init__(self, pm: MilesPluginManager, cfg: Config):
        self.pm, self.cfg = pm, cfg
        self.seed = cfg.run.seed
        self.version = 0
        self.loggers: list[Any] = []
        self.rank = int(os.environ.get("RANK", "0"))
        self.main = self.rank == 0
        self.stop_signal: int | None = None  # set by SIGINT/SIGTERM during run()
        self.mode: Mode | None = None  # run.mode, made by build()
        self.bad_steps = self.nonfinite_total = 0
        self._previous: dict[int, Any] = {}
        self._synced_once = False

    def build(self, with_engine: bool = True) -> Parts:
        import torch

        cfg, pm = self.cfg, self.pm
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        torch.manual_seed(self.seed)
        env = pm.create("envs", cfg.name("env"), cfg.settings("env"), seed=self.seed)
        spec = pm.create("model_specs", cfg.name("model"), cfg.settings("model"))
        tokenizer = spec.build_tokenizer(env.tokenizer() if hasattr(env, "tokenizer") else None)
        algorithm = pm.create("algorithms", cfg.name("algorithm"), cfg.settings("algorithm"))
        engine = None
        if with_engine and self.main:
            engine = pm.create("engines", cfg.name("engine"), cfg.settings("engine"), spec=spec,
                               tokenizer=tokenizer, seed=self.seed)
            engine.tokenizer = tokenizer
        transport = pm.create("transports", cfg.name("sync"), cfg.settings("sync"), out_dir=cfg.run.out_dir)
        self.p = Parts(env, spec, tokenizer, algorithm, engine, transport)
        r = cfg.rollout
        stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.params = SamplingParams(r.temperature, r.top_p, r.top_k, r.max_new_tokens, stops)
        self.eval_params = SamplingParams(0.0, 1.0, 0, r.eval_max_new_tokens or r.max_new_tokens, stops)
        self.train_tasks = list(env.tasks("train"))
        self.mode = pm.create("modes", cfg.run.mode, None, loop=self)
        return self.p

    def make_trainer(self, settings: Any, algorithm: Any, total_steps: int | None = None) -> Any:
        """A trainer whose LR schedule spans ``total_steps`` (default: the run's steps)."""
        return self.pm.create("trainers", self.cfg.name("trainer"), settings, spec=self.p.spec,
                              tokenizer=self.p.tokenizer, seed=self.seed, algorithm=algorithm,
                              total_steps=self.cfg.run.steps if total_steps is None else total_steps)

    def new_trainer(self, found: Any = None) -> None:
        """The run's trainer, holding checkpoint ``found`` (``checkpoint.latest``'s answer) if given."""
        self.p.trainer = self.make_trainer(self.cfg.settings("trainer"), self.p.algorithm)
        if found:
            self.p.trainer.load(str(found[0] / "trainer"))
            self.version = found[1]["weight_version"]

    def rollout(self, tasks: list[Task], n: int, params: SamplingParams) -> list[Group]:
        """Custom ``miles_rollout`` hooks first; tasks nobody claims go to one batched call."""
        engine, out = self.p.engine, {}
        with self.mode.lock_engines():
            engine.sampling_params = params
            if len(self.pm.hook.miles_rollout.get_hookimpls()) > 1:
                for i, t in enumerate(tasks):
                    samples = call_first(self.pm, "miles_rollout", skip=(builtin,), task=t, n=n,
                                         engine=engine, env=self.p.env)
                    if samples is not None:
                        out[i] = samples
            pending = [i for i in range(len(tasks)) if i not in out]
            if pending:
                batched = single_turn([tasks[i] for i in pending], n, engine, self.p.tokenizer, params)
                out.update(zip(pending, batched))
            groups = [Group(t, out[i]) for i, t in enumerate(tasks)]
            for sample in (s for g in groups for s in g.samples):
                self.score(sample)
        return groups

    def keep(self, g: Group) -> bool:
        """Whether a group is trained on: the algorithm's own filter and every ``miles_filter``."""
        return self.p.algorithm.keep(g) and False not in call_all(self.pm, "miles_filter", group=g)

    def score(self, s: Sample) -> None:
        r = call_first(self.pm, "miles_reward", sample=s)
        if r is None:
            r = s.reward if s.reward is not None else self.p.env.reward(s)
        s.reward = float(r)

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the eval split, rolled out by rank 0 and shared with every rank (an
        engine that restarted meanwhile is re-synced first, as in a training step)."""
        self.mode.finish_push()

        def run() -> dict[str, float]:
            groups = self.rollout(list(self.p.env.tasks("eval")), 1, self.eval_params)
            rewards = [g.samples[0].reward for g in groups]
            return {"eval_accuracy": sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
                    "eval_reward_mean": sum(rewards) / max(len(rewards), 1)}
        return self.gather(run)

    def sync(self, wait: bool = True) -> dict[str, float]:
        """Push the trainer's weights to the engines as ``self.version``, through the run mode:
        ``wait=False`` (a training step's push) lets it finish later (``Mode.push``)."""
        engines = [self.p.engine] if self.p.engine is not None else []
        trainer, keep = self.p.trainer, getattr(self.p.spec, "sync_filter", None)
        if keep is not None and self._synced_once:  # e.g. LoRA: the frozen base went with the first sync
            trainer = SyncView(trainer, keep)
        self._synced_once = True
        return self.mode.push(trainer, engines, self.version, wait)

    def share(self, obj: Any) -> Any:
        """``obj`` as rank 0 has it, on every trainer rank."""
        trainer = self.p.trainer
        return trainer.broadcast_object(obj) if getattr(trainer, "world_size", 1) > 1 else obj

    def demo_samples(self, demos: Sequence, count: int, rng: random.Random) -> list[Sample]:
        tok, eos = self.p.tokenizer, self.p.tokenizer.eos_token_id
        picked = [rng.choice(demos) for _ in range(count)]
        prompts = encode_prompts(tok, [task.prompt for task, _ in picked])
        responses = encode_prompts(tok, [text for _, text in picked])  # plain text, no template
        stop = [eos] if eos is not None else []
        return [Sample(task=task, prompt_ids=p, response_ids=r + stop, response=text, weight_version=self.version)
                for (task, text), p, r in zip(picked, prompts, responses)]

    def loss_fn(self, algorithm: Any):
        def fn(batch: Batch, logprobs):
            batch, extra = self.mode.reweight(batch, logprobs)  # e.g. async: stale samples
            custom = call_first(self.pm, "miles_loss", batch=batch, logprobs=logprobs)
            loss, metrics = custom if custom is not None else algorithm.loss(batch, logprobs)
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
        trainer = self.p.trainer
        build = getattr(algorithm, "make_batch", None)  # e.g. SFT's sequence packing
        batch = (build or Batch.from_samples)(samples, self.p.tokenizer.pad_token_id, advantages)
        batch.temperature = temperature or 1.0
        if getattr(algorithm, "needs_reference", False):
            batch.ref_logprobs = trainer.logprobs(batch, "ref")
        k = max(1, min(minibatches or self.cfg.rollout.minibatches, len(batch)))
        if k > 1:
            batch.old_logprobs = trainer.logprobs(batch, "policy")
        critic = getattr(algorithm, "needs_critic", False)
        if critic:  # the critic's V_t before the update (PPO's GAE)
            batch.extras["values"] = trainer.values(batch)
        # optional whole-batch step: token advantages needing ref/old/values (KL in reward, GAE)
        prepared = algorithm.prepare(batch) if hasattr(algorithm, "prepare") else {}
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
        fn = getattr(self.p.trainer, "response_logprobs", None)
        if self.main and (fn is None or not hasattr(self.p.engine, "score")):
            raise MilesError(f"rollout.true_on_policy needs a trainer with response_logprobs and an "
                             f"engine with score(batch, fn); {self.cfg.name('trainer')!r} / "
                             f"{self.cfg.name('engine')!r} lack them")
        with self.mode.lock_engines():
            lp = self.share(self.p.engine.score(mb, fn) if self.main else None)
        return replace(mb, rollout_logprobs=lp, old_logprobs=lp)

    def warm_start(self) -> None:
        """Supervised training on demonstrations until eval accuracy plateaus."""
        ws, env = self.cfg.run.warm_start, self.p.env
        if not hasattr(env, "demonstrations"):
            raise MilesError(f"run.warm_start needs demonstrations, but env {self.cfg.name('env')!r} "
                             f"has none; remove run.warm_start or pick an env that provides them")
        algo = self.pm.create("algorithms", ws.algorithm, None)
        # its LR schedule spans the warm start's own steps, not the RL run's
        self.p.trainer = self.make_trainer(self.cfg.warm_start_trainer, algo, ws.max_steps)
        demos, rng = list(env.demonstrations()), random.Random(self.seed)
        best, stale = -1.0, 0
        log = builtin.JsonlLogger(out_dir=self.cfg.run.out_dir, filename="warm_start.jsonl") if self.main else None
        t0 = time.perf_counter()
        for step in range(1, ws.max_steps + 1):
            if self.share(self.stop_signal):
                raise KeyboardInterrupt
            # one step per batch: rollout.minibatches (PPO-style) must not change the warm start
            m = self.update(self.demo_samples(demos, ws.batch_size, rng), [0.0] * ws.batch_size, algo,
                            minibatches=1)
            if step % ws.eval_every and step != ws.max_steps:
                continue
            self.version += 1
            self.sync()
            m.update(self.evaluate(), seconds=time.perf_counter() - t0)
            if self.main:
                log.log(step, m)
                self.console(f"warm start step {step}: eval_acc {m['eval_accuracy']:.3f}  "
                             f"loss {m.get('sft_loss', float('nan')):.4f}")
            if m["eval_accuracy"] > best + ws.min_delta:
                best, stale = m["eval_accuracy"], 0
            else:
                stale += 1
                if stale >= ws.patience and step >= ws.min_steps:
                    break
        if log:
            log.close()
        weights = dict(self.p.trainer.named_weights())
        self.new_trainer()
        self.p.trainer.load_weights(weights.items())

    def console(self, text: str) -> None:
        for lg in self.loggers:
            if isinstance(lg, builtin.ConsoleLogger):
                lg.console.print(text)

    def rl_step(self, step: int) -> dict[str, Any]:
        cfg, algo = self.cfg, self.p.algorithm
        t0 = time.perf_counter()
        rng = random.Random(self.seed * 1_000_003 + step)
        if not algo.uses_rollout:  # supervised: demonstrations instead of rollouts
            n = cfg.rollout.batch_size * cfg.rollout.n
            source = getattr(algo, "supervised_samples", None)  # e.g. SFT from a dataset file
            samples = source(self.p.tokenizer, n, rng, self.version) if source else None
            if samples is None:
                samples = self.demo_samples(self.p.env.demonstrations(), n, rng)
            for s in samples:
                self.score(s)
            m = self.update(samples, [0.0] * n, algo)
            m.update(self._after_update(t0), reward_mean=sum(s.reward for s in samples) / n)
            return {**m, "weight_version": self.version, "step_seconds": time.perf_counter() - t0}
        params = replace(self.params, seed=rng.randrange(2**31))
        kept, m = self.gather(lambda: self.mode.take(rng, params))
        t_roll = time.perf_counter()
        if kept:  # a step whose groups were all dropped is logged without an update
            advs = [a for per_group in algo.advantages(kept) for a in per_group]
            m.update(self.update([s for g in kept for s in g.samples], advs, algo, params.temperature))
            m.update(self._after_update(t_roll))
        m.update(weight_version=self.version, step_seconds=time.perf_counter() - t0)
        return m

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
        seconds = time.perf_counter() - t_train
        self.version += 1
        return {"train_seconds": seconds, **self.sync(wait=False)}

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
        for lg in self.loggers:
            lg.log(step, metrics)
        call_all(self.pm, "miles_on_step_end", step=step, metrics=metrics)

    def save(self, step: int) -> None:
        """Every rank writes its part into rank 0's temp folder; rank 0 seals it atomically."""
        tmp = self.share(checkpoint.begin(self.cfg.run.out_dir, step) if self.main else None)
        self.p.trainer.save(os.path.join(tmp, "trainer"))
        if getattr(self.p.trainer, "world_size", 1) > 1:
            self.p.trainer.barrier()
        if self.main:
            checkpoint.commit(tmp, step, {"weight_version": self.version}, self.cfg.run.keep_checkpoints)
        if getattr(self.p.trainer, "world_size", 1) > 1:
            self.p.trainer.barrier()

    def open_loggers(self) -> None:
        run = self.cfg.run
        if self.main:  # metrics.jsonl always; a configured "jsonl" is that same file
            self.loggers = [builtin.JsonlLogger(out_dir=run.out_dir)] + [
                self.pm.create("loggers", name, settings, out_dir=run.out_dir, total_steps=run.steps)
                for name, settings in self.cfg.loggers if name != "jsonl"]

    def restore(self) -> int:
        """Resume from the newest checkpoint; the first step still to run."""
        found = checkpoint.latest(self.cfg.run.out_dir)
        if self.main:
            checkpoint.truncate_metrics(os.path.join(self.cfg.run.out_dir, "metrics.jsonl"),
                                        found[1]["step"] if found else None)
        if not found:
            return 0
        self.new_trainer(found)
        self.sync()
        return found[1]["step"] + 1

    def _catch_signals(self) -> None:
        """First SIGINT/SIGTERM: finish the current step, checkpoint, stop. A second: abandon now."""
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum, _frame):
            if self.stop_signal is not None:
                raise KeyboardInterrupt
            self.stop_signal = signum
            self.console(f"{signal.Signals(signum).name}: stopping after this step (again to abandon it)")
        self._previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        os.makedirs(cfg.run.out_dir, exist_ok=True)
        if self.main:
            with open(os.path.join(cfg.run.out_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(cfg.raw, f, sort_keys=False)
        self._catch_signals()
        self.build()
        start = self.restore()
        self.open_loggers()
        history = []
        try:
            if start == 0:
                if cfg.run.warm_start:
                    self.warm_start()
                else:
                    self.new_trainer()
                if getattr(self.p.algorithm, "needs_reference", False):
                    self.p.trainer.snapshot_reference()
                self.sync()
                m = self.evaluate()
                self.log(0, m)
                history.append({"step": 0, **m})
                self.save(0)
                start = 1
            else:
                self.console(f"resuming from step {start - 1} in {cfg.run.out_dir}")
            gc.freeze()  # the run's long-lived objects: collections skip them (a full one took ~0.2 s)
            for step in range(start, cfg.run.steps + 1):
                m = self.rl_step(step)
                self._check_finite(step, m)
                if step % cfg.run.eval_every == 0 or step == cfg.run.steps:
                    m.update(self.evaluate())
                self.log(step, m)
                history.append({"step": step, **m})
                if step % cfg.run.checkpoint_every == 0 or step == cfg.run.steps or self.share(self.stop_signal):
                    self.save(step)
                if self.share(self.stop_signal):
                    raise Interrupted(f"{signal.Signals(self.stop_signal or signal.SIGTERM).name} after "
                                      f"step {step}: checkpoint written; rerun the same command to resume "
                                      f"from {cfg.run.out_dir}", 128 + (self.stop_signal or signal.SIGTERM))
            self.mode.finish_push()  # the engines end on the last version
        finally:
            gc.unfreeze()
            self.mode.close()
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            for lg in self.loggers:
                lg.close()
        return history
