"""``trainer.world_size: N`` with no launcher runs N local FSDP2 ranks (the pinned contract)."""
import json
from pathlib import Path

from miles.config import apply_overrides, read_yaml, resolve
from miles.plugins import make_plugin_manager

TINY = str(Path(__file__).with_name("tiny.yaml"))


def test_world_size_without_a_launcher_selects_the_local_launcher():
    pm = make_plugin_manager()
    cfg = resolve(pm, apply_overrides(read_yaml(TINY), ["trainer.world_size=2"]))
    assert cfg.name("launcher") == "local"
    settings = cfg.settings("launcher")
    assert settings.trainer_ranks == 2 and settings.engines == 0  # the engine stays in rank 0
    assert resolve(pm, read_yaml(TINY)).name("launcher") is None  # one rank: no launcher at all


def test_two_ranks_from_one_command(cli, tmp_path):
    out = tmp_path / "run"
    r = cli("train", TINY, f"run.out_dir={out}", "trainer.world_size=2", "run.steps=2", "run.warm_start=null",
            timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    # rank 0 is the console; rank 1 ran in its own process, with its own log
    assert "trainer-1.log" in {p.name for p in (out / "logs").iterdir()}
    assert "step 2/2" in r.stdout
