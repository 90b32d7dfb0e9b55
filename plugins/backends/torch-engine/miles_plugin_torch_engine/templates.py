"""Client-supplied chat templates (``chat_template_kwargs.chat_template`` or ``chat_template`` on
``/v1/chat/completions``), for a server started with ``trust_request_chat_template=true``.

A Jinja template is a program: 103 bytes of nested loops can run for minutes, and one
expression can allocate gigabytes, in C code no Python-level check interrupts. So a client's
template renders in a child process of its own (started on first use, kept for the next one),
in Jinja's immutable sandbox as Hugging Face renders chat templates, under an address-space
limit; it is killed when it runs past its time budget, and its output is cut at a size budget.
The model's own template (from its folder) is trusted and renders in the server.

This file is also the child's program: run with ``MEMORY_MB`` as its argument, it reads one JSON
request per line on stdin and answers one JSON line on stdout.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any


class TemplateRejected(ValueError):
    """The client's template failed or broke a budget (a 400 that says which)."""


class TemplateRenderer:
    """Renders client templates in the child process, one at a time (see the module docstring)."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_source_chars: int = 65536,
                 max_output_chars: int = 1_048_576):
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.max_source_chars, self.max_output_chars = max_source_chars, max_output_chars
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._closed = False

    def render(self, source: str, context: dict) -> str:
        if not isinstance(source, str) or not source:
            raise TemplateRejected("chat_template: give the template as a non-empty string")
        if len(source) > self.max_source_chars:
            raise TemplateRejected(f"chat_template: {len(source)} characters; at most "
                                   f"{self.max_source_chars} (the server's template_max_chars)")
        request = json.dumps({"source": source, "context": context,
                              "max_chars": self.max_output_chars}).encode() + b"\n"
        with self._lock:
            if self._closed:
                raise TemplateRejected("chat_template: the server is shutting down")
            proc = self._child()
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
                line = self._read_line(proc, time.monotonic() + self.timeout_s)
            except TimeoutError:
                self._kill()
                raise TemplateRejected(f"chat_template: rendering took longer than {self.timeout_s:g} s "
                                       f"(the server's template_timeout_s); it was stopped") from None
            except (OSError, EOFError):
                self._kill()
                if self._closed:
                    raise TemplateRejected("chat_template: the server is shutting down") from None
                raise TemplateRejected(f"chat_template: rendering exceeded its memory budget of "
                                       f"{self.memory_mb} MB (the server's template_memory_mb)") from None
        reply = json.loads(line)
        if "error" in reply:
            raise TemplateRejected(f"chat_template: {reply['error']}")
        return reply["text"]

    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            # run as code, not as a script: neither the package folder nor the working directory
            # goes on sys.path, so no module there shadows a library the child imports
            boot = "import runpy, sys; sys.path.pop(0); runpy.run_path(sys.argv[1], run_name='__main__')"
            self._proc = subprocess.Popen([sys.executable, "-c", boot, os.path.abspath(__file__), str(self.memory_mb)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, bufsize=0)
        return self._proc

    @staticmethod
    def _read_line(proc: subprocess.Popen, deadline: float) -> bytes:
        fd, chunks = proc.stdout.fileno(), []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                return b"".join(chunks)

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the child (a render in progress answers at once: no lock is waited for)."""
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()


# -- the child ------------------------------------------------------------------------------------
def _environment() -> Any:
    """Jinja's immutable sandbox with what Hugging Face chat templates use: ``tojson``,
    ``raise_exception``, ``strftime_now`` and loop controls."""
    from datetime import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def _render(env: Any, request: dict) -> dict:
    limit = int(request["max_chars"])
    try:
        pieces, size = [], 0
        for piece in env.from_string(request["source"]).generate(**request["context"]):
            size += len(piece)
            if size > limit:
                return {"error": f"the rendered prompt is over {limit} characters (the server's "
                                 f"max_prompt_chars)"}
            pieces.append(piece)
        return {"text": "".join(pieces)}
    except MemoryError:
        return {"error": "rendering exceeded its memory budget (the server's template_memory_mb)"}
    except Exception as e:  # noqa: BLE001 - the template's own error, reported to its client
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def _child_main(memory_mb: int) -> None:
    import resource

    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    env = _environment()
    for line in sys.stdin.buffer:
        sys.stdout.write(json.dumps(_render(env, json.loads(line)), ensure_ascii=True) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _child_main(int(sys.argv[-1]))
