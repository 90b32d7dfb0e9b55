"""Run telemetry for miles: what a run records for ``miles dashboard`` (``record``), the run
folder's telemetry files and their readers (``files``), device readings (``devices``), model FLOPs
and MFU (``flops``) and Prometheus exposition (``prom``). A library: it never imports ``miles``."""
from .files import FOLDER, Tail, latest_per_step, parse_lines, read_jsonl, rotated_files
from .flops import Throughput, model_flops, peak_tflops, untimed
from .record import RunRecorder

__all__ = ["FOLDER", "Tail", "latest_per_step", "parse_lines", "read_jsonl", "rotated_files", "Throughput", "untimed",
           "model_flops", "peak_tflops", "RunRecorder"]
