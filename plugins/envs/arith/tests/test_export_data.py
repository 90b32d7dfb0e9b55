"""The arith env writes its data out as dataset files (for SFT from a file)."""
import json

from miles_plugin_arith.config import ArithConfig
from miles_plugin_arith.env import ArithEnv
from miles_plugin_arith.export_data import main


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_writes_disjoint_train_and_eval_files(tmp_path):
    assert main([str(tmp_path / "d"), "--digits", "1", "--eval-size", "20",
                 "--teacher-carry-accuracy", "1.0", "--demos-per-task", "2"]) == 0
    train, ev = read(tmp_path / "d" / "train.jsonl"), read(tmp_path / "d" / "eval.jsonl")
    assert len(ev) == 20 and len(train) == 2 * (100 - 20)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in ev}  # held out
    # a careful teacher (carry accuracy 1.0) is always right
    assert all(r["response"] == r["label"] for r in train + ev)
    a, b = map(int, ev[0]["prompt"].rstrip("=").split("+"))
    assert ev[0]["label"] == f"{a + b:02d}"


def test_sloppy_teacher_rows_and_parquet(tmp_path):
    import pyarrow.parquet as pq

    assert main([str(tmp_path / "p"), "--format", "parquet", "--teacher-carry-accuracy", "0.0"]) == 0
    rows = pq.read_table(tmp_path / "p" / "train.parquet").to_pylist()
    wrong = [r for r in rows if r["response"] != r["label"]]
    # every carry problem is answered without the carry (about 45% of 2-digit problems carry)
    assert 0.4 < len(wrong) / len(rows) < 0.5
    assert all(int(r["response"]) == int(r["label"]) - 10 for r in wrong)


def test_env_option_writes_once_and_rewrites_on_new_settings(tmp_path):
    out = tmp_path / "data"
    ArithEnv(ArithConfig(digits=1, eval_size=10, export_dir=str(out)))
    first = (out / "train.jsonl").stat().st_mtime_ns
    ArithEnv(ArithConfig(digits=1, eval_size=10, export_dir=str(out)))  # same settings: kept
    assert (out / "train.jsonl").stat().st_mtime_ns == first
    ArithEnv(ArithConfig(digits=1, eval_size=30, export_dir=str(out)))  # new split: rewritten
    assert len(read(out / "eval.jsonl")) == 30
