"""``miles serve``: the torch engine behind a subset of SGLang's native HTTP API.

Routes, payloads and responses follow SGLang's ``python/sglang/srt/entrypoints/http_server.py``
and the request structs of ``python/sglang/srt/managers/io_struct.py`` (``GenerateReqInput``,
``AbortReq``, ``UpdateWeightFromDiskReqInput``, ``InitWeightsUpdateGroupReqInput``, ...), so a
client written for SGLang (our ``sglang`` engine plugin, Miles' rollout) drives it unchanged.
Every engine call goes through one thread (``scheduler.Scheduler``); the event loop only queues
and answers (large bodies are parsed and tokenized on ``limits.Prep``'s threads), so slow calls
(a collective weight update waiting for the trainer, a 1 MB prompt) never block the other
endpoints. What one request may ask is bounded by ``limits.ServerLimits``.
"""
from __future__ import annotations

import asyncio
import gc
import inspect
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from miles import MilesError, SamplingParams
from miles.protocols import ReceivesWeights
from miles_procs import listening_socket
from pydantic import ValidationError

from .groups import GroupJoins, JoinBusy, check_join_args
from .guard import Guard, check_api_key, check_bind
from .limits import (Prep, PromptTooLarge, ServerBusy, ServerLimits, check_disk_path, check_prompts,
                     check_text_size, server_settings)
from .protocol import GenerateBody, errors_text, format_outputs
from .routing import with_routing
from .scheduler import Item, Request, Scheduler

# SGLang request fields with no effect on this engine: accepted and ignored when the engine's
# method does not take them (io_struct.py UpdateWeight*ReqInput)
SGLANG_NOOP_FIELDS = {"abort_all_requests", "flush_cache", "selector", "is_async", "torch_empty_cache",
                      "keep_pause", "recapture_cuda_graph", "token_step"}
# route -> engine method (the route name is the method name, except our checksum extension)
WEIGHT_ROUTES = {"update_weights_from_disk": "update_weights_from_disk",
                 "init_weights_update_group": "init_weights_update_group",
                 "update_weights_from_distributed": "update_weights_from_distributed",
                 "update_weights_from_tensor": "update_weights_from_tensor",
                 "destroy_weights_update_group": "destroy_weights_update_group",
                 "weights_checksum": "weight_checksums"}
HEALTH_TIMEOUT_S = 20.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class FolderSpec:
    """Model spec over a Hugging Face folder (config.json, safetensors, tokenizer files). It names
    the architecture a plugin registers for the folder's ``model_type`` (``KnowsArchitecture``), and
    where that architecture ``CarriesMTP`` the model carries the folder's MTP layers, which
    transformers drops (``engine.speculative.draft=mtp`` drafts with them)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._arch: list[Any] = []  # looked up once, on first use

    def architecture(self) -> Any:
        if not self._arch:
            from miles import make_plugin_manager

            model_type = json.loads((Path(self.model_dir) / "config.json").read_text()).get("model_type")
            self._arch.append(make_plugin_manager().architecture(model_type))
        return self._arch[0]

    def build_tokenizer(self, default: Any = None) -> Any:
        from transformers import AutoTokenizer

        if not any((Path(self.model_dir) / f).is_file() for f in TOKENIZER_FILES):
            # AutoTokenizer may otherwise hand back a tokenizer with no vocabulary at all
            raise MilesError(f"{self.model_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                             f"`miles export` writes them next to the weights, or save the "
                             f"tokenizer there with tokenizer.save_pretrained(FOLDER)")
        try:
            tok = AutoTokenizer.from_pretrained(self.model_dir)
        except Exception as e:
            raise MilesError(f"{self.model_dir}: cannot load its tokenizer ({type(e).__name__}: {e}); "
                             f"`miles export` writes the tokenizer files next to the weights") from e
        if tok.pad_token_id is None:  # the engine pads batches
            tok.pad_token = tok.eos_token
        return tok

    def build_model(self, tokenizer: Any):
        from miles.protocols import CarriesMTP
        from miles_lowp.compressed import dense_load_kwargs
        from transformers import AutoModelForCausalLM

        # an INT4 export (compressed-tensors) is served dequantized, or as INT4 with weights_dtype=int4
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, **dense_load_kwargs(self.model_dir))
        arch = self.architecture()
        if isinstance(arch, CarriesMTP):
            arch.attach_mtp(model, self.model_dir)
        return model


def served_spec(model_dir: str, cfg: Any) -> Any:
    """The model spec ``miles serve`` loads ``model_dir`` with under engine settings ``cfg``: the
    folder, with routers that record for a mixture-of-experts model (``return_routed_experts``;
    with the MTP layers drafting, only the positions each row kept are recorded)."""
    return with_routing(FolderSpec(model_dir), model_dir)


def _error(message: str, status: int = 400):
    """SGLang's error body (``http_server.py: _create_error_response``)."""
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _busy(message: str):
    return JSONResponse({"error": {"message": message}}, status_code=503, headers={"Retry-After": "1"})


def _accepted_kwargs(fn: Any, body: dict, route: str) -> dict:
    """The JSON body as keyword arguments of ``fn``; SGLang-only no-op fields are dropped,
    anything else ``fn`` does not take is a client error that names it."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(body)
    unknown = [k for k in body if k not in params and k not in SGLANG_NOOP_FIELDS]
    if unknown:
        raise ValueError(f"/{route}: unknown field(s) {', '.join(sorted(unknown))}; "
                         f"accepted: {', '.join(params)}")
    return {k: v for k, v in body.items() if k in params}


def _weight_response(route: str, result: Any) -> dict:
    """``{"success", "message"}`` as SGLang's weight endpoints answer, plus what the engine
    returned (``checksums`` for our ``/weights_checksum`` extension)."""
    if route == "weights_checksum":
        return {"success": True, "message": "", "checksums": result}
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        return {"success": result[0], "message": str(result[1])}
    if isinstance(result, dict):
        return {"success": True, "message": "ok", **result}
    return {"success": True, "message": "ok"}


async def json_body(request: HttpRequest) -> dict:
    """The request's JSON object ({} for an empty body)."""
    return parse_json(await request.body())


def parse_json(raw: bytes) -> dict:
    """``raw`` as a JSON object ({} for an empty body); ValueError saying what is wrong."""
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ValueError("the request body is JSON nested too deeply") from None
    except UnicodeDecodeError:
        raise ValueError("the request body is not UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError("the request body must be a JSON object")
    return data


def build_app(engine: Any, scheduler: Scheduler, *, model_dir: str, api_key: str | None = None,
              settings: dict | None = None, **limits: Any) -> FastAPI:
    """The FastAPI application (SGLang's native routes we support; see the module docstring).
    ``limits``: ``ServerLimits`` fields (e.g. ``weights_dirs``, the only folders
    ``/update_weights_from_disk`` may read)."""
    lim = ServerLimits(**limits)
    if api_key is not None:
        check_api_key(api_key)
    if lim.admit_samples is not None:
        scheduler.admit_samples = lim.admit_samples
    app = FastAPI(title="miles serve", openapi_url=None)
    app.state.prep = prep = Prep()
    groups = GroupJoins(lim.group_join_timeout_s, lim.group_connect_timeout_s)
    _generate_route(app, engine, scheduler, lim, prep)
    _control_routes(app, engine, scheduler, groups)
    _info_routes(app, engine, scheduler, model_dir, settings or {})
    for route, method in WEIGHT_ROUTES.items():
        app.post(f"/{route}")(_weight_handler(engine, scheduler, route, method, groups, lim.weights_dirs))
    from .openai_api import mount_openai_routes

    # /v1/models, /v1/completions, /v1/chat/completions
    mount_openai_routes(app, engine, scheduler, model_dir=model_dir, limits=lim, prep=prep)
    from .p2p import mount_p2p_routes

    mount_p2p_routes(app, engine, scheduler)  # /p2p/open, /p2p/commit (NIXL imported on first use)
    from .metrics_route import mount_metrics_route

    mount_metrics_route(app, engine, scheduler)  # /metrics: Prometheus text

    def stop() -> None:
        """Answer what waits (queued generation, group joins, client templates) so a graceful
        shutdown does not wait on it; run by the event loop."""
        scheduler.stop()
        groups.stop()
        app.state.templates.close()

    app.state.stop = stop
    # outermost: checks the key before reading any body, then sees every body
    app.add_middleware(Guard, max_body_bytes=int(lim.max_body_mb * 2**20), api_key=api_key,
                       body_timeout_s=lim.body_timeout_s)
    return app


def _generate_route(app: FastAPI, engine: Any, scheduler: Scheduler, lim: ServerLimits, prep: Prep) -> None:
    vocab = int(getattr(engine.model.config, "vocab_size", 0) or 0)
    context = int(getattr(engine.model.config, "max_position_embeddings", 0) or 0)
    tokenizer = engine.tokenizer

    def prepare(raw: bytes):
        """Parse, check and tokenize a body (on the loop or ``prep``'s threads: see ``Prep``)."""
        body = GenerateBody.model_validate(parse_json(raw))
        if body.text is not None:
            check_text_size([body.text] if isinstance(body.text, str) else body.text,
                            lim.max_prompt_chars, "text")
        prompts = body.prompts(tokenizer)
        params = body.sampling(len(prompts))
        params = check_prompts(prompts, params, vocab, context, body.explicit_lengths(len(prompts)),
                               lim.max_samples_per_request)
        if body.return_routed_experts and getattr(engine, "_routing", None) is None:
            raise ValueError("return_routed_experts: this server's model does not record routing "
                             "(it needs a mixture-of-experts model and the moe plugin installed)")
        return body, prompts, params

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: HttpRequest):
        """SGLang ``POST /generate`` (``GenerateReqInput``), non-streaming, token ids in/out."""
        started = time.monotonic()
        raw = await request.body()
        try:
            body, prompts, params = await prep.run(len(raw), lambda: prepare(raw))
        except ValidationError as e:
            return _error(errors_text(e))
        except PromptTooLarge as e:
            return _error(str(e), 413)
        except ValueError as e:
            return _error(str(e))
        except ServerBusy as e:
            return _busy(str(e))
        loop = asyncio.get_running_loop()
        req = Request(rid=body.request_id(), loop=loop, future=loop.create_future(),
                      items=[Item(tuple(p), sp, sp_n) for p, (sp, sp_n) in zip(prompts, params)],
                      seeded=any(sp.seed is not None for sp, _ in params))
        scheduler.submit(req)
        try:
            if not await until_done_or_disconnected(req.future, request):
                scheduler.cancel(req)  # the client went away: nobody will read the answer
                return _error("client disconnected", 499)
        except asyncio.CancelledError:
            scheduler.cancel(req)
            raise
        except Exception as e:  # noqa: BLE001 - the engine rejected the batch
            return _error(f"generation failed: {type(e).__name__}: {e}", 500)
        out = format_outputs(req, body, tokenizer, started, engine.weight_version)
        # the JSON is written here, not by FastAPI's jsonable_encoder, which would walk every
        # log-prob first (~19 ms for 128 samples of 5 tokens); escaped ASCII encodes ~25% faster
        # than JSONResponse's UTF-8 (both are valid JSON of the same values)
        return Response(json.dumps(out[0] if body.single and len(out) == 1 else out, allow_nan=False,
                                   separators=(",", ":")), media_type="application/json")


async def until_done_or_disconnected(future: asyncio.Future, request: HttpRequest,
                                     every_s: float = 0.25) -> bool:
    """Wait for ``future``; False as soon as the client has disconnected instead."""
    while True:
        done, _ = await asyncio.wait({future}, timeout=every_s)
        if done:
            future.result()  # raises the engine's error
            return True
        if await request.is_disconnected():
            return False


def _control_routes(app: FastAPI, engine: Any, scheduler: Scheduler, groups: GroupJoins) -> None:
    @app.get("/health")
    async def health():
        """SGLang ``GET /health``: the server and its engine thread are up (no engine work); the
        body says how the last weights-update group join went (a failed one is not hidden)."""
        body = {"status": "ok" if scheduler.alive else "engine thread stopped",
                "weights_update_group": groups.state}
        return JSONResponse(body, status_code=200 if scheduler.alive else 503)

    @app.get("/health_generate")
    async def health_generate():
        """SGLang ``GET /health_generate``: a one-token greedy generation through the engine
        thread (as a job, so it answers while generation is paused)."""
        probe = SamplingParams(temperature=0.0, max_new_tokens=1)
        try:
            await asyncio.wait_for(scheduler.call(lambda: engine.generate([[0]], probe, n=1)),
                                   HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return Response(status_code=503)
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """SGLang ``/flush_cache``. The engine keeps no KV cache between calls, so this only
        waits for the engine thread."""
        await scheduler.call(lambda: None)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/pause_generation")
    async def pause_generation(request: HttpRequest):
        """SGLang ``POST /pause_generation`` (``PauseGenerationReqInput{mode}``): new generate
        requests wait in the queue until ``/continue_generation``. ``mode`` "abort" (SGLang's
        default): queued and running requests answer at once with finish_reason abort and what
        they generated so far; "in_place": the batch in flight runs to its end (SGLang holds it
        mid-way; this engine generates a batch in one call). Returns once the engine is idle."""
        try:
            mode = (await json_body(request)).get("mode", "abort")
        except ValueError as e:
            return _error(str(e))
        if mode not in ("abort", "in_place"):
            return _error(f"mode: {mode!r} is not supported by miles serve; use abort or in_place")
        scheduler.pause()
        if mode == "abort":
            scheduler.abort(abort_all=True)
        await scheduler.call(lambda: None)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        """SGLang ``POST /continue_generation``: queued requests run again."""
        scheduler.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(request: HttpRequest):
        """SGLang ``POST /abort_request`` (``AbortReq{rid, abort_all}``): queued requests with
        that rid (all of them for ``""`` or ``abort_all``, which also cuts the running batch
        short: ``Scheduler.abort``) answer with finish_reason abort."""
        try:
            body = await json_body(request)
        except ValueError as e:
            return _error(str(e))
        scheduler.abort(str(body.get("rid") or ""), bool(body.get("abort_all", False)))
        return Response(status_code=200)


def _info_routes(app: FastAPI, engine: Any, scheduler: Scheduler, model_dir: str, settings: dict) -> None:
    @app.get("/get_weight_version")
    async def get_weight_version():
        """SGLang ``GET /get_weight_version``."""
        return {"weight_version": engine.weight_version}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info():
        """SGLang ``GET /get_model_info`` (Miles also reads ``/model_info``)."""
        return {"model_path": model_dir, "tokenizer_path": model_dir, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": engine.weight_version}

    @app.get("/get_server_info")
    async def get_server_info():
        """SGLang ``GET /get_server_info``: settings plus scheduler counters (ours: requests,
        batches, engine calls) in ``internal_states``."""
        state = {**scheduler.stats, "num_waiting": scheduler.num_waiting, "paused": scheduler.paused}
        return {"model_path": model_dir, **settings, "weight_version": engine.weight_version,
                "internal_states": [state], **state, "version": "miles",
                "accepts_buckets": isinstance(engine, ReceivesWeights) and engine.accepts_buckets}


def _weight_handler(engine: Any, scheduler: Scheduler, route: str, method: str, groups: GroupJoins,
                    weights_dirs: list[str] | None):
    """SGLang's weight endpoints (``/update_weights_from_disk``, ``/init_weights_update_group``,
    ... in ``http_server.py``): the engine method of the same name, run on the engine thread."""
    async def handler(request: HttpRequest):
        fn = getattr(engine, method, None)
        if not callable(fn):
            return JSONResponse({"success": False, "message": f"engine does not support {method}"},
                                status_code=400)
        try:
            kwargs = _accepted_kwargs(fn, await json_body(request), route)
            if route == "update_weights_from_disk":
                check_disk_path(kwargs.get("model_path"), weights_dirs)
            if route == "init_weights_update_group":
                check_join_args(kwargs)
        except (ValueError, MilesError) as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        try:
            if route == "init_weights_update_group":  # may wait long on its peers: not on the engine thread
                result = await groups.join(fn, kwargs)
            else:
                result = await scheduler.call(lambda: fn(**kwargs))
        except JoinBusy as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=409)
        except Exception as e:  # noqa: BLE001 - reported to the client as SGLang does
            return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}"},
                                status_code=400)
        content = _weight_response(route, result)
        return JSONResponse(content, status_code=200 if content["success"] else 400)

    handler.__name__ = route
    return handler


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
          settings: dict | None = None) -> int:
    """Load ``model_dir`` into a torch engine and serve it until SIGTERM/SIGINT; returns 0."""
    from miles.config import validate_settings
    from miles.errors import ConfigError

    from .config import TorchEngineConfig

    if api_key is None:
        api_key = os.environ.get("MILES_API_KEY", "").strip() or None
    if api_key is not None:
        check_api_key(api_key)
    check_bind(host, api_key)
    settings = dict(settings or {})
    server_opts = server_settings(settings, host)  # ServerLimits' keys: not engine settings
    if not (Path(model_dir) / "config.json").is_file():
        raise MilesError(f"{model_dir} is not a Hugging Face model folder (no config.json); "
                         f"write one with `miles export RUN_DIR --to FOLDER`")
    problems: list[str] = []
    cfg = validate_settings(TorchEngineConfig, "", settings, problems)
    if problems:
        raise ConfigError(problems, source="miles serve settings (key=value)")
    sock = listening_socket(host, port, backlog=2048)  # before loading the model: a busy port fails fast
    sock.setblocking(False)
    from transformers.utils import logging as hf_logging

    from .engine import TorchEngine

    hf_logging.disable_progress_bar()  # the launcher reads our stdout/stderr
    spec = served_spec(model_dir, cfg)
    tokenizer = spec.build_tokenizer()
    engine = TorchEngine(cfg, spec=spec, tokenizer=tokenizer)
    scheduler = Scheduler(engine)
    app = build_app(engine, scheduler, model_dir=model_dir, api_key=api_key,
                    settings=cfg.model_dump(), **server_opts)
    gc.freeze()  # the model, libraries and app live on: collections skip them (a full one took ~0.2 s)
    try:
        asyncio.run(_run_uvicorn(app, sock, host))
    finally:
        app.state.stop()
        app.state.prep.close()
        sock.close()
    return 0


async def _run_uvicorn(app: Any, sock: socket.socket, host: str) -> None:
    import uvicorn

    loop = asyncio.get_running_loop()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # answer queued requests (as aborted) and waiting joins so the graceful shutdown does
            # not wait on them; run by the loop because a signal handler may interrupt a lock
            loop.call_soon_threadsafe(app.state.stop)
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=10))
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in
    # place that re-raise is a no-op and the process exits 0 with the port released
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        port = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        print(f"miles serve: listening on http://{shown}:{port}", flush=True)
    await task

