"""The serve scheduler's cancellation of requests whose client went away, on a test-double engine
whose calls block until released (so what runs when is under the test's control)."""
import asyncio
import threading

from miles import Completion, SamplingParams

from miles_plugin_torch_engine.scheduler import Item, Request, Scheduler


class BlockingEngine:
    """Generates one token per 1 ms until ``release`` or its ``interrupt`` is set."""

    def __init__(self):
        self.interrupt, self.release, self.started = threading.Event(), threading.Event(), threading.Event()
        self.dropped: set[int] = set()  # what the scheduler leaves out of a call (this double decodes them anyway)
        self.calls: list[int] = []

    def generate(self, prompts, params, n=1):
        self.calls.append(params.max_new_tokens)
        self.started.set()
        tokens = 0
        while tokens < params.max_new_tokens and not (self.release.is_set() or self.interrupt.is_set()):
            self.interrupt.wait(0.001)
            tokens += 1
        return [[Completion([7] * tokens, [0.0] * tokens, "abort", 0) for _ in range(n)] for _ in prompts]


def request(loop, max_new, temperature=0.0):
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new)
    return Request(rid="r", loop=loop, future=loop.create_future(), items=[Item((2, 5), params, 1)])


async def started(engine):
    while not engine.started.is_set():
        await asyncio.sleep(0.005)


def test_a_cancelled_request_alone_on_the_engine_stops_it():
    engine = BlockingEngine()
    sched = Scheduler(engine)

    async def main():
        r = request(asyncio.get_running_loop(), 100_000)
        sched.submit(r)
        await started(engine)
        sched.cancel(r)
        await asyncio.wait_for(r.future, 10)

    asyncio.run(main())
    assert sched.stats["num_cancelled"] == 1 and 0 < sched.stats["cancelled_tokens"] < 100_000
    sched.stop()


def test_a_cancelled_request_sharing_the_batch_skips_its_own_engine_call():
    """Two sampling settings in one batch: the live one runs on; the cancelled one, not started
    yet, gets no engine call (without the skip the engine would be called twice)."""
    engine = BlockingEngine()
    sched = Scheduler(engine)

    async def main():
        loop = asyncio.get_running_loop()
        gate = threading.Event()
        blocker = sched.call(gate.wait)  # the engine thread is busy: both requests join one batch
        live, gone = request(loop, 100_000), request(loop, 50_000, temperature=1.0)
        sched.submit(live)
        sched.submit(gone)
        gate.set()
        await blocker
        await started(engine)
        sched.cancel(gone)  # its group waits behind the live one's
        assert not engine.interrupt.is_set()  # the live request is not cut short
        engine.release.set()
        await asyncio.wait_for(asyncio.gather(live.future, gone.future), 10)
        return live

    live = asyncio.run(main())
    assert engine.calls == [100_000] and live.items[0].completions
    assert sched.stats["num_cancelled"] == 1 and sched.stats["cancelled_tokens"] == 0
    sched.stop()


class NoEosSpec:
    """A tiny Qwen2 with a long context and no end-of-sequence token: every sample runs to
    max_new_tokens unless something stops it."""

    def build_model(self, tokenizer):
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        return Qwen2ForCausalLM(Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=None)).eval()


def test_the_rows_of_a_cancelled_request_leave_a_shared_engine_call():
    """Two requests in one engine call (same sampling settings); one client leaves: its rows stop
    at once, the other request gets every token it asked for."""
    import torch
    from miles.testing import char_tokenizer

    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    tok = char_tokenizer()
    tok.eos_token = None
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = TorchEngine(TorchEngineConfig(), spec=NoEosSpec(), tokenizer=tok, seed=0)
        assert engine._fast is not None and engine.eos_id is None
        sched = Scheduler(engine)

        async def main():
            loop = asyncio.get_running_loop()
            params = SamplingParams(temperature=0.0, max_new_tokens=1500)
            live, gone = (Request(rid=r, loop=loop, future=loop.create_future(), items=[Item(p, params, 2)])
                          for r, p in (("live", (2, 5)), ("gone", (2, 6))))
            gate = threading.Event()
            blocker = sched.call(gate.wait)  # both requests join one batch, one engine call
            sched.submit(live)
            sched.submit(gone)
            gate.set()
            await blocker
            while not sched.stats["num_running"]:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)  # a few decode steps: far from the 1,500 asked for
            sched.cancel(gone)
            await asyncio.wait_for(asyncio.gather(live.future, gone.future), 120)
            return live, gone

        live, gone = asyncio.run(main())
    finally:
        torch.set_num_threads(before)
    sched.stop()
    assert sched.stats["num_engine_calls"] == 1 and not engine.interrupt.is_set()
    assert [len(c.token_ids) for c in live.items[0].completions] == [1500, 1500]
    spent = [len(c.token_ids) for c in gone.items[0].completions]
    assert len(spent) == 2 and max(spent) < 750, spent
    assert sched.stats["cancelled_tokens"] == sum(spent)
