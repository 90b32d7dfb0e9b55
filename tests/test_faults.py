"""Stopping a run on purpose: SIGTERM/SIGINT finish the step, checkpoint, and exit non-zero."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
TINY = "tests/tiny.yaml"


def rows(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def wait_rows(path: Path, count: int, proc, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        assert proc.poll() is None, "the run ended before it could be signalled"
        time.sleep(0.05)
    raise AssertionError(f"{path} never reached {count} rows")


def _interrupt(cmd, out: Path, sig, after_rows: int) -> tuple[int, str]:
    """Start ``cmd``, send ``sig`` once metrics.jsonl has ``after_rows`` rows, and check the exit:
    the signal's code, one summary line, and the finished step's checkpoint. Returns that step."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_rows(out / "metrics.jsonl", after_rows, proc)
        proc.send_signal(sig)
        stdout, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err[-2000:]
    last = rows(out)[-1]["step"]
    summary = [line for line in err.splitlines() if line.startswith("miles: error:")]
    assert summary == [f"miles: error: {sig.name} after step {last}: checkpoint written; rerun the same "
                       f"command to resume from {out}"], err[-2000:]
    assert "Traceback" not in err
    assert (out / "checkpoints" / f"step_{last:06d}" / "state.json").is_file()
    return last, stdout


def test_signal_checkpoints_the_finished_step_and_rerun_resumes(tmp_path):
    """SIGTERM stops the first run and SIGINT its rerun (each checkpoints its finished step); a
    third run resumes from the SIGINT checkpoint. One chain of runs covers both signals, each
    followed by a resume, with one interpreter start fewer than a chain per signal."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "miles.cli", "train", TINY, f"run.out_dir={out}", "run.steps=40",
           "run.checkpoint_every=100", "run.warm_start.max_steps=5"]
    first, _ = _interrupt(cmd, out, signal.SIGTERM, 3)
    assert 2 <= first < 40
    # the rerun truncates the killed run's rows past its checkpoint (none here) and appends: 3 more
    second, stdout = _interrupt(cmd, out, signal.SIGINT, first + 4)
    assert f"resuming from step {first}" in stdout
    assert first + 3 <= second < 40
    assert [g["step"] for g in rows(out)] == list(range(0, second + 1))
    r = subprocess.run([*cmd, "run.steps=" + str(second + 2)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resuming from step {second}" in r.stdout
    assert [g["step"] for g in rows(out)] == list(range(0, second + 3))


NAN_LOSS = '''
import os
from miles import hookimpl
CALLS = {"rl": 0}
BAD = {int(x) for x in os.environ["NAN_STEPS"].split(",")}

@hookimpl
def miles_loss(batch, logprobs):
    if not batch.samples[0].logprobs:  # warm-start (supervised) batches keep their loss
        return None
    CALLS["rl"] += 1
    if CALLS["rl"] in BAD or -1 in BAD:
        return (logprobs * float("nan")).sum(), {}
    return None
'''


def _nan_run(tmp_path, bad: str, steps: int):
    plugin = tmp_path / "nan_loss.py"
    plugin.write_text(NAN_LOSS)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "miles.cli", "train", TINY, f"run.out_dir={out}", f"run.steps={steps}",
           "run.warm_start.max_steps=5", "algorithm.filter_zero_variance=false", "--plugin", str(plugin)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "NAN_STEPS": bad})
    return r, out


def test_nan_steps_are_skipped_and_counted_and_k_in_a_row_end_the_run(tmp_path):
    """One run covers both: the lone NaN step 2 is skipped and counted and the weights stay finite
    (step 3 trains), then steps 4-6 in a row (``run.max_nonfinite_steps`` 3) checkpoint and end
    the run; the lone step before them must not count towards the three."""
    r, out = _nan_run(tmp_path, "2,4,5,6", steps=20)
    assert r.returncode == 2, r.stderr[-2000:]
    got = {g["step"]: g for g in rows(out)}
    assert got[2].get("nonfinite_skipped") == 1.0 and "nonfinite_skipped" not in got[3]
    assert [got[s]["nonfinite_steps"] for s in (1, 2, 3, 4, 5, 6)] == [0, 1, 1, 2, 3, 4]
    assert all(v == v for v in got[3].values() if isinstance(v, float))  # weights stayed finite
    assert ("miles: error: 3 training steps in a row (steps 4-6) had a NaN/inf loss or gradient and "
            "were skipped; the last good weights are checkpointed at step 6") in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert (out / "checkpoints" / "step_000006" / "state.json").is_file()
    assert sorted(got) == [0, 1, 2, 3, 4, 5, 6]
