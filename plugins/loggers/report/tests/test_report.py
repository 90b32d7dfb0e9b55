"""miles report: the page's figures, their PNGs, the summary, and bad run folders."""
import base64
import io
import json
from html.parser import HTMLParser

import pytest
from miles import MilesError
from PIL import Image


class Images(HTMLParser):
    """Every <img> of a page and every external reference (src/href not a data: URI)."""

    def __init__(self, text):
        super().__init__()
        self.images, self.external = {}, []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("src", "href"):
            if a.get(key) and not a[key].startswith("data:"):
                self.external.append(a[key])
        if tag == "img":
            self.images[a["id"]] = base64.b64decode(a["src"].removeprefix("data:image/png;base64,"))


def test_async_run_report_has_every_figure_embedded(async_report):
    run, page = async_report
    assert page == run / "report" / "index.html"
    parsed = Images(page.read_text())
    assert parsed.external == []  # opens with no network
    figures = {"fig-reward", "fig-timings", "fig-weight_sync", "fig-async", "fig-mismatch", "fig-warm_start",
               "fig-other"}
    grids = {f"grid-step_{i:06d}" for i in (0, 2, 4, 5, 7, 9)}  # 6 of 10, first and last included
    assert set(parsed.images) == figures | grids
    for img_id, png in parsed.images.items():
        w, h = Image.open(io.BytesIO(png)).size
        assert w >= 150 and h >= 150, img_id
        if img_id.startswith("fig-"):  # the same figure is also written as a PNG file
            assert (run / "report" / f"{img_id[4:]}.png").read_bytes() == png
    text = page.read_text()
    assert "0.100 → 0.700 (best 0.700)" in text and "12 of 12" in text and "4.00 MB each" in text
    assert "<pre>model:\n  name: hf" in text


def test_sync_run_without_extras_has_no_async_or_mismatch_figure(tmp_path):
    from miles_plugin_report.report import write_report

    from .conftest import make_run

    run = make_run(tmp_path / "run", steps=3, mode="sync")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("train_rollout_logprob_abs_diff", None)
    # a rerun appended step 3 again and a killed process left half a line: newest row wins, the cut line is skipped
    rows.append({**rows[-1], "reward_mean": 9.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "rew')
    (run / "warm_start.jsonl").unlink()
    page = write_report(run, tmp_path / "out")
    assert set(Images(page.read_text()).images) == {"fig-reward", "fig-timings", "fig-weight_sync", "fig-other"}
    assert "3 of 3" in page.read_text()
    from miles_plugin_report.data import read_run

    assert [r["step"] for r in read_run(run).rows] == [0, 1, 2, 3] and read_run(run).rows[-1]["reward_mean"] == 9.0


def test_a_run_with_only_its_first_evaluation(tmp_path):
    from miles_plugin_report.report import write_report

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval_accuracy": 0.25}\n')
    page = write_report(tmp_path)
    assert set(Images(page.read_text()).images) == {"fig-reward"}


def test_not_a_run_folder(tmp_path):
    from miles_plugin_report.report import write_report

    with pytest.raises(MilesError, match="no metrics.jsonl"):
        write_report(tmp_path)
    with pytest.raises(MilesError, match="is not a folder"):
        write_report(tmp_path / "missing")


def test_report_logger_writes_the_page_when_the_run_ends(tmp_path, capsys):
    from miles import make_plugin_manager

    from .conftest import make_run

    run = make_run(tmp_path / "run", steps=2, mode="sync")
    lg = make_plugin_manager().create("loggers", "report", None, out_dir=str(run), total_steps=2)
    lg.log(2, {"reward_mean": 1.0})
    assert not (run / "report").exists()
    lg.close()
    assert "fig-reward" in (run / "report" / "index.html").read_text()
    assert str(run / "report" / "index.html") in capsys.readouterr().out
    # a run folder without metrics: a warning, never an exception that would hide the run's own error
    make_plugin_manager().create("loggers", "report", None, out_dir=str(tmp_path / "empty"), total_steps=2).close()
    assert "no run report written" in capsys.readouterr().err
