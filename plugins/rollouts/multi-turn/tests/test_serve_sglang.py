"""Multi-turn through the ``sglang`` engine: a real ``miles serve`` process (SGLang's HTTP API), the
sglang client pointed at it, ``rollout.name: multi_turn`` with the tool-use env, short runs of
``miles train`` in sync and async mode. A launch-time plugin (``spy_plugin.py``) rewards tool
calls (so the weights move) and records what the trainer sees: the engine's token ids and
log-probs (the trainer's own log-probs of those ids agree where the weights are the ones that
generated them), tool tokens masked with log-prob 0."""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from miles import make_plugin_manager
from miles.cli import main
from miles_plugin_tool_use.env import tool_tokenizer

HERE = Path(__file__).resolve().parent
RECIPE = HERE.parents[3] / "recipes" / "tool_use.yaml"
MODEL = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
         "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One ``miles serve`` process over a tiny model with the tool-use env's tokenizer."""
    folder = tmp_path_factory.mktemp("export") / "model"
    pm = make_plugin_manager()
    spec = pm.create("model_specs", "hf", pm.registry("model_specs")["hf"].config(config=MODEL))
    tok = tool_tokenizer()
    spec.build_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "serve", str(folder), "--port", "0"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(180)
    try:
        assert line and "listening on http://" in line[0], log.read_text()[-3000:]
        yield line[0].strip().rsplit(" ", 1)[1]
    finally:
        proc.kill()
        proc.wait(30)


def _train(url: str, out: Path, *extra: str) -> list[dict]:
    spy = out.parent / f"{out.name}.spy.jsonl"
    os.environ["MILES_TEST_SPY"] = str(spy)
    try:
        code = main(["train", str(RECIPE), "--plugin", str(HERE / "spy_plugin.py"), f"run.out_dir={out}",
                     "loggers=[]", f"model.config={json.dumps(MODEL)}", "engine.name=sglang",
                     f"engine.urls=[{url}]", "sync.name=disk", "rollout.batch_size=4", "rollout.n=4",
                     "env.train_size=200", "env.eval_size=8", "env.a_digits=2", "env.teacher_tool_rate=1.0",
                     "env.teacher_bad_call_rate=0.3", "run.warm_start.max_steps=30",
                     "run.warm_start.min_steps=30", "run.warm_start.eval_every=30",
                     "run.warm_start.batch_size=32", "run.checkpoint_every=100", "run.eval_every=100",
                     "algorithm.filter_zero_variance=false", *extra])  # rewards are 0 here: keep every group
    finally:
        del os.environ["MILES_TEST_SPY"]
    assert code == 0
    return [json.loads(line) for line in spy.read_text().splitlines()]


def _check_tool_tokens(rows: list[dict]) -> None:
    """Tool results are whole frames, masked, log-prob 0; a sample's model turns are its trained runs."""
    for r in rows:
        assert r["rollout_lps"] and r["tool_lps_zero"]
        assert len(r["tool_frames"]) in (r["turns"] - 1, r["turns"])  # a last frame when out of budget
        for i, frame in enumerate(r["tool_frames"]):
            assert frame.startswith("<tool_response>")
            assert frame.endswith("</tool_response>") or (i == len(r["tool_frames"]) - 1 and r["status"] == "truncated")
    assert sum(r["turns"] > 1 for r in rows) >= 4, "the warm-started model calls its tool"


@pytest.mark.slow
def test_sync_multi_turn_through_the_sglang_client_keeps_engine_tokens(server, tmp_path):
    rows = _train(server, tmp_path / "sync", "run.steps=2")
    assert {r["step"] for r in rows} == {1, 2} and len(rows) == 2 * 16
    _check_tool_tokens(rows)
    for r in rows:  # sync: every sample comes from the weights the trainer holds
        assert r["versions"] == [r["trainer_version"]]
        assert r["diff"] < 1e-4, r  # the trainer scores the server's own ids as the server did


@pytest.mark.slow
def test_async_multi_turn_through_the_sglang_client_with_in_flight_resume(server, tmp_path):
    """Rollout workers generate while the trainer steps; requests a push catches are resumed on
    the new weights (a sample then lists both versions)."""
    rows = _train(server, tmp_path / "async", "run.steps=3", "run.mode=async", "rollout.max_staleness=1",
                  "rollout.in_flight=resume", "rollout.async_workers=2")
    assert {r["step"] for r in rows} == {1, 2, 3}
    _check_tool_tokens(rows)
    for r in rows:
        assert r["trainer_version"] - 1 <= min(r["versions"]) <= max(r["versions"]) <= r["trainer_version"]
    fresh = [r for r in rows if r["versions"] == [r["trainer_version"]]]
    assert fresh and all(r["diff"] < 1e-4 for r in fresh), fresh
    stale = [r for r in rows if r["versions"][0] < r["trainer_version"]]
    assert stale, "async: some samples were generated on older weights while the trainer stepped"
    # the weights did move (the tool-call reward): the agreement above is not a given
    assert max(r["diff"] for r in stale) > 1e-3
