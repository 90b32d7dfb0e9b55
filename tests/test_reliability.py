"""Run folders under faults: exports that never delete, checksummed checkpoints, a full disk,
planted pickles, and a killed run resumed to bitwise the same weights."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from miles.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "tiny.yaml")
QUICK = ["run.warm_start=null", "run.threads=1"]
REWARD = """
from miles import hookimpl

@hookimpl
def miles_reward(sample):  # varied rewards, so every step trains
    return float(sum(sample.response_ids) % 3 == 0)
"""
CRASH = """
from miles import hookimpl

@hookimpl
def miles_on_step_end(step, metrics):
    if step == 3:
        raise RuntimeError("simulated crash after step 3 was logged")
"""


def rows(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def train(out: Path, *extra: str) -> int:
    return main(["train", TINY, f"run.out_dir={out}", *QUICK, *extra])


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run with checkpoints at steps 1 and 2."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train(out, "run.steps=2", "run.checkpoint_every=1") == 0
    return out


def copy_run(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def test_checkpoints_carry_checksums_of_every_file(finished):
    d = finished / "checkpoints" / "step_000002"
    files = json.loads((d / "state.json").read_text())["files"]
    on_disk = {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != "state.json"}
    assert set(files) == on_disk and "trainer/.metadata" in files
    assert all(len(sha) == 64 and size == (d / f).stat().st_size for f, (size, sha) in files.items())


def test_export_never_removes_what_it_did_not_write(finished, tmp_path, capfd, monkeypatch):
    run = copy_run(finished, tmp_path)
    before = tree(run)
    target_file = tmp_path / "a-file"
    target_file.write_text("mine")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    (busy / "config.json").write_text("{}")
    for to in (target_file, busy, run, run / "checkpoints"):
        assert main(["export", str(run), "--to", str(to)]) == 2
    err = capfd.readouterr().err
    assert "a-file is a file" in err and "is not empty" in err and "the run folder" in err
    assert target_file.read_text() == "mine" and (busy / "notes.txt").read_text() == "keep me"
    assert tree(run) == before
    # --force writes into the folder: same-named files replaced, nothing else touched
    assert main(["export", str(run), "--to", str(busy), "--force"]) == 0
    assert (busy / "notes.txt").read_text() == "keep me"
    assert json.loads((busy / "config.json").read_text())["model_type"] == "qwen2"
    assert (busy / "model.safetensors").is_file()
    # a failure half-way leaves no temp folder and no parent folder it made
    from miles_plugin_hf.spec import HFModelSpec

    def broken(self, named, tokenizer, path):
        os.makedirs(path)
        Path(path, "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(HFModelSpec, "save_pretrained", broken)
    new = tmp_path / "new" / "deeper" / "hf"
    assert main(["export", str(run), "--to", str(new)]) == 2
    assert "disk full" in capfd.readouterr().err
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "busy", "run"]
    assert tree(run) == before
    # a new subfolder of the run (the recipes' RUN/export) is a fine target
    monkeypatch.undo()
    assert main(["export", str(run), "--to", str(run / "export")]) == 0
    assert (run / "export" / "model.safetensors").is_file()
    assert {k: v for k, v in tree(run).items() if not k.startswith("export")} == before


def _damage_resume(out: Path, capfd, damage) -> None:
    """Damage the step-2 checkpoint, rerun: it is reported, the run resumes from step 1 and every
    metrics row appears once."""
    damage(out / "checkpoints" / "step_000002" / "trainer")
    capfd.readouterr()
    assert train(out, "run.steps=2", "run.checkpoint_every=1") == 0
    text = capfd.readouterr()
    assert "checkpoint" in text.err and "step_000002 is damaged" in text.err, text.err[-2000:]
    assert "resuming from step 1" in text.out
    assert [r["step"] for r in rows(out)] == [0, 1, 2]


def test_damaged_newest_checkpoint_is_reported_and_an_older_one_used(finished, tmp_path, capfd):
    out = copy_run(finished, tmp_path)

    def flip(trainer: Path) -> None:  # random bytes inside a tensor file, size unchanged
        f = next(trainer.glob("*.distcp"))
        data = bytearray(f.read_bytes())
        data[len(data) // 2:len(data) // 2 + 64] = os.urandom(64)
        f.write_bytes(bytes(data))
    _damage_resume(out, capfd, flip)
    _damage_resume(out, capfd, lambda t: (t / ".metadata").unlink())
    _damage_resume(out, capfd, lambda t: os.truncate(next(t.glob("*.distcp")), 100))


class _Plant:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _reseal(ckpt: Path) -> None:
    """Rewrite the checksums, as an attacker who planted a file would."""
    state = json.loads((ckpt / "state.json").read_text())
    import hashlib

    for rel in state["files"]:
        data = (ckpt / rel).read_bytes()
        state["files"][rel] = [len(data), hashlib.sha256(data).hexdigest()]
    (ckpt / "state.json").write_text(json.dumps(state))


def test_planted_pickles_do_not_run_on_export_or_resume(finished, tmp_path, capfd):
    out = copy_run(finished, tmp_path)
    marker = tmp_path / f"ran-{uuid.uuid4().hex}"
    ckpt = out / "checkpoints" / "step_000002"
    (ckpt / "trainer" / ".metadata").write_bytes(pickle.dumps(_Plant(marker)))
    _reseal(ckpt)
    assert main(["export", str(out), "--to", str(tmp_path / "hf")]) == 2
    assert "unsafe .metadata" in capfd.readouterr().err
    assert train(out, "run.steps=3") == 2
    assert not marker.exists() and not (tmp_path / "hf").exists()
    # a non-tensor item of a DCP checkpoint (where the optimizer keeps its hyper-parameters)
    import torch.distributed.checkpoint as dcp
    from miles import MilesError
    from miles_safeload import SafeReader

    dcp.save({"x": _Plant(marker), "w": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    reader = SafeReader(str(tmp_path / "dcp"))
    with pytest.raises(BaseException):  # noqa: B017 (DCP wraps what the reader raised)
        dcp.load({"x": None, "w": torch.zeros(2)}, storage_reader=reader, no_dist=True)
    assert isinstance(reader.refused, MilesError) and "not plain data" in str(reader.refused)
    assert not marker.exists()


def test_killed_run_resumes_to_bitwise_the_same_weights(tmp_path, capfd):
    from miles_plugin_fsdp2.checkpoint import read_model

    reward, crash = tmp_path / "reward.py", tmp_path / "crash.py"
    reward.write_text(REWARD)
    crash.write_text(CRASH)
    args = ["run.steps=4", "run.checkpoint_every=2", "--plugin", str(reward)]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train(straight, *args) == 0
    assert train(resumed, *args, "--plugin", str(crash)) == 2  # after step 3, before its checkpoint
    assert [r["step"] for r in rows(resumed)] == [0, 1, 2, 3]
    capfd.readouterr()
    assert train(resumed, *args) == 0
    assert "resuming from step 2" in capfd.readouterr().out
    a, b = (read_model(str(o / "checkpoints" / "step_000004" / "trainer")) for o in (straight, resumed))
    start = read_model(str(straight / "checkpoints" / "step_000002" / "trainer"))
    assert any(not torch.equal(a[k], start[k]) for k in a), "steps 3-4 did not train"
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    drop = ("seconds", "tokens_per_second", "tokens_per_sec", "_per_s", "mfu", "tflops")  # wall-clock readings
    clean = [[{k: v for k, v in r.items() if not any(d in k for d in drop)} for r in rows(o)]
             for o in (straight, resumed)]
    assert clean[0] == clean[1]


def test_misspelled_hook_in_a_launch_time_plugin_is_named(tmp_path, capfd):
    plugin = tmp_path / "typo.py"
    plugin.write_text("from miles import hookimpl\n\n@hookimpl\ndef miles_rewrd(sample):\n    return 1.0\n")
    assert train(tmp_path / "run", "--plugin", str(plugin)) == 2
    err = capfd.readouterr().err
    assert f"plugin {plugin} implements unknown hook 'miles_rewrd'; did you mean miles_reward?" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
