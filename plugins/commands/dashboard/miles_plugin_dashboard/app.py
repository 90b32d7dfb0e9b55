"""The dashboard's web application: one self-contained page (HTML, CSS and a small script of our
own, no CDN: it works offline) and the JSON routes it polls. An API key, when set, is required on
every route: ``Authorization: Bearer KEY``, or ``?key=KEY`` once in the browser (then a cookie)."""
from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from miles_telemetry.files import finite

from .runs import RunView

STATIC = Path(__file__).parent / "static"
COOKIE = "miles_dashboard_key"


def build_app(views: list[RunView], api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="miles dashboard", openapi_url=None, docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Response:
        if api_key is None:
            return await call_next(request)
        given = request.query_params.get("key")
        if given is not None and hmac.compare_digest(given, api_key):
            # the key leaves the address bar: a cookie carries it from now on
            resp = RedirectResponse(request.url.remove_query_params("key"), status_code=303)
            resp.set_cookie(COOKIE, api_key, httponly=True, samesite="strict")
            return resp
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else request.cookies.get(COOKIE, "")
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            return JSONResponse({"error": "this dashboard needs its API key: send 'Authorization: Bearer KEY' "
                                          "or open the page once with ?key=KEY"}, status_code=401)
        return await call_next(request)

    def view(run: int) -> RunView:
        if not 0 <= run < len(views):
            raise HTTPException(404, f"no run {run}: this dashboard shows runs 0-{len(views) - 1}")
        return views[run]

    @app.get("/")
    async def index() -> HTMLResponse:
        return HTMLResponse((STATIC / "index.html").read_text())

    @app.get("/static/{name}")
    async def static(name: str) -> FileResponse:
        path = STATIC / name
        if name not in {p.name for p in STATIC.iterdir()}:
            raise HTTPException(404, f"no file {name}")
        return FileResponse(path)

    @app.get("/api/runs")
    def runs() -> list[dict[str, Any]]:
        return [{"id": i, **v.status()} for i, v in enumerate(views)]

    @app.get("/api/runs/{run}/metrics")
    def metrics(run: int, generation: int = -1, after: int = 0) -> JSONResponse:
        """Rows after the first ``after`` of ``generation``; all rows when the file was rewritten."""
        gen, rows = view(run).metric_rows()
        start = after if generation == gen else 0
        return JSONResponse(finite({"generation": gen, "start": start, "rows": rows[start:]}))

    @app.get("/api/runs/{run}/timeline")
    def timeline(run: int, last: int = 50) -> JSONResponse:
        return JSONResponse(finite(view(run).timelines(last)))

    @app.get("/api/runs/{run}/samples")
    def samples(run: int, step: int | None = None) -> JSONResponse:
        """The sampled trajectories of ``step`` (default: the newest step that has some)."""
        rows = view(run).samples()
        by_step: dict[int, list[dict[str, Any]]] = {}
        for r in rows:
            if isinstance(r.get("step"), int):
                by_step.setdefault(r["step"], [])
                by_step[r["step"]] = [x for x in by_step[r["step"]] if x.get("index") != r.get("index")] + [r]
        steps = sorted(by_step)
        pick = step if step in by_step else (steps[-1] if steps else None)
        return JSONResponse(finite({"steps": steps, "step": pick, "samples": by_step.get(pick, [])}))

    @app.get("/api/runs/{run}/devices")
    def devices(run: int, last: int = 600) -> JSONResponse:
        return JSONResponse(finite(view(run).devices()[-last:]))

    return app
