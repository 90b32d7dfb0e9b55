import pytest
from miles import ConfigError
from miles.config import apply_overrides, read_yaml


def test_overrides_parse_values_as_yaml_and_make_sections(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("run: {steps: 3}\ntrainer: {}\n")
    data = apply_overrides(read_yaml(str(f)), ["run.steps=7", "trainer.lr=2e-3", "run.warm_start=null",
                                               "rollout.stop=[1, 2]", "env.name=arith"])
    assert data == {"run": {"steps": 7, "warm_start": None}, "trainer": {"lr": 0.002},
                    "rollout": {"stop": [1, 2]}, "env": {"name": "arith"}}


def test_an_override_never_replaces_a_value_that_is_not_a_mapping(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer: 5\n")
    with pytest.raises(ConfigError, match=r"trainer.lr: trainer is 5, not a mapping"):
        apply_overrides(read_yaml(str(f)), ["trainer.lr=2e-3"])
    with pytest.raises(ConfigError, match=r"run.steps: run is 5, not a mapping"):
        apply_overrides({}, ["run=5", "run.steps=1"])


def test_bad_files_and_overrides_are_config_errors_that_name_them(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_yaml(str(tmp_path / "nope.yaml"))
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        read_yaml(str(tmp_path / "list.yaml"))
    with pytest.raises(ConfigError) as e:
        apply_overrides({}, ["noequals", "=3"])
    assert "noequals" in str(e.value) and "'=3'" in str(e.value)


def test_schema_problems_name_their_keys_and_are_collected():
    from pydantic import BaseModel, ConfigDict, Field
    from miles.config import section_mapping, validate_settings

    class Inner(BaseModel):
        model_config = ConfigDict(extra="forbid")
        depth: int = Field(1, gt=0)

    class Outer(BaseModel):
        model_config = ConfigDict(extra="forbid")
        lr: float = Field(1e-3, gt=0)
        inner: Inner | None = None

    problems = []
    assert validate_settings(Outer, "trainer", {"lr": 0.5}, problems).lr == 0.5 and problems == []
    assert validate_settings(Outer, "trainer", {"lr": -1, "inner": {"depht": 2}}, problems) is None
    assert problems[0].startswith("trainer.lr: Input should be greater than 0 (got -1)")
    assert problems[1] == "trainer.inner.depht: unknown key; allowed keys: depth"
    assert validate_settings(None, "sync", {"x": 1}, problems) is None
    assert problems[2] == "sync: takes no settings; unknown keys: x"
    assert section_mapping({"run": 5}, "run", problems) == {} and problems[3].startswith("run: must be a mapping")
