"""The run folder on disk (``run.out_dir``): checkpoints, ``metrics.jsonl`` and durable writes.

A library, not a plugin: the kernel's loop and CLI call it, and plugins that write files which
must survive a crash (``write_atomic``, ``fsync_path``) may too. Modules: ``files`` (durable
writes, full-disk errors, writable folders), ``checkpoint`` (atomic checksummed checkpoints, resume
checks), ``metrics`` (the one-JSON-object-per-line metric log), ``resume`` (what a rerun may
change), ``export`` (``miles export``'s target), ``trust`` (which of a run folder's listed plugins
a command imports).
"""
from .checkpoint import begin, check_out_dir, check_resumable, commit, damage, latest
from .export import check_export_target, export_folder
from .files import disk_errors, fsync_path, leave_as_found, write_atomic
from .metrics import MetricsLog, truncate_metrics
from .resume import check_resume
from .trust import add_trust_flag, folder_plugins, is_run_config

__all__ = ["begin", "check_out_dir", "check_resumable", "commit", "damage", "latest", "check_export_target",
           "export_folder", "disk_errors", "fsync_path", "write_atomic", "MetricsLog", "truncate_metrics",
           "check_resume", "leave_as_found", "add_trust_flag", "folder_plugins", "is_run_config"]
