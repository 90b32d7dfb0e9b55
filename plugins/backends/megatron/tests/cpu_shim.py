"""The CPU stand-ins for the workers and tests that import ``cpu_shim`` from this folder: they
live in the plugin package (``miles_plugin_megatron.cpu``), where ``miles.testing`` finds them."""
from miles_plugin_megatron.cpu import install

__all__ = ["install"]
