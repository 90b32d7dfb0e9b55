"""``sync.name=p2p`` end to end: a tiny recipe trained by the local launcher with one `miles serve`
engine process and two trainer ranks, every push written through NIXL (the buckets split between
the ranks) and verified by checksum."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def test_local_launcher_run_with_p2p_sync_and_verify(tmp_path):
    out = tmp_path / "run"
    # 20 KiB buckets: the tiny model's ~77 KiB make 4 buckets, two written by each trainer rank
    cmd = [sys.executable, "-m", "miles.cli", "train", str(ROOT / "tests" / "tiny.yaml"), f"run.out_dir={out}",
           "launcher.name=local", "launcher.engines=1", "launcher.trainer_ranks=2", "sync.name=p2p",
           "sync.verify=true", "sync.bucket_mb=0.02", "run.steps=3", "run.warm_start.max_steps=5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    pushed = [r for r in rows[1:] if r.get("weight_sync_bytes")]
    assert pushed and all(r["weight_sync_bytes"] > 0 and not r.get("weight_sync_failed") for r in pushed)
    assert "listening on" in (out / "logs" / "engine-0.log").read_text()
    # rank 1 made its own writes (only an agent that writes is ever made)
    assert "Initialized NIXL agent: miles-trainer" in (out / "logs" / "trainer-1.log").read_text()
