"""miles-wire: the weight-sync wire format shared by the transports (trainer side) and the engines
(receiving side).

Both ends of a transport must agree on byte layouts, checksums and the on-disk format without
importing each other's plugin, so those pieces live here, once (a library, not a plugin: it
registers nothing). torch (and safetensors) are imported inside the functions: importing this
package stays free. Every public name is importable from ``miles_wire`` itself; the modules:

* ``dtypes``: ``dtype_name``/``to_dtype`` (dtype strings without ``torch.``, as SGLang sends
  them), ``nbytes``, ``checksum`` (blake2b-128 of the raw bytes: exact for every dtype);
* ``bucketing``: ``buckets`` cuts a ``(name, tensor)`` stream into lists of at most N bytes;
  ``timed``/``ready`` account the time spent producing them;
* ``packing``: ``layout``/``pack``/``views`` place tensors of any dtypes in one uint8 buffer at
  ``ALIGN``-byte offsets (both ends compute the offsets from dtypes and shapes alone);
  ``wire_plan`` says which tensors of a broadcast bucket travel packed and which on their own;
  ``SHM_FORMAT``/``CUDA_IPC_FORMAT`` name the payload formats of ``update_weights_from_tensor``;
* ``calls``: ``Calls``/``parallel`` run calls to engines concurrently on daemon threads (a push
  in the background is one ``Calls``); ``is_sender``: the trainer rank that talks to engines;
  ``is_remote``: an engine in another process;
* ``verification``: ``verify``, ``engine_checksums`` + ``expect_same`` (raise ``MilesError``
  naming the first tensor that differs);
* ``groups``: ``open_store``/``new_group``/``broadcast_all``/``post``/``wait_all`` build a group
  of their own (a TCP store + a gloo or NCCL group object) that never touches the default group,
  so a multi-rank trainer and a one-process engine can join it alike; ``object_group``: the
  trainers' gloo group over the default group, for Python objects and barriers;
* ``disk``: the ``disk`` transport's folder format and version protocol
  (``LATEST``/``MANIFEST``/``committed``/``read_manifest``/``load_version``);
* ``miles_wire.testing``: ``EngineProcess``, an engine in a child process (the test double of a
  remote engine for transport tests).

The fast paths' shared pieces (Llama layout check, CPU GEMM choice, worker pools) are the
``miles-fastpath`` library's.
"""
from .bucketing import buckets, ready, timed
from .calls import Calls, is_remote, is_sender, members, parallel, servers_down
from .disk import (
                      LATEST,
                      MANIFEST,
                      committed,
                      latest,
                      load_version,
                      parse_folder,
                      read_manifest,
)
from .dtypes import checksum, dtype_name, nbytes, to_dtype
from .groups import (
                      broadcast,
                      broadcast_all,
                      drop_object_groups,
                      new_group,
                      object_group,
                      open_store,
                      post,
                      wait_all,
)
from .packing import (
                      ALIGN,
                      CUDA_IPC_FORMAT,
                      SHM_FORMAT,
                      WirePlan,
                      align,
                      layout,
                      pack,
                      views,
                      wire_plan,
)
from .verification import engine_checksums, expect_same, verify

__all__ = [
    "ALIGN", "CUDA_IPC_FORMAT", "LATEST", "MANIFEST", "SHM_FORMAT", "Calls", "WirePlan", "align",
    "broadcast", "broadcast_all", "buckets", "checksum", "committed", "drop_object_groups", "dtype_name",
    "engine_checksums", "expect_same", "is_remote", "is_sender", "latest", "layout",
    "load_version", "members", "nbytes", "new_group", "object_group", "open_store", "pack", "parallel", "parse_folder",
    "post", "read_manifest", "ready", "servers_down", "timed", "to_dtype", "verify", "views", "wait_all",
    "wire_plan",
]
