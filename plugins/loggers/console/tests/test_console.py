"""The console logger: plain lines off a terminal (CI logs), a live progress bar with ETA on one."""
import io
import re

from miles.protocols import Console as ConsoleProtocol
from miles.testing import assert_lazy_registration
from miles_plugin_console.logger import ConsoleLogger
from rich.console import Console


def logger(terminal: bool, total: int = 3):
    lg = ConsoleLogger(total_steps=total)
    buf = io.StringIO()
    lg.console = Console(file=buf, force_terminal=terminal, width=100, highlight=False)
    return lg, buf


def test_off_a_terminal_every_line_is_plain():
    lg, buf = logger(terminal=False)
    lg.plain_every = 3600.0  # a phase prints its start and its end, nothing in between
    for done in range(6):
        lg.progress("warm start", done, 5)
    for step in range(4):
        lg.log(step, {"reward_mean": 0.5, "eval_accuracy": 0.25} if step % 3 == 0 else {"reward_mean": 0.5})
    lg.progress("evaluation", 0, 1)
    lg.progress("evaluation", 1, 1)
    lg.close()
    lines = buf.getvalue().splitlines()
    assert "\x1b" not in buf.getvalue() and "\r" not in buf.getvalue()
    assert lines[:2] == ["warm start 0/5", "warm start 5/5"]
    assert [line.split("  ")[0] for line in lines[2:6]] == [f"step {s}/3" for s in range(4)]
    assert "eval_acc 0.250" in lines[2] and "ETA" in lines[4] and "ETA" not in lines[5]
    assert lines[6:] == ["evaluation 0/1", "evaluation 1/1"]


def test_off_a_terminal_a_long_phase_reports_its_eta():
    lg, buf = logger(terminal=False)
    lg.plain_every = 0.0
    for done in range(3):
        lg.progress("warm start", done, 4)
    assert re.fullmatch(r"warm start 0/4\nwarm start 1/4  ETA \d+s\nwarm start 2/4  ETA \d+s\n", buf.getvalue())


def test_on_a_terminal_a_live_bar_with_eta():
    lg, buf = logger(terminal=True, total=4)
    for done in range(3):
        lg.progress("warm start", done, 10)
    frames = buf.getvalue()
    assert "warm start" in frames and "2/10" in frames and "ETA" in frames
    lg.progress("warm start", 10, 10)
    assert "warm start" not in lg.phases  # the finished phase leaves the bar
    for step in (1, 2):
        lg.log(step, {"reward_mean": 0.5})
    assert "steps" in lg.phases and "2/4" in buf.getvalue()
    assert "step 2/4" in buf.getvalue()  # the step lines still print, above the bar
    lg.close()
    assert not lg.bar.live.is_started


def test_registers_the_console_logger_lazily_and_is_the_run_s_console():
    assert_lazy_registration("miles_plugin_console", "loggers", "console")
    lg, buf = logger(terminal=False)
    assert isinstance(lg, ConsoleProtocol)
    lg.message("warning: something to know")
    assert buf.getvalue() == "warning: something to know\n"
