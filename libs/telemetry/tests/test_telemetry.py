"""The telemetry library: FLOPs and peaks, rotating files under their cap, the tail reader across
a rewrite, the recorder's files and cost, and the step gauges through prometheus_client's parser."""
import json
import threading
import time
import urllib.request

import pytest
import torch
from miles_telemetry import RunRecorder, Tail, model_flops, peak_tflops
from miles_telemetry.files import RotatingJsonl, rotated_files
from miles_telemetry.flops import Throughput
from prometheus_client.parser import text_string_to_metric_families

QWEN = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=20)


def test_model_flops_count_the_matmuls_of_a_real_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**QWEN, tie_word_embeddings=True))
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    f = model_flops(model.config)
    assert f.active_params == matmul + 128 * 20  # every projection, plus the (tied) LM head
    assert f.step([10]) == 6 * f.active_params * 10 + 12 * 2 * 128 * 100 / 2
    assert model_flops({"sample_size": 64}) is None  # not a transformer LM: no MFU, no guess


def test_peaks_come_from_the_table_or_the_override():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989 and peak_tflops("NVIDIA H100 PCIe") == 756
    assert peak_tflops("NVIDIA H200", "fp8") == 1979
    assert peak_tflops("Some Future GPU") is None and peak_tflops("Some Future GPU", override=123) == 123
    assert 0 < peak_tflops("cpu", threads=2) < peak_tflops("cpu", threads=4)
    m = Throughput(QWEN, world_size=2, device="NVIDIA H100", peak_override=None).metrics([10, 20], 0.5)
    assert m["tokens_per_gpu_per_s"] == 30 / 0.5 / 2 and m["mfu"] == pytest.approx(m["train_tflops_per_gpu"] / 989)


def test_rotating_files_stay_under_their_cap(tmp_path):
    f = RotatingJsonl(tmp_path / "s.jsonl", max_bytes=40_000, keep=4)
    for i in range(2000):
        f.write({"i": i, "pad": "x" * 80, "bad": float("nan")})
    f.close()
    files = rotated_files(tmp_path / "s.jsonl")
    assert [p.name for p in files] == ["s.3.jsonl", "s.2.jsonl", "s.1.jsonl", "s.jsonl"]
    assert sum(p.stat().st_size for p in files) <= 40_000 + 200
    rows = [json.loads(line) for p in files for line in p.read_text().splitlines()]
    assert rows[-1]["i"] == 1999 and rows[-1]["bad"] is None  # NaN is written as null (JSON has none)
    assert [r["i"] for r in rows] == list(range(rows[0]["i"], 2000))  # oldest first, none missing


def test_tail_reads_new_rows_and_starts_over_on_a_rewrite(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "x"')
    t = Tail(p)
    assert [r["step"] for r in t.read()] == [0, 1] and t.pending()
    with open(p, "a") as f:
        f.write(': 1}\n{"step": 3}\nnot json\n')
    assert [r["step"] for r in t.read()] == [2, 3] and t.problems == ["m.jsonl line 5: not JSON ('not json')"]
    tmp = tmp_path / "new"
    tmp.write_text('{"step": 0}\n')
    tmp.replace(p)  # a resumed run rewrites the file atomically
    assert [r["step"] for r in t.read()] == [0] and t.generation == 1 and t.rows == [{"step": 0}]


class _S:  # the fields of miles.Sample the recorder reads
    def __init__(self, i):
        from types import SimpleNamespace

        self.task = SimpleNamespace(prompt=f"{i}+1=", label=str(i + 1))
        self.response_ids, self.logprobs, self.loss_mask = [5, 6, 7], [-0.5, -1.0, -2.0], [1, 0, 1]
        self.response, self.reward, self.status, self.weight_version = "abc", float(i), "completed", 3


def test_recorder_writes_spans_samples_and_devices(tmp_path):
    rec = RunRecorder(samples=2, devices_every=0.05, seed=1)
    with rec.span("rollout"):  # before open: nothing is recorded, nothing fails
        pass
    rec.open(str(tmp_path), engine_stats=lambda: [{"name": "e0", "running": 2.0}])
    t0 = time.perf_counter()
    samples = [_S(i) for i in range(6)]
    with rec.span("rollout"):
        with rec.span("generate") as attrs:
            attrs["tokens"] = 18
            time.sleep(0.01)
        for _ in range(5):
            with rec.span("filter"):  # back to back: one span
                pass
    rec.pick(1, samples, [0.5] * 6)
    lp = torch.tensor([[-0.4, -1.0, -2.5, 0.0]] * 6)
    rec.train_logprobs(samples, lp)
    th = threading.Thread(target=lambda: rec.add_span("generate", time.time(), time.time() + 0.01), name="worker-0")
    th.start()
    th.join()
    time.sleep(0.2)
    m = rec.step_end(1, {})
    wall = time.perf_counter() - t0
    rec.close()
    tl = json.loads((tmp_path / "telemetry/timeline.jsonl").read_text())
    names = [(s[0], s[1]) for s in tl["spans"]]
    assert names.count(("filter", "trainer")) == 1 and ("generate", "worker-0") in names
    assert m["rollout_tokens_per_s"] > 0 and 0 <= m["telemetry_seconds"] < 0.25 * wall  # a share of the step
    rows = [json.loads(x) for x in (tmp_path / "telemetry/samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["train_logprobs"] == [-0.4, -1.0, -2.5] and rows[0]["loss_mask"] == [1, 0, 1]
    assert rows[0]["rollout_logprobs"] == [-0.5, -1.0, -2.0] and rows[0]["advantage"] == 0.5
    dev = [json.loads(x) for x in (tmp_path / "telemetry/devices.jsonl").read_text().splitlines()]
    assert len(dev) >= 2 and dev[-1]["rss_bytes"] > 0 and dev[-1]["engines"] == [{"name": "e0", "running": 2.0}]


def test_engine_readings_get_their_tokens_per_second():
    rec = RunRecorder()
    first = rec._with_rates([{"name": "a", "generated_tokens": 100}, {"running": 1}], 10.0)
    assert first == [{"name": "a", "generated_tokens": 100}, {"running": 1}]  # nothing to compare with yet
    later = rec._with_rates([{"name": "a", "generated_tokens": 400}, {"name": "b", "generated_tokens": 5}], 12.0)
    assert later[0]["tokens_per_s"] == 150.0 and "tokens_per_s" not in later[1]
    stale = rec._with_rates([{"name": "a", "generated_tokens": 400, "stale": True}], 14.0)
    assert "tokens_per_s" not in stale[0]  # a server's last reading repeated: no rate from it
    assert rec._with_rates([{"name": "a", "generated_tokens": 300}], 16.0)[0]["tokens_per_s"] == 0.0  # restarted


def test_engine_reading_from_metrics_text():
    from miles_telemetry.prom import engine_reading, parse_samples

    text = ('# HELP x y\nsglang:num_running_reqs{a="1 }",b="2"} 2\nsglang:num_running_reqs{a="2"} 3 1700000\n'
            'sglang:token_usage{a="1"} 0.2\nsglang:token_usage{a="2"} 0.4\nsglang:spec_accept_rate 0.6\n'
            'sglang:spec_accept_length 1.8\nmiles_engine_queued_sequences 4\nbroken{\nalso_broken x\n')
    assert parse_samples(text)["sglang:num_running_reqs"] == [2.0, 3.0]
    assert engine_reading(text) == {"running": 5.0, "queued": 4.0, "kv_cache_usage": pytest.approx(0.3),
                                    "spec_accept_rate": 0.6}
    assert engine_reading("") == {}


def test_step_gauges_parse_with_the_official_parser():
    from miles_telemetry.prom import StepGauges

    g = StepGauges("127.0.0.1", 0)
    try:
        g.update(3, {"reward_mean": 0.25, "mfu": 0.4, "eval/acc": 1, "note": "text"})
        text = urllib.request.urlopen(f"http://127.0.0.1:{g.port}/metrics", timeout=10).read().decode()
    finally:
        g.close()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["miles_step"] == 3 and samples["miles_reward_mean"] == 0.25 and samples["miles_mfu"] == 0.4
    assert samples["miles_eval_acc"] == 1 and samples["miles_steps_logged_total"] == 1
    assert not any("note" in k for k in samples)


def test_seq_lens_of_padded_and_packed_batches():
    from types import SimpleNamespace

    import torch
    from miles_telemetry.flops import seq_lens

    padded = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert seq_lens(SimpleNamespace(attention_mask=padded)) == [2, 3]
    block = torch.zeros(1, 4, 4, dtype=torch.bool)  # a packed row: 3 tokens in two documents, 1 pad
    block[0, :2, :2] = block[0, 2, 2] = True
    assert seq_lens(SimpleNamespace(attention_mask=block)) == [3]
    assert seq_lens(SimpleNamespace()) == []
