"""The local launcher end to end: trainer ranks and engine workers as processes, supervised.

Each test starts real processes (`miles train` ranks, `miles serve` workers) on a tiny config and
checks the run's outcome, the launcher's messages, and that no process of the run is left.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
TINY = str(ROOT / "tests" / "tiny.yaml")


def rows(out):
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_processes(out) -> list[tuple[int, str]]:
    """(pid, cmdline) of every live process whose command line mentions the run folder."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (d / "stat").read_text().split()[2]
            except OSError:
                continue
            if str(out) in cmd and state != "Z":
                found.append((int(d.name), cmd))
    return found


def launch(out, *overrides, **kw):
    cmd = [sys.executable, "-m", "miles.cli", "train", TINY, f"run.out_dir={out}", "launcher.name=local",
           "run.warm_start.max_steps=5", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def finish(proc, timeout=400):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out, err


def wait_for(pred, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError("timed out")


@pytest.mark.parametrize("transport,mode,ranks", [("disk", "sync", 1), ("broadcast", "sync", 2),
                                               ("broadcast", "async", 1)])
def test_killed_engine_is_restarted_resynced_and_no_group_is_lost(tmp_path, transport, mode, ranks):
    """Also two trainer ranks broadcasting to an engine process (broadcast, sync): both ranks run,
    every push verified, before and after the engine's restart."""
    out = tmp_path / "run"
    # 30 steps: the kill below must come while the run still needs the engine (steps take ~0.03 s
    # here, and a finished trainer rank exits at once)
    proc = launch(out, "launcher.engines=1", f"launcher.trainer_ranks={ranks}", "run.steps=30",
                  f"sync.name={transport}", "sync.verify=true", f"run.mode={mode}")
    wait_for(lambda: len(rows(out)) >= 3, proc)
    engines = [pid for pid, cmd in run_processes(out) if " serve " in cmd]
    assert len(engines) == 1
    delay = random.uniform(0.0, 0.5)  # a random moment: mid-rollout, mid-push or between them
    print(f"killing the engine {delay:.3f} s after step 2 was logged")
    time.sleep(delay)
    os.kill(engines[0], signal.SIGKILL)
    rc, stdout, err = finish(proc)
    assert rc == 0, err[-3000:]
    assert "was killed by SIGKILL; restarting it (1/3)" in err
    # the restarted engine gets the current weights: re-synced by the loop when a rollout finds it
    # without them (also when it was back before any request failed: its answer reports its boot
    # weights), or by the next push (which waits for it); sync.verify checks every push.
    got = rows(out)
    assert [r["step"] for r in got] == list(range(31))  # every step once
    for r in got[1:]:  # every step trained on exactly the groups it asked for, none twice
        if mode == "sync":
            assert r["groups_kept"] + r["groups_dropped"] == 8
        else:  # async: batch_size groups kept, others dropped by the filter or as stale
            assert r["groups_kept"] == 8 and r["staleness_max"] <= 1
    assert (out / "logs" / "trainer-1.log").is_file() == (ranks == 2)
    assert run_processes(out) == []


def test_engine_that_keeps_dying_ends_the_run_with_its_name(tmp_path):
    out = tmp_path / "run"
    proc = launch(out, "launcher.engines=1", "launcher.max_engine_restarts=0", "run.steps=200")
    wait_for(lambda: len(rows(out)) >= 2, proc)
    for pid, cmd in run_processes(out):
        if " serve " in cmd:
            os.kill(pid, signal.SIGKILL)
    rc, _, err = finish(proc)
    assert rc == 2
    assert "miles: error: engine 0 (pid" in err and "was killed by SIGKILL" in err
    assert "engine-0.log" in err and "Traceback" not in err.split("last lines:")[0]
    assert run_processes(out) == []


def test_dead_trainer_rank_is_named_and_nothing_is_left(tmp_path):
    out = tmp_path / "run"
    proc = launch(out, "launcher.engines=1", "run.steps=200")
    wait_for(lambda: len(rows(out)) >= 2, proc)
    trainers = [pid for pid, cmd in run_processes(out) if " train " in cmd and "trainer.yaml" in cmd]
    os.kill(trainers[0], signal.SIGKILL)
    rc, _, err = finish(proc)
    assert rc == 2
    assert "miles: error: trainer rank 0 (pid" in err and "was killed by SIGKILL" in err
    assert run_processes(out) == []


def test_ctrl_c_checkpoints_stops_children_and_rerun_resumes(tmp_path):
    out = tmp_path / "run"
    proc = launch(out, "launcher.engines=1", "run.steps=200", "run.checkpoint_every=1000")
    wait_for(lambda: len(rows(out)) >= 3, proc)
    proc.send_signal(signal.SIGINT)
    rc, _, err = finish(proc, timeout=120)
    assert rc == 130, err[-3000:]
    assert "SIGINT: trainers checkpointed and stopped; rerun the same command to resume" in err
    last = rows(out)[-1]["step"]
    assert (out / "checkpoints" / f"step_{last:06d}").is_dir()
    assert run_processes(out) == []
    rc, stdout, err = finish(launch(out, "launcher.engines=1", f"run.steps={last + 1}",
                                    "run.checkpoint_every=1000"))
    assert rc == 0, err[-3000:]
    assert f"resuming from step {last}" in stdout
    assert [r["step"] for r in rows(out)] == list(range(last + 2))


def test_two_colocated_ranks_then_resume_at_world_size_one(tmp_path):
    out = tmp_path / "run"
    rc, _, err = finish(launch(out, "launcher.trainer_ranks=2", "launcher.engines=0", "run.steps=2",
                               "run.checkpoint_every=2"))
    assert rc == 0, err[-3000:]
    r = subprocess.run([sys.executable, "-m", "miles.cli", "train", TINY, f"run.out_dir={out}",
                        "run.steps=4", "run.warm_start.max_steps=5"], cwd=ROOT, capture_output=True,
                       text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from step 2" in r.stdout
    assert [g["step"] for g in rows(out)] == [0, 1, 2, 3, 4]


RECORD_SAMPLES = '''
import json
from miles import hookimpl


@hookimpl
def miles_filter(group):
    with open({path!r}, "a") as f:
        for s in group.samples:
            f.write(json.dumps({{"versions": s.weight_versions, "version": s.weight_version,
                                 "tokens": len(s.response_ids), "logprobs": len(s.logprobs),
                                 "mask": len(s.loss_mask)}}) + "\\n")
'''


def test_async_partial_rollout_resumes_in_flight_requests_on_new_weights(tmp_path):
    """Also the disaggregated engine process itself: the tensor transport's pushes to it, verified
    by checksum, its log, the trainers' launch config, and a clean exit with nothing left."""
    out, seen = tmp_path / "run", tmp_path / "samples.jsonl"
    plugin = tmp_path / "record_samples.py"
    plugin.write_text(RECORD_SAMPLES.format(path=str(seen)))
    # an untrained model (no warm start) samples long responses, on the engine's slower generic
    # path: the engine, not the trainer, is the bottleneck, so a weight push finds a batch decoding
    rc, _, err = finish(launch(out, "launcher.engines=1", "launcher.engine_threads=1", "run.steps=6",
                               "run.mode=async", "rollout.in_flight=resume", "run.warm_start=null",
                               "engine.impl=hf", "model.config.max_position_embeddings=128",
                               "rollout.max_new_tokens=64", "algorithm.filter_zero_variance=false",
                               "sync.name=tensor", "sync.verify=true", f"plugins=[{plugin}]"))
    assert rc == 0, err[-3000:]
    assert "restarted" not in err, err[-3000:]  # aborted requests must not read as a server restart
    got = rows(out)
    assert [r["step"] for r in got] == list(range(7))  # every step once
    samples = [json.loads(line) for line in seen.read_text().splitlines()]
    for s in samples:
        assert s["tokens"] == s["logprobs"] == s["mask"] and 0 < s["tokens"] <= 64
        assert s["versions"] == sorted(s["versions"]) and s["version"] == s["versions"][0]
    resumed = [s for s in samples if len(s["versions"]) > 1]
    assert resumed and all(len(set(s["versions"])) >= 2 for s in resumed)
    assert sum(r["resumed_samples"] for r in got[1:]) > 0
    assert all(r["weight_sync_bytes"] > 0 for r in got[1:] if r["groups_kept"])
    assert "listening on" in (out / "logs" / "engine-0.log").read_text()
    assert (out / "launch" / "trainer.yaml").is_file()
    assert run_processes(out) == []
