"""The dashboard in a real headless browser (Debian's chromium) over a live tiny run, a second run
beside it and a damaged folder: curves grow, the timeline shows the step's spans, sampled tokens
are coloured by their log-prob mismatch, the page follows the run's end, a kill, and its resume."""
import re

import numpy as np
from PIL import Image

WINDOW = "--window-size=1300,4200"


def dump(env) -> str:
    out = env["browse"]("--dump-dom", env["url"])
    assert 'data-polls="' in out.stdout, out.stderr[-2000:]  # the script ran and polled at least once
    return out.stdout


def points(dom: str, key: str) -> list[int]:
    m = re.search(rf'id="chart-{key}" data-points="([0-9,]*)"', dom)
    assert m, f"no chart of {key}"
    return [int(x or 0) for x in m.group(1).split(",")]


def shot(env, name: str) -> np.ndarray:
    path = env["root"] / name
    out = env["browse"](f"--screenshot={path}", WINDOW, env["url"])
    assert path.is_file(), out.stderr[-2000:]
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def near(img: np.ndarray, rgb, tol=30) -> int:
    return int((np.abs(img - np.array(rgb)).max(axis=-1) <= tol).sum())


def test_live_run_grows_with_timeline_and_coloured_tokens(dashboard):
    env, live = dashboard, dashboard["live"]
    env["wait_for"](lambda: env["steps_logged"](live) >= 4, 180, "the live run's first steps")
    hold = env["root"] / "HOLD"  # the run waits at its next step's end: a slow first look leaves it steps to go
    hold.touch()
    try:
        dom1, img1 = dump(env), shot(env, "early.png")
    finally:
        hold.unlink()
    first = points(dom1, "reward_mean")[0]
    env["wait_for"](lambda: env["steps_logged"](live) >= first + 5, 120, "more steps")
    dom2, img2 = dump(env), shot(env, "later.png")
    assert points(dom2, "reward_mean")[0] >= first + 3, (first, points(dom2, "reward_mean"))
    assert points(dom2, "mfu")[0] >= 1 and points(dom2, "tokens_per_gpu_per_s")[0] >= 1
    assert (img1 != img2).any(axis=-1).sum() > 500  # the screenshots changed as the run went on
    assert near(img2, (37, 99, 235)) > 1500  # the live run's colour: its curves are drawn
    assert points(dom2, "reward_mean")[1] == 3  # the short run beside it: its training steps 1-3
    spans = set(re.findall(r'class="span" data-name="(\w+)"', dom2))
    assert {"rollout", "generate", "reward", "filter", "train", "weight_sync"} <= spans, spans
    alphas = [float(a) for a in re.findall(r'class="tok" style="background:rgba\(220,38,38,([0-9.]+)\)', dom2)]
    assert alphas, "no sampled token is coloured by its mismatch"
    reddish = (img2[..., 0] > 200) & (img2[..., 1] < 215) & (img2[..., 0] - img2[..., 2] > 30)
    assert reddish.sum() > 100  # the coloured tokens are on screen
    assert 'id="dev-cpu"' in dom2 and 'id="dev-rss"' in dom2  # a CPU run: CPU and memory charts
    # the torch engine's load readings: a table of the latest, and its tokens/s and KV cache over time
    assert 'id="eng-table"' in dom2 and 'id="eng-tokens"' in dom2 and 'id="eng-kv"' in dom2


def test_engine_readings_reach_the_api(dashboard):
    """The live run's recorder reads the in-process torch engine (EngineStats) every 0.5 s; the
    devices route returns those readings, tokens/s worked out between two of them."""
    env = dashboard
    env["wait_for"](lambda: env["steps_logged"](env["live"]) >= 3, 180, "the live run's first steps")
    rows = [r for r in env["api"]("/api/runs/0/devices") if r.get("engines")]
    assert rows and not any("engines_error" in r for r in rows)
    readings = [r["engines"][0] for r in rows]
    assert {e["name"] for e in readings} == {"torch (cpu)"}
    for e in readings:
        assert e["running"] >= 0 and e["queued"] >= 0 and 0 <= e.get("kv_cache_usage", 0) <= 1
    counts = [e["generated_tokens"] for e in readings]
    assert counts == sorted(counts) and counts[-1] > 0
    assert any(e.get("tokens_per_s", 0) > 0 for e in readings)


def test_page_follows_end_kill_and_resume(dashboard):
    env, live = dashboard, dashboard["live"]
    first = env["procs"][0]
    assert first.wait(timeout=300) == 0, first.stdout.read()[-3000:]
    run = env["api"]("/api/runs")[0]
    assert run["state"] == "finished" and run["last_step"] == 14, run
    gen = env["api"]("/api/runs/0/metrics")["generation"]
    again = env["train"](live, 20, env["pace"])  # resumes from step 14's checkpoint
    env["procs"].append(again)
    env["wait_for"](lambda: env["steps_logged"](live) >= 16, 180, "step 15 of the resumed run")
    again.kill()  # step 15 has no checkpoint (every 2 steps): the next resume drops its row
    again.wait()
    last = env["train"](live, 20, env["pace"])
    env["procs"].append(last)
    assert last.wait(timeout=300) == 0, last.stdout.read()[-3000:]
    fresh = env["api"](f"/api/runs/0/metrics?generation={gen}&after=15")
    assert fresh["generation"] > gen and fresh["start"] == 0  # a client holding old rows starts over
    assert [r["step"] for r in fresh["rows"]] == list(range(21))  # no step lost or repeated
    dom = dump(env)
    assert points(dom, "reward_mean")[0] == 20 and "finished" in dom  # training steps 1-20


def test_damaged_folder_shows_what_it_can(dashboard):
    env = dashboard
    dom = dump(env)
    assert points(dom, "reward_mean")[2] == 3  # rows 0, 1 and 3 of the damaged metrics
    card = dom[dom.index(str(env["bad"])):]
    assert "metrics.jsonl line 3: not JSON" in card
    assert "metrics.jsonl line 5: cut short" in card
    assert "telemetry/ is missing" in card
    assert not (env["bad"] / "IMPORTED").exists()  # the plugin its config lists was never imported
