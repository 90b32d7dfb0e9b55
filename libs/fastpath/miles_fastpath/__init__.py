"""miles-fastpath: the pieces that the hand-written CPU/GPU fast paths of the torch engine
(decode) and the fsdp2 trainer (log-probs) share, once (a library, not a plugin: it registers
nothing; importing the package does not import torch).

* ``miles_fastpath.llama``: ``llama_layout_problem``, the Llama-family layout check both fast
  paths run before taking over a model's forward;
* ``miles_fastpath.ops``: ``rms_norm``, RMSNorm in Hugging Face's op order (so both ends round
  as the module's own forward does);
* ``miles_fastpath.cpu_gemm``: which library multiplies by the weights on CPU (MKL or oneDNN),
  ``engine.cpu_gemm`` / ``trainer.cpu_gemm``;
* ``miles_fastpath.threads``: ``pool``, the process-wide registry of worker-thread pools of a
  fixed intra-op thread count each (one registry for the engine's and the trainer's workers).
"""
