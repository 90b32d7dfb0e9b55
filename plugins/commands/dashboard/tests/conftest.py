"""One dashboard over three folders for the whole session: a live tiny run (paced so the page sees
it grow), a second short run beside it, and a folder with damaged and missing files."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from miles.testing import require_commands

TINY = """
model:
  name: hf
  config: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
           num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 16}
env: {name: arith, digits: 1, eval_size: 20}
rollout: {batch_size: 4, n: 4, max_new_tokens: 3}
algorithm: {name: grpo, filter_zero_variance: false}
trainer: {name: fsdp2, lr: 1.0e-3}
run: {steps: STEPS, out_dir: OUT, eval_every: 3, checkpoint_every: 2, threads: 1,
      telemetry: {devices_every: 0.5, samples: 3}}
"""
# a launch-time plugin that slows each step down, so two looks at the page are steps apart, and
# holds the run at a step's end while a HOLD file lies beside it (a test looks at the page meanwhile)
PACE = """
import time
from pathlib import Path
from miles import hookimpl

@hookimpl
def miles_on_step_end(step, metrics):
    time.sleep(0.6)
    while Path(__file__).with_name("HOLD").exists():
        time.sleep(0.1)
"""
EVIL = "from pathlib import Path\nPath(__file__).with_name('IMPORTED').write_text('ran')\n"


def chromium() -> str:
    if not shutil.which("chromium-browser"):
        require_commands({"chromium": "chromium"})  # Debian's package, installed on first use
    return shutil.which("chromium") or shutil.which("chromium-browser")


def browse(*args: str, budget_ms: int = 4000, timeout: float = 60) -> subprocess.CompletedProcess:
    # --no-sandbox: the tests run as root, where chromium's sandbox refuses to start
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--virtual-time-budget={budget_ms}", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)


def train(folder: Path, steps: int, *plugins: Path) -> subprocess.Popen:
    cfg = folder.with_suffix(".yaml")
    cfg.write_text(TINY.replace("STEPS", str(steps)).replace("OUT", str(folder)))
    args = [a for p in plugins for a in ("--plugin", str(p))]
    return subprocess.Popen([sys.executable, "-m", "miles.cli", "train", str(cfg), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def steps_logged(folder: Path) -> int:
    p = folder / "metrics.jsonl"
    return sum(1 for line in p.read_text().splitlines() if line.endswith("}")) if p.exists() else 0


def wait_for(cond, timeout: float = 120, what: str = "") -> None:
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, f"timed out waiting for {what}"
        time.sleep(0.2)


def bad_folder(root: Path) -> Path:
    """Metrics with a line that is not JSON and a last line cut short, no telemetry folder, and a
    config that lists a plugin file which would leave a mark if it were imported."""
    bad = root / "bad"
    bad.mkdir()
    rows = [json.dumps({"step": s, "reward_mean": 0.1 * s}) for s in range(4)]
    (bad / "metrics.jsonl").write_text("\n".join(rows[:2] + ['{"step": 2, "reward_m'] + rows[3:])
                                       + '\n{"step": 4, "rew')
    (bad / "evil.py").write_text(EVIL)
    (bad / "config.yaml").write_text(f"plugins: [{bad / 'evil.py'}]\nrun: {{steps: 10}}\n")
    return bad


@pytest.fixture(scope="session")
def dashboard(tmp_path_factory):
    root = tmp_path_factory.mktemp("dash")
    (root / "pace.py").write_text(PACE)
    live, short, bad = root / "live", root / "short", bad_folder(root)
    procs = [train(live, 14, root / "pace.py"), train(short, 3)]
    server = subprocess.Popen([sys.executable, "-m", "miles.cli", "dashboard", str(live), str(short), str(bad),
                               "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    url = re.search(r"http://\S+/", line)
    assert url, line + server.stderr.read()
    # test modules cannot import this file (importlib mode): the helpers travel with the fixture
    env = {"url": url.group(0), "root": root, "live": live, "short": short, "bad": bad, "procs": procs,
           "server": server, "pace": root / "pace.py", "browse": browse, "train": train, "wait_for": wait_for,
           "steps_logged": steps_logged}
    env["api"] = lambda path: httpx.get(env["url"].rstrip("/") + path, timeout=30).json()
    try:
        yield env
    finally:
        for p in env["procs"] + [server]:
            p.kill()
            p.wait()

