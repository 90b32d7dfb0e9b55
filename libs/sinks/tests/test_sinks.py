"""miles_sinks: the run's config, numeric metrics, the points a resumed run must not log twice."""
import math

from miles_sinks import HeldPoints, config_text, earlier_rows, numeric, read_config


def test_config_passed_in_or_from_the_run_folder(tmp_path):
    assert read_config({"a": 1}, str(tmp_path)) == {"a": 1}
    assert read_config(None, str(tmp_path)) == {} and config_text(None, str(tmp_path)) is None
    (tmp_path / "config.yaml").write_text("run:\n  steps: 3\n")
    assert read_config(None, str(tmp_path)) == {"run": {"steps": 3}}
    assert config_text(None, str(tmp_path)) == "run:\n  steps: 3\n"
    assert config_text({"b": [1, 2]}, str(tmp_path)) == "b:\n- 1\n- 2\n"


def test_numeric_metrics():
    got = numeric({"a": 1, "b": True, "c": float("nan"), "d": "text", "e": None, "f": [1]})
    assert set(got) == {"a", "b", "c"} and got["a"] == 1.0 and got["b"] == 1.0 and math.isnan(got["c"])


def test_held_points_leave_out_only_what_the_store_has():
    held = HeldPoints([("r", 3), ("r", 4), ("acc", 4)])
    assert held.last_step == 4 and len(held) == 3
    assert held.fresh(3, {"r": 1.0, "loss": 2.0}) == {"loss": 2.0}
    assert held.fresh(4, {"r": 1.0, "acc": 0.5}) == {}
    assert held.fresh(5, {"r": 1.0}) == {"r": 1.0}
    assert HeldPoints().fresh(0, {"r": 1.0}) == {"r": 1.0} and HeldPoints().last_step == -1


def test_earlier_rows_of_metrics_jsonl(tmp_path):
    assert earlier_rows(str(tmp_path), 5) == []
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "r": 1}\n{"step": 0, "r": 0}\n[3]\n'
                                            '{"step": 4, "r": 4}\n{"step": 2, "r"')  # a line cut off
    assert earlier_rows(str(tmp_path), 4) == [(0, {"r": 0}), (1, {"r": 1})]
