"""TEST-ONLY launch-time plugin: installs the CPU stand-ins (``miles_plugin_megatron.cpu``) when a
rank loads it (``--plugin``), so multi-rank ``miles train`` runs of the megatron trainer work on a
CPU machine."""
from miles_plugin_megatron.cpu import Patches, install

install(Patches())
