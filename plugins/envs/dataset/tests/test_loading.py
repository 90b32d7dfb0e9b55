"""Prompt files in every format through Hugging Face datasets, the split and shuffle, and the
errors for bad rows (file, row and key named)."""
import json

import pytest
from miles import MilesError
from miles_plugin_dataset.config import DatasetConfig
from miles_plugin_dataset.env import DatasetEnv
from pydantic import ValidationError

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3} for i in range(20)]


def write(path, rows):
    if path.suffix in (".parquet", ".arrow"):
        import datasets

        ds = datasets.Dataset.from_list(rows)
        if path.suffix == ".parquet":
            ds.to_parquet(str(path))
        else:  # an Arrow stream file, as datasets' own cache files are
            import pyarrow as pa

            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, ds.data.table.schema) as w:
                w.write_table(ds.data.table)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def env(**settings):
    return DatasetEnv(DatasetConfig(**settings), seed=0)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".arrow"])
def test_every_format_gives_the_same_tasks(tmp_path, suffix):
    e = env(train_files=[write(tmp_path / f"train{suffix}", ROWS)], eval_fraction=0.25, system_prompt="Be brief.")
    train, evals = e.tasks("train"), e.tasks("eval")
    assert len(train) == 15 and len(evals) == 5
    assert not {t.id for t in train} & {t.id for t in evals}
    t = next(t for t in train + evals if t.id == f"train{suffix}:4")  # file:row, 1-based
    assert t.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 3?"}]
    assert t.label == "6" and t.metadata == {"level": 0}


def test_shuffle_follows_the_seed_and_eval_files_replace_the_fraction(tmp_path):
    f = write(tmp_path / "t.jsonl", ROWS)
    order = lambda **kw: [t.id for t in env(train_files=[f], **kw).tasks("train")]  # noqa: E731
    assert order(data_seed=1) == order(data_seed=1) != order(data_seed=2)
    assert order(shuffle=False, eval_files=[f])[:3] == ["t.jsonl:1", "t.jsonl:2", "t.jsonl:3"]
    e = env(train_files=[f], eval_files=[write(tmp_path / "e.jsonl", ROWS[:4])], eval_limit=3)
    assert len(e.tasks("train")) == 20 and len(e.tasks("eval")) == 3


def test_chat_messages_nested_labels_and_raw_prompts(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}, "src": "a"}]
    f = write(tmp_path / "verl.parquet", rows * 3)
    t = env(train_files=[f], label_key="reward_model.ground_truth", system_prompt="Think.").tasks("train")[0]
    assert t.prompt[0] == {"role": "system", "content": "Think."} and t.label == "4" and t.metadata == {"src": "a"}
    raw = env(train_files=[write(tmp_path / "r.jsonl", ROWS)], chat_template=False, system_prompt="Q:",
              prompt_template="{prompt} Answer:", metadata_keys=["level"]).tasks("train")[0]
    assert raw.prompt.startswith("Q:\nWhat is ") and raw.prompt.endswith("? Answer:")


@pytest.mark.parametrize("rows,words", [
    ([{"question": "x", "answer": "1"}], ["bad.jsonl row 1", "no key 'prompt' (env.prompt_key)", "question, answer"]),
    (ROWS[:2] + [{"prompt": "x", "answer": None}], ["bad.jsonl row 3", "key 'answer'", "missing or null"]),
    (ROWS[:1] + [{"prompt": "x", "level": 1}], ["bad.jsonl row 2", "key 'answer'", "missing or null"]),
    ([{"prompt": 7, "answer": "1"}], ["bad.jsonl row 1", "key 'prompt'", "text or a list of chat messages", "int 7"]),
    ([{"prompt": [{"role": "user"}], "answer": "1"}], ["row 1", "message 0"]),
    ([{"prompt": "  ", "answer": "1"}], ["row 1", "empty text"]),
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": {"x": 1}}],
     ["bad.jsonl row 2", "key 'answer'", "is dict", "compares text or numbers"]),
])
def test_bad_rows_name_the_file_row_and_key(tmp_path, rows, words):
    with pytest.raises(MilesError) as e:
        env(train_files=[write(tmp_path / "bad.jsonl", rows)], eval_files=[write(tmp_path / "ok.jsonl", ROWS)])
    for w in words:
        assert w in str(e.value), str(e.value)


def test_empty_files_splits_and_bad_settings(tmp_path):
    ok = write(tmp_path / "ok.jsonl", ROWS)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(MilesError, match="empty.jsonl (has no rows|cannot be read)"):
        env(train_files=[str(tmp_path / "empty.jsonl")], eval_files=[ok])
    with pytest.raises(MilesError, match="env.train_files: .*nope.jsonl does not exist"):
        env(train_files=[str(tmp_path / "nope.jsonl")])
    with pytest.raises(MilesError, match="not a .jsonl, .json, .parquet or .arrow file"):
        env(train_files=[str(tmp_path / "x.csv")])
    with pytest.raises(MilesError, match="leaves none to train on"):
        env(train_files=[write(tmp_path / "one.jsonl", ROWS[:1])])
    msgs = write(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}] * 3)
    with pytest.raises(MilesError, match="m.jsonl row 1: .*chat messages but env.chat_template is false"):
        env(train_files=[msgs], chat_template=False)
    with pytest.raises(ValidationError, match="reward 'regex' needs pattern"):
        DatasetConfig(train_files=[ok], reward="regex")
    with pytest.raises(ValidationError, match="base_ur: Extra inputs"):
        DatasetConfig(train_files=[ok], reward="judge", reward_settings={"base_ur": "x"})
    assert DatasetConfig(train_files=ok).train_files == [ok]  # one file may be given as a string


def test_a_bad_row_stops_miles_train_with_one_line_and_no_traceback(tmp_path):
    import subprocess
    import sys

    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({
        "model": {"name": "hf", "config": {"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32,
                                           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}},
        "env": {"name": "dataset", "train_files": write(tmp_path / "t.jsonl", ROWS[:3] + [{"prompt": "x"}])},
        "run": {"out_dir": str(tmp_path / "run")}}))
    r = subprocess.run([sys.executable, "-m", "miles.cli", "train", str(cfg)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "t.jsonl row 4: key 'answer' (env.label_key) is missing or null" in r.stderr
