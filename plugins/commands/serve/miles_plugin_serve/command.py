"""``miles serve``'s arguments, API key sources and the non-loopback rule, then the ``miles_serve`` hook."""
from __future__ import annotations

import argparse

from miles import MilesError, PluginError, make_plugin_manager
from miles_procs import api_key
from miles.config import apply_overrides

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("model_dir", help="Hugging Face model folder (e.g. written by miles export)")
    sp.add_argument("--port", type=int, required=True, help="TCP port (0 picks a free one)")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (not loopback: needs --api-key)")
    sp.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request "
                    "(visible in ps: prefer --api-key-file or $MILES_API_KEY)")
    sp.add_argument("--api-key-file", default=None, help="read the API key from this file")
    sp.add_argument("overrides", nargs="*", help="engine settings as key=value (e.g. dtype=bfloat16)")


def run(args: argparse.Namespace) -> int:
    """The model folder behind SGLang's HTTP API through the ``miles_serve`` hook (engine-agnostic)."""
    args.api_key = api_key(args)
    if args.host not in LOOPBACK and not args.api_key:
        raise MilesError(f"--host {args.host} exposes the server beyond this machine: pass "
                         f"--api-key KEY (clients send 'Authorization: Bearer KEY'), or bind 127.0.0.1")
    pm = make_plugin_manager(extra=args.plugin or [])
    try:
        code = pm.hook.miles_serve(model_dir=args.model_dir, host=args.host, port=args.port,
                                   api_key=args.api_key, settings=apply_overrides({}, args.overrides))
    except PluginError as e:  # a user error (bad folder, setting, port) reads better unwrapped
        if isinstance(e.__cause__, MilesError) and not isinstance(e.__cause__, PluginError):
            raise e.__cause__ from None
        raise
    if code is None:
        raise MilesError("no installed plugin implements miles_serve; pip install miles-plugin-torch-engine")
    return code

