"""``benchmarks/speculative.py --quick``: the none / frozen / online table over a short run."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_table(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speculative.py"), "--quick", "--steps", "4",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    assert set(rows) == {"none", "frozen", "online"}
    assert rows["none"][5] == "-"  # no acceptance without a draft
    assert all(1.0 <= float(x) <= 4.0 for x in rows["online"][5:9] + rows["frozen"][5:9])
    assert lines[-1].startswith("last quarter online / frozen:")
