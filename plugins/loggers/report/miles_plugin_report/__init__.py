"""Command ``miles report RUN_DIR``: a self-contained HTML page (and PNGs) of a run; the logger
``report`` writes the same page into the run folder when a run ends.

Registration imports nothing heavy; matplotlib loads when a report is written.
"""
from miles import hookimpl


@hookimpl
def miles_register_loggers(register):
    register("report", _make_logger)


def _make_logger(cfg, *, out_dir, **_):
    from .report import ReportLogger

    return ReportLogger(out_dir)


@hookimpl
def miles_register_commands(register):
    register("report", "write an HTML report (curves, timings, weight sync, samples) of a run folder",
             _add_arguments, _run)


def _add_arguments(parser):
    parser.add_argument("run_dir", help="the run's out_dir (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="folder for index.html and the PNGs (default: RUN_DIR/report)")


def _run(args) -> int:
    from .report import write_report

    page = write_report(args.run_dir, args.out)
    print(f"report of {args.run_dir}: {page}")
    return 0
