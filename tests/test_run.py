"""End-to-end runs of the CLI on a tiny config: metrics, plugins taking effect, resume, kill -9.

Most commands run in this process (``miles.cli.main``, what ``python -m miles.cli`` calls); a
subprocess only where the test needs one: a run to kill, and an installed plugin on PYTHONPATH."""
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from miles.cli import main

ROOT = Path(__file__).resolve().parents[1]

TINY = "tests/tiny.yaml"


def rows(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def miles(capsys, *args) -> tuple[int, str]:
    """``miles <args>`` in this process, on tests/tiny.yaml where args name it: (exit code, stdout)."""
    capsys.readouterr()
    code = main([str(ROOT / a) if a == TINY else a for a in args])
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """tests/tiny.yaml run to its end (6 steps, warm start first), by the CLI in a subprocess; the
    tests below only read it (or a copy)."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    r = subprocess.run([sys.executable, "-m", "miles.cli", "train", TINY, f"run.out_dir={out}"], cwd=ROOT,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_tiny_run_logs_every_step_and_evaluates(tiny_run):
    out = tiny_run
    got = rows(out)
    assert [g["step"] for g in got] == list(range(0, 7))
    assert "eval_accuracy" in got[0] and "reward_mean" not in got[0]
    for g in got[1:]:
        assert 0.0 <= g["reward_mean"] <= 1.0
        assert g["groups_kept"] + g["groups_dropped"] == 8
        if g["groups_kept"]:  # a step whose groups were all filtered out makes no update
            assert g["weight_sync_bytes"] > 0 and g["weight_version"] > 0
    assert [g["step"] for g in got if "eval_accuracy" in g] == [0, 3, 6]
    assert (out / "config.yaml").is_file() and (out / "warm_start.jsonl").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000004", "step_000006"]
    # step 0 holds the warm start's last weights, which it evaluated last: that evaluation is step 0's
    warm = [json.loads(line) for line in (out / "warm_start.jsonl").read_text().splitlines()]
    assert {k: v for k, v in warm[-1].items() if k.startswith("eval_")} == \
        {k: v for k, v in got[0].items() if k.startswith("eval_")}
    timeline = [json.loads(line) for line in (out / "telemetry" / "timeline.jsonl").read_text().splitlines()]
    assert sum(s[0] == "eval" for s in timeline[0]["spans"]) == len(warm)  # none more for step 0


def test_rerun_resumes_without_repeating(tiny_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(tiny_run, out)  # 6 steps, checkpoints at 4 and 6
    code, stdout = miles(capsys, "train", TINY, f"run.out_dir={out}", "run.steps=8")
    assert code == 0
    assert "resuming from step 6" in stdout
    assert "warm start" not in stdout  # the warm start is not redone
    assert [g["step"] for g in rows(out)] == list(range(0, 9))


def test_kill_9_mid_run_then_rerun_logs_each_step_once(tmp_path, capsys):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "miles.cli", "train", TINY, f"run.out_dir={out}", "run.steps=14",
           "run.checkpoint_every=3"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline:  # wait until a step past the first checkpoint is logged
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = len(metrics.read_text().splitlines())
    assert killed_at < 15, "the run finished before it could be killed"
    assert miles(capsys, *cmd[3:])[0] == 0  # the same command again
    assert [g["step"] for g in rows(out)] == list(range(0, 15))


JUDGE = """
        import json, os
        from miles import hookimpl
        LOG = os.environ["JUDGE_LOG"]

        def _write(kind, **kw):
            with open(LOG, "a") as f:
                f.write(json.dumps({"kind": kind, **kw}) + "\\n")

        @hookimpl
        def miles_reward(sample):
            return 1.0 if sample.response.startswith("1") else 0.0

        @hookimpl
        def miles_filter(group):
            if group.task.metadata["a"] % 2:
                _write("drop")
                return False
            return None

        @hookimpl
        def miles_on_step_end(step, metrics):
            _write("step", step=step, reward_mean=metrics.get("reward_mean"))
"""

LOSS_PLUGIN = """
from miles import hookimpl

@hookimpl
def miles_loss(batch, logprobs):
    # plain REINFORCE, with a marker metric to prove this loss was used
    loss = batch.token_mean(-batch.advantages * logprobs)
    return loss, {"custom_loss_marker": 42.0}
"""


def test_installed_plugin_hooks_and_launch_time_loss_take_effect(cli, tmp_path, install_dist):
    site = install_dist(tmp_path, "judge", "0.2.0", JUDGE)
    loss_file = tmp_path / "my_loss.py"
    loss_file.write_text(LOSS_PLUGIN)
    log = tmp_path / "judge.jsonl"
    out = tmp_path / "run"
    r = cli("train", TINY, "--plugin", str(loss_file), f"run.out_dir={out}", "run.steps=3",
            "algorithm.filter_zero_variance=false", "run.warm_start=null",
            env={"PYTHONPATH": str(site), "JUDGE_LOG": str(log)})
    assert r.returncode == 0, r.stderr[-3000:]
    got = {g["step"]: g for g in rows(out)}
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "step"] == [0, 1, 2, 3]
    drops = sum(e["kind"] == "drop" for e in events)
    assert drops == sum(got[s]["groups_dropped"] for s in (1, 2, 3)) and drops > 0
    for s in (1, 2, 3):
        assert got[s]["groups_kept"] + got[s]["groups_dropped"] == 8
        if got[s]["groups_kept"]:
            assert got[s]["custom_loss_marker"] == 42.0
    # the plugin's reward replaced the env's: eval accuracy counts responses starting with "1"
    assert all(e["reward_mean"] == got[e["step"]].get("reward_mean") for e in events if e["kind"] == "step")


def test_eval_and_export_give_a_folder_transformers_loads_with_the_same_logits(tiny_run, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, dest = tiny_run, tmp_path / "hf"
    code, stdout = miles(capsys, "eval", TINY, f"run.out_dir={out}")
    assert code == 0 and json.loads(stdout.splitlines()[-1])["step"] == 6
    assert 0.0 <= json.loads(stdout.splitlines()[-1])["eval_accuracy"] <= 1.0
    assert miles(capsys, "export", str(out), "--to", str(dest))[0] == 0
    model = AutoModelForCausalLM.from_pretrained(dest).eval()
    tok = AutoTokenizer.from_pretrained(dest)
    from miles_plugin_fsdp2.checkpoint import read_model  # the trainer checkpoints in DCP format

    state = read_model(str(out / "checkpoints" / "step_000006" / "trainer"))
    ids = torch.tensor([tok.encode("3+4=", add_special_tokens=False)])
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    ref = AutoModelForCausalLM.from_config(model.config)
    ref.load_state_dict(state)
    torch.testing.assert_close(model(ids).logits, ref.eval()(ids).logits, rtol=0, atol=0)
    assert miles(capsys, "export", str(tmp_path / "nope"), "--to", str(dest))[0] == 2


def test_disk_transport_end_to_end_with_verification(tmp_path, capsys):
    out = tmp_path / "run"
    assert miles(capsys, "train", TINY, f"run.out_dir={out}", "run.steps=2", "run.warm_start=null",
                 "sync.name=disk", "sync.verify=true", "algorithm.filter_zero_variance=false")[0] == 0
    got = rows(out)
    assert all(g["weight_sync_bytes"] > 0 for g in got[1:])
    assert (out / "weights" / "LATEST").read_text().strip().endswith("2")


def test_minibatches_recompute_old_logprobs_and_move_the_ratio(tmp_path, capsys):
    out, reward = tmp_path / "run", tmp_path / "first_char.py"
    # a reward a random model gets sometimes, so the advantages are not all zero
    reward.write_text("from miles import hookimpl\n@hookimpl\ndef miles_reward(sample):\n"
                      "    return float(sample.response[:1] in '01234')\n")
    assert miles(capsys, "train", TINY, "--plugin", str(reward), f"run.out_dir={out}", "run.steps=2",
                 "run.warm_start=null", "rollout.minibatches=2", "trainer.lr=0.01")[0] == 0
    got = rows(out)[1:]
    # the second optimizer step of a rollout batch sees a policy that already moved: ratio != 1
    assert all(abs(g["ppo_kl"]) > 0 for g in got)
    assert all(g["train_rollout_logprob_abs_diff"] >= 0 for g in got)


def test_async_run_pushes_weights_in_the_background_and_ends_on_the_last_version(tmp_path):
    """run.mode async: each step's push runs on a thread (the trainer only copies its weights),
    every step logs staleness and version, and the engine ends with the trainer's last weights."""
    from miles import make_plugin_manager
    import miles_wire as W
    from miles.config import apply_overrides, read_yaml, resolve
    from miles.loop import Loop

    pm = make_plugin_manager()
    cfg = resolve(pm, apply_overrides(read_yaml(str(ROOT / TINY)), [
        f"run.out_dir={tmp_path}", "run.mode=async", "run.steps=4", "run.warm_start=null",
        "algorithm.filter_zero_variance=false"]))  # an untrained model: every step updates
    loop = Loop(pm, cfg)
    history = loop.run()
    steps = [h for h in history if h["step"] > 0]
    assert all("staleness_mean" in h and h["weight_version"] == h["step"] for h in steps)
    assert all(h["staleness_max"] <= 1 for h in steps)  # rollout.max_staleness
    for h in steps:  # the staleness distribution of the step's kept groups
        fracs = {int(k.rsplit("_", 1)[1]): v for k, v in h.items() if k.startswith("staleness_frac_")}
        assert max(fracs) == h["staleness_max"] and abs(sum(fracs.values()) - 1) < 1e-9
        assert abs(sum(k * v for k, v in fracs.items()) - h["staleness_mean"]) < 1e-9
    # samples from the previous version are trained with importance weights (rollout.correct_stale)
    assert all("importance_weight_mean" in h for h in steps if h["staleness_max"] > 0)
    assert any("weight_push_seconds" in h for h in steps)  # the previous step's push, joined
    assert gc.get_freeze_count() == 0  # the run froze its objects for the GC, and let them go
    assert loop.mode.finish_push() == {}  # the last push was waited for
    assert loop.components.engine.weight_version == loop.version == 4
    want = {n: W.checksum(t) for n, t in loop.components.trainer.named_weights()}
    W.verify([loop.components.engine], want, loop.version)


def test_warm_start_lr_schedule_spans_the_warm_start(tmp_path, capsys):
    """The warm start's LR schedule runs over its own max_steps, not over the RL run's steps."""
    out = tmp_path / "run"
    assert miles(capsys, "train", TINY, f"run.out_dir={out}", "run.steps=2", "run.warm_start.max_steps=10",
                 "run.warm_start.min_steps=10", "run.warm_start.trainer.schedule=linear",
                 "run.warm_start.trainer.warmup_steps=0")[0] == 0
    logged = [json.loads(line) for line in (out / "warm_start.jsonl").read_text().splitlines()]
    # step k trains at lr * (1 - (k - 1) / 10); over run.steps=2 it would be 0 from step 3 on
    assert [g["step"] for g in logged] == [5, 10]
    assert [round(g["lr"] / 3e-3, 6) for g in logged] == [0.6, 0.1]
