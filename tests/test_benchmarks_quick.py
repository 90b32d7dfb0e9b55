"""Every script in benchmarks/ runs its ``--quick`` smoke mode, as a user runs it, and prints its
figure line: a benchmark that no longer runs (a config key a mode refuses, a moved function) fails
here instead of when someone needs its figure (those in ``OWN_TEST`` run in a test of their own).
Two scripts run at a time; together they use about 120 s of CPU (the async, launcher and mismatch
runs the most), so the wall time is about half of that on an idle 2-core machine and more on a
busy one."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def scripts(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """script -> (extra arguments, the text its figure line holds). Output folders go to ``tmp``."""
    return {
        "async_vs_sync": (["--out", str(tmp / "async")], "async_vs_sync samples/s ratio"),
        "architectures": ([], "architectures: 3/3 families measured"),
        "cpu_gemm": ([], "weight gradient (MKL)"),
        "dashboard_overhead": ([], "ratio on/off:"),
        "diffusion_sampling": ([], "diffusion_sampling images/s ratio"),
        "engine_profile": ([], "engine_profile: 1 families profiled"),
        "engine_vs_hf": ([], "engine_vs_hf tokens/s ratio"),
        "grpo_step_vs_trl": ([], "grpo_step_vs_trl:"),
        "launcher_overhead": ([], "launcher_overhead ray/local step time ratio"),
        "megatron_experts": ([], "megatron_experts grouped/loop step time ratio"),
        "mismatch": ([], "R3 mean-diff reduction"),
        "quickstart_vs_sft": (["--out", str(tmp / "qs")], "quickstart_vs_sft: GRPO gain"),
        "trainer_megatron_vs_fsdp2": ([], "trainer "),
        "weight_sync": ([], "weight_sync ratios vs raw"),
    }


# scripts whose --quick run has a test of its own that checks the table it prints: running them
# here as well would only repeat that run (precision's is ~30 s of CPU, serve_hostile's ~40 s of wall)
OWN_TEST = {"precision": "test_precision_benchmark.py", "serve_hostile": "test_serve_hostile.py",
            "speculative": "test_speculative_benchmark.py"}


def run(name: str, extra: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--quick", *extra], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return p, time.perf_counter() - t0


def _trl() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def test_every_benchmark_runs_its_quick_mode(tmp_path, capfd):
    table = scripts(tmp_path)
    every = sorted((ROOT / "benchmarks").glob("*.py"))
    lacking = [p.name for p in every if '"--quick"' not in p.read_text()]
    assert not lacking, f"{lacking}: every benchmark needs a --quick smoke mode"
    for name, test in OWN_TEST.items():
        assert f'"{name}.py"), "--quick"' in (Path(__file__).with_name(test)).read_text(), (name, test)
    missing = [p.stem for p in every if p.stem not in table and p.stem not in OWN_TEST]
    if missing:  # a new script: its quick run belongs in the table above, with its figure line
        print(f"note: not run here yet: {', '.join(missing)}")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(table, pool.map(lambda n: run(n, table[n][0]), table)))
    wall = time.perf_counter() - t0
    failures = []
    for name, (p, seconds) in done.items():
        said = table[name][1]
        if name == "grpo_step_vs_trl" and not _trl():  # TRL is installed for that benchmark only
            ok = p.returncode == 1 and "pip install trl" in p.stderr and "Traceback" not in p.stderr
        else:
            ok = p.returncode == 0 and said in p.stdout and "Traceback" not in p.stdout + p.stderr
        if not ok:
            failures.append(f"{name} (exit {p.returncode}, {seconds:.0f} s):\n{p.stdout[-1500:]}\n{p.stderr[-2500:]}")
    with capfd.disabled():
        print(f"\nbenchmarks --quick: {len(done)} scripts in {wall:.0f} s wall; " +
              ", ".join(f"{n} {s:.0f}s" for n, (_, s) in done.items()))
    assert not failures, "\n\n".join(failures)
