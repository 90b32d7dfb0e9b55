"""Engine side of the ``disk`` transport, public so that ``miles serve`` can reload weights from disk.

The reading code lives in the wire library (``miles_wire``): engines load a weights folder through
``update_weights_from_disk`` without importing this plugin, and there is one copy of the format.
"""
from miles_wire import checksum, dtype_name, load_version, read_manifest

__all__ = ["checksum", "dtype_name", "load_version", "read_manifest"]
