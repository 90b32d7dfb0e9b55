"""The dashboard's routes and command line without a browser: the API key, incremental metric
rows, and bad arguments as clear errors (exit 2, no traceback)."""
import json
import os
import subprocess
import sys

from fastapi.testclient import TestClient
from miles.testing import assert_usage_error, listening_port, run_module
from miles_plugin_dashboard.app import build_app
from miles_plugin_dashboard.runs import RunView


def folder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in range(3)))
    return run


def test_the_key_is_required_and_the_browser_gets_a_cookie(tmp_path):
    c = TestClient(build_app([RunView(folder(tmp_path), "run")], api_key="k3y"))
    assert c.get("/api/runs").status_code == 401 and c.get("/").status_code == 401
    assert c.get("/api/runs", headers={"Authorization": "Bearer k3y"}).status_code == 200
    assert c.get("/api/runs", headers={"Authorization": "Bearer nope"}).status_code == 401
    r = c.get("/?key=k3y", follow_redirects=False)
    assert r.status_code == 303 and "key=" not in r.headers["location"]
    assert c.get("/api/runs").status_code == 200  # the cookie from the redirect


def test_metric_rows_come_incrementally(tmp_path):
    run = folder(tmp_path)
    c = TestClient(build_app([RunView(run, "run")]))
    first = c.get("/api/runs/0/metrics").json()
    assert [r["step"] for r in first["rows"]] == [0, 1, 2]
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "reward_mean": float("nan")}).replace("NaN", "null") + "\n")
    more = c.get(f"/api/runs/0/metrics?generation={first['generation']}&after=3").json()
    assert more["start"] == 3 and more["rows"] == [{"step": 3, "reward_mean": None}]
    assert c.get("/api/runs/5/metrics").status_code == 404
    status = c.get("/api/runs").json()[0]
    assert status["last_step"] == 3 and any("config.yaml is missing" in p for p in status["problems"])


def test_bad_arguments_are_clear_errors(tmp_path):
    env = {"MILES_API_KEY": ""}
    p = run_module("miles.cli", "dashboard", str(tmp_path), "--host", "0.0.0.0", env=env, timeout=120)
    assert_usage_error(p, "miles", "--host 0.0.0.0", "--api-key")
    with listening_port() as port:
        p = run_module("miles.cli", "dashboard", str(tmp_path), "--port", str(port), env=env, timeout=120)
    assert_usage_error(p, "miles", f"--port {port}", "0 picks a free one")
    p = subprocess.run([sys.executable, "-m", "miles.cli", "dashboard"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={**os.environ, **env})  # no ./runs there
    assert_usage_error(p, "miles", "no RUN_DIR given")
