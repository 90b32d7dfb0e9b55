"""Rollout ``single_turn``: registered lazily; one batched engine call for all tasks; statuses,
log-probs and engine extras carried into the samples; the ``trylast`` hook default."""
from miles import Completion, SamplingParams, Status, Task
from miles.protocols import Rollout
from miles.testing import assert_lazy_registration, char_tokenizer
from miles.rollouts import SingleTurn


class Engine:
    """Answers each prompt with its own length as text; the second completion runs out of tokens."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def generate(self, prompts, params, n=1):
        self.calls.append(len(prompts))
        out = []
        for p in prompts:
            ids = self.tok.encode(str(len(p)), add_special_tokens=False)
            out.append([Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop" if i == 0
                                   else "length", weight_version=7, extras={"moe": {"k": i}}) for i in range(n)])
        return out


def test_registration_is_lazy():
    assert_lazy_registration("miles.builtin", "rollouts", "single_turn")


def test_all_tasks_in_one_engine_call():
    tok = char_tokenizer()
    engine = Engine(tok)
    rollout = SingleTurn()
    assert isinstance(rollout, Rollout)
    groups = rollout.generate([Task("1+2="), Task("10+20=")], 2, engine=engine, env=None, tokenizer=tok,
                              params=SamplingParams())
    assert engine.calls == [2]
    assert [[s.response for s in g] for g in groups] == [["4", "4"], ["6", "6"]]
    first, second = groups[0]
    assert first.status == Status.COMPLETED and second.status == Status.TRUNCATED
    assert first.logprobs == [-0.5] and first.weight_versions == [7] and second.extensions == {"moe": {"k": 1}}
    assert first.prompt_ids == tok.encode("1+2=", add_special_tokens=False)


def test_the_trylast_hook_default_generates_one_task():
    from miles import hookimpl, make_plugin_manager

    class Mine:
        @hookimpl
        def miles_rollout(self, task):
            return [] if task.prompt == "mine" else None

    pm = make_plugin_manager(extra=["miles.builtin"], autoload=False)
    pm.register(Mine())
    tok = char_tokenizer()
    kw = {"n": 3, "engine": Engine(tok), "env": None, "tokenizer": tok, "params": SamplingParams()}
    assert pm.hook.miles_rollout(task=Task("mine"), **kw) == []
    assert [s.response for s in pm.hook.miles_rollout(task=Task("12="), **kw)] == ["3", "3", "3"]


def test_a_run_leaves_the_hook_default_out_and_batches_unclaimed_tasks_into_its_rollout():
    """Whatever ``rollout.name`` is (here another component), the tasks no hook claims reach it in
    one call: the trylast default never generates them one by one."""
    from types import SimpleNamespace

    from miles import Sample, hookimpl, make_plugin_manager
    from miles.rollouts import RolloutService

    class Mine:
        @hookimpl
        def miles_rollout(self, task):
            return [Sample(task=task, response="mine", reward=1.0)] if task.prompt == "mine" else None

    class Other:  # the run's rollout component
        calls = []

        def generate(self, tasks, n, **_):
            self.calls.append([t.prompt for t in tasks])
            return [[Sample(task=t, response="other", reward=0.0)] for t in tasks]

    pm = make_plugin_manager(extra=["miles.builtin"], autoload=False)
    pm.register(Mine())
    algorithm = SimpleNamespace(keep=lambda g: True)
    service = RolloutService(pm, Other(), None, SimpleNamespace(), char_tokenizer(), algorithm)
    groups = service.run([Task("a"), Task("mine"), Task("b")], 1, SamplingParams())
    assert [g.samples[0].response for g in groups] == ["other", "mine", "other"]
    assert Other.calls == [["a", "b"]]
