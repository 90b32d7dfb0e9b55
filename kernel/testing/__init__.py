"""Pytest helpers for plugin authors: a fresh plugin manager, sample/group factories, a tiny model,
and an architecture plugin's parity checks against transformers (``arch.py``).

In a ``conftest.py``, ``from miles.testing import *  # noqa`` also brings the fixture. Needs the
``testing`` extra (``pip install miles[testing]``: pytest, transformers, miles-tinypolicy).
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import os
import shutil
import subprocess
import sys
from typing import Any, Iterator, Sequence

import pytest

from ..plugins import make_plugin_manager
from ..types import Group, Sample, Task
# parity checks for architecture plugins (engine, routing replay, megatron vs transformers)
from .arch import (PROMPTS, engine_matches_transformers, lively_weights, megatron_matches_transformers,
                   megatron_round_trip, model_spec, routing_replay_matches)
# re-exported: product code (env connectors) imports it from miles_tinypolicy, without pytest
from miles_tinypolicy import char_tokenizer

__all__ = ["plugin_manager", "make_group", "char_tokenizer", "TinySpec", "assert_lazy_registration",
           "listening_port", "run_module", "assert_usage_error", "require_commands", "start_server", "server_url",
           "served", "fit_answers", "imported_modules", "PROMPTS", "model_spec", "lively_weights",
           "engine_matches_transformers", "routing_replay_matches", "megatron_round_trip",
           "megatron_matches_transformers"]


@pytest.fixture
def plugin_manager() -> Any:
    """A fresh plugin manager with every installed plugin (none shared between tests)."""
    return make_plugin_manager()


def make_group(rewards: list[float], prompt_ids: Sequence[int] = (1, 2), response_len: int = 3,
               task: Task | None = None) -> Group:
    """A group with one sample per reward, each with ``response_len`` response tokens."""
    task = task or Task(prompt="p", label="l")
    samples = [Sample(task=task, prompt_ids=list(prompt_ids), response_ids=list(range(3, 3 + response_len)),
                      logprobs=[-1.0] * response_len, reward=r) for r in rewards]
    return Group(task=task, samples=samples)


class TinySpec:
    """A test-double model spec: a random tiny Qwen2 causal LM (seeded) over a given tokenizer."""

    def __init__(self, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0,
                 intermediate: int | None = None, vocab: int | None = None) -> None:
        self.kw = dict(hidden_size=hidden, intermediate_size=intermediate or hidden * 2,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads)
        self.seed, self.vocab = seed, vocab

    def build_tokenizer(self, default: Any = None) -> Any:
        return default or char_tokenizer()

    def build_model(self, tokenizer: Any) -> Any:
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(self.seed)
        cfg = Qwen2Config(vocab_size=self.vocab or len(tokenizer), max_position_embeddings=128,
                          tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=tokenizer.eos_token_id, **self.kw)
        return Qwen2ForCausalLM(cfg).eval()


def assert_lazy_registration(module: str, kind: str, name: str) -> None:
    """In a fresh interpreter with only ``module`` as a plugin: it registers component ``name``
    of ``kind`` (e.g. ``"engines"``) without importing torch (so ``miles plugins`` stays fast)."""
    code = (f"import sys; from miles import make_plugin_manager; "
            f"pm = make_plugin_manager(extra=[{module!r}], autoload=False); "
            f"assert {name!r} in pm.registry({kind!r}), 'not registered'; "
            f"assert 'torch' not in sys.modules, 'torch imported at registration'")
    subprocess.run([sys.executable, "-c", code], check=True)


@contextlib.contextmanager
def listening_port() -> Iterator[int]:
    """A port of 127.0.0.1 something listens on while the block runs (a busy port to refuse)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def run_module(module: str, *args: str, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m module args...`` as a user runs it, its output captured."""
    import os

    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def call_main(capsys: Any, module: str, *args: str) -> subprocess.CompletedProcess:
    """``module.main(args)`` in this process, as ``run_module`` would run it: its exit code
    (returned or raised as SystemExit) and the output ``capsys`` captured."""
    import importlib

    capsys.readouterr()
    try:
        code = importlib.import_module(module).main(list(args))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess([module, *args], code, out.out, out.err)


def assert_usage_error(p: subprocess.CompletedProcess, prog: str, *words: str) -> None:
    """Bad input as the project reports it: exit 2, no traceback, a stderr line ``{prog}: error:
    ...`` that, with the lines after it (one a config problem), holds every one of ``words``."""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith(f"{prog}: error: ")), None)
    assert first is not None, p.stderr
    told = "\n".join(lines[first:])
    assert all(w in told for w in words), (words, told)


def require_commands(packages: dict[str, str]) -> None:
    """Make the system commands a test needs exist: ``{command: Debian package}``. Missing ones are
    installed with apt-get (the test suite then sets itself up on a fresh machine with only Python
    and apt); where that cannot be done the test fails with the command to run, never skips."""
    missing = sorted({pkg for cmd, pkg in packages.items() if shutil.which(cmd) is None})
    if not missing:
        return
    fix = f"apt-get install -y {' '.join(missing)}"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.fail(f"this test needs {', '.join(missing)}: run `sudo {fix}`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for args in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
        p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1200)
        if p.returncode != 0:
            pytest.fail(f"`{' '.join(args)}` failed ({p.returncode}): {p.stderr[-1500:]}")
    still = [cmd for cmd in packages if shutil.which(cmd) is None]
    assert not still, f"{fix} did not provide {', '.join(still)}"


def start_server(folder: Any, log: Any, *args: str) -> subprocess.Popen:
    """``miles serve FOLDER --port 0 ARGS`` started in a subprocess (stderr to ``log``); pair it
    with ``server_url`` to wait, so that several servers can load at once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "miles.cli", "serve", str(folder), "--port", "0", *args],
                                env=env, stdout=subprocess.PIPE, stderr=err, text=True)


def server_url(proc: subprocess.Popen, log: Any, timeout: float = 180) -> str:
    """The base URL (``http://127.0.0.1:PORT``) a started server prints once it listens; one that
    does not come up in ``timeout`` seconds fails with the tail of its log."""
    import threading
    from pathlib import Path

    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert line and "listening on http://" in line[0], f"{line}\n{Path(log).read_text()[-3000:]}"
    return line[0].strip().rsplit(" ", 1)[1]


@contextlib.contextmanager
def served(folder: Any, *args: str, timeout: float = 180) -> Iterator[str]:
    """``miles serve FOLDER --port 0 ARGS`` in a subprocess while the block runs; yields its base URL."""
    from pathlib import Path

    log = Path(folder).parent / f"{Path(folder).name}.serve.log"
    proc = start_server(folder, log, *args)
    try:
        yield server_url(proc, log, timeout)
    finally:
        proc.kill()
        proc.wait(30)


def fit_answers(model: Any, rows: Sequence[tuple[list[int], int]], pad_id: int, steps: int = 400,
                lr: float = 1e-2, decay: bool = False) -> Any:
    """Train a tiny causal LM until it answers by heart: ``rows`` are ``(token ids, prompt length)``;
    only the tokens after the prompt are learnt (a few seconds on one thread). ``decay``: the rate
    falls linearly to 0 over ``steps`` (a high constant rate can oscillate around a long fit).
    Returns it in eval mode."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r, _ in rows])
    labels = ids.clone()
    for i, (r, p) in enumerate(rows):
        labels[i, :p] = -100
        labels[i, len(r):] = -100
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend
    try:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps if decay else 1.0)
        for _ in range(steps):
            loss = model(input_ids=ids, labels=labels).loss
            if loss.item() < 0.005:
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def imported_modules(module: Any) -> set[str]:
    """Every module an import statement in ``module``'s source names, at its top or inside a
    function (what a dependency check must see: imports run only when their function does)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names
