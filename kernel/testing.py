"""Pytest helpers for plugin authors: a fresh plugin manager, sample/group factories, a tiny model.

Use in a ``conftest.py``: ``from miles.testing import *  # noqa`` or import the functions.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from .plugins import make_plugin_manager
from .types import Group, Sample, Task


@pytest.fixture
def plugin_manager():
    """A fresh plugin manager with every installed plugin (none shared between tests)."""
    return make_plugin_manager()


def make_group(rewards: list[float], prompt_ids=(1, 2), response_len: int = 3,
               task: Task | None = None) -> Group:
    """A group with one sample per reward, each with ``response_len`` response tokens."""
    task = task or Task(prompt="p", label="l")
    samples = [Sample(task=task, prompt_ids=list(prompt_ids), response_ids=list(range(3, 3 + response_len)),
                      logprobs=[-1.0] * response_len, reward=r) for r in rewards]
    return Group(task=task, samples=samples)


def char_tokenizer(chars: str = "0123456789+-*=() abcdefghijklmnopqrstuvwxyz") -> Any:
    """A real Hugging Face fast tokenizer over single characters, built locally (no hub)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")


class TinySpec:
    """A test-double model spec: a random tiny Qwen2 causal LM (seeded) over a given tokenizer."""

    def __init__(self, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0,
                 intermediate: int | None = None, vocab: int | None = None):
        self.kw = dict(hidden_size=hidden, intermediate_size=intermediate or hidden * 2,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads)
        self.seed, self.vocab = seed, vocab

    def build_tokenizer(self, default: Any = None) -> Any:
        return default or char_tokenizer()

    def build_model(self, tokenizer: Any):
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(self.seed)
        cfg = Qwen2Config(vocab_size=self.vocab or len(tokenizer), max_position_embeddings=128, tie_word_embeddings=True,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                          **self.kw)
        return Qwen2ForCausalLM(cfg).eval()


def install_plugin_dist(tmp_path: Path, name: str, version: str, module_code: str) -> Path:
    """Build and pip-install a real third-party ``miles-plugin-<name>`` distribution into its own
    folder (put it on PYTHONPATH to use it); its module body is ``module_code``."""
    src, site = tmp_path / f"src-{name}", tmp_path / f"site-{name}"
    pkg = src / f"miles_plugin_{name}"
    pkg.mkdir(parents=True)
    (src / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "miles-plugin-{name}"
        version = "{version}"
        [project.entry-points."miles.plugins"]
        {name} = "miles_plugin_{name}"
        [tool.setuptools]
        packages = ["miles_plugin_{name}"]
    """))
    (pkg / "__init__.py").write_text(textwrap.dedent(module_code))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True)
    return site


def assert_lazy_registration(module: str, kind: str, name: str) -> None:
    """In a fresh interpreter with only ``module`` as a plugin: it registers component ``name``
    of ``kind`` (e.g. ``"engines"``) without importing torch (so ``miles plugins`` stays fast)."""
    code = (f"import sys; from miles import make_plugin_manager; "
            f"pm = make_plugin_manager(extra=[{module!r}], autoload=False); "
            f"assert {name!r} in pm.registry({kind!r}), 'not registered'; "
            f"assert 'torch' not in sys.modules, 'torch imported at registration'")
    subprocess.run([sys.executable, "-c", code], check=True)


class EngineProcess:
    """A registered engine running in a child process, every method call forwarded over a pipe:
    the test double of a remote engine (``miles serve`` behind an HTTP client) for transport
    tests. ``remote = True`` tells transports not to hand tensors over by reference.

    ``corrupt_after_updates(name)`` makes the child change one value of tensor ``name`` after
    each weight update, to prove that ``sync.verify`` catches a bad engine copy.
    """

    remote = True

    def __init__(self, name: str = "torch", settings: dict | None = None, spec: Any = None, seed: int = 0):
        import multiprocessing
        import threading

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_process_main, daemon=True,
                                 args=(child, name, settings or {}, spec or TinySpec(), seed))
        self._proc.start()
        child.close()
        self._lock = threading.Lock()  # transports may call from several threads
        self._methods, self._attrs = self._call("__ready__")

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._conn.send((method, args, kwargs))
            ok, value = self._conn.recv()
        if not ok:
            raise value
        return value

    def __getattr__(self, name: str) -> Any:
        # only what the child's engine has: transports probe engines with hasattr()
        if name in self.__dict__.get("_methods", ()):
            return lambda *args, **kwargs: self._call(name, *args, **kwargs)
        if name in self.__dict__.get("_attrs", ()):
            return self._call("__getattr__", name)
        raise AttributeError(name)

    def corrupt_after_updates(self, name: str | None) -> None:
        self._call("__corrupt__", name)

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


def _engine_process_main(conn: Any, name: str, settings: dict, spec: Any, seed: int) -> None:
    import torch

    torch.set_num_threads(1)
    pm = make_plugin_manager()
    comp = pm.registry("engines")[name]
    cfg = comp.config(**settings) if comp.config else settings
    engine = pm.create("engines", name, cfg, spec=spec, tokenizer=spec.build_tokenizer(), seed=seed)
    corrupt = None
    while (msg := conn.recv()) is not None:
        method, args, kwargs = msg
        try:
            if method == "__ready__":
                public = [n for n in dir(engine) if not n.startswith("_") and n != "remote"]
                value = ([n for n in public if callable(getattr(engine, n))],
                         [n for n in public if not callable(getattr(engine, n))])
            elif method == "__getattr__":
                value = getattr(engine, args[0])
            elif method == "__corrupt__":
                corrupt, value = args[0], None
            else:
                value = getattr(engine, method)(*args, **kwargs)
                if corrupt and method.startswith("update_weights"):
                    with torch.no_grad():
                        dict(engine.model.named_parameters())[corrupt].view(-1)[0] += 1.0
            conn.send((True, value))
        except Exception as e:  # noqa: BLE001 - handed back to the caller
            try:
                conn.send((False, e))
            except Exception:  # noqa: BLE001 - an exception that does not pickle
                conn.send((False, RuntimeError(f"{type(e).__name__}: {e}")))
