"""`sprout view`: one page (view.html, no build step) over a small JSON API (sprout.report.view), served by
FastAPI on loopback, or written as one static file with the API's answers embedded."""

import json
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from ..errors import SproutError
from .follow import follow_evaluation, follow_group
from .search_tree import GroupView
from .view import EvaluationView, Index, Runs, TrajectoryView, TurnDiff

# The page loads nothing from elsewhere and runs only its own inline script.
POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
          "img-src data:; base-uri 'none'; form-action 'none'")


def page(data: dict[str, object] | None = None) -> str:
    """The page; with `data` (API path -> JSON), a static one that needs no server."""
    html = resources.files("sprout.report").joinpath("view.html").read_text()
    if data is None:
        return html
    # `<` escaped, so nothing the agent wrote can close the script element
    embedded = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")
    return html.replace("<!--SPROUT-DATA-->", f'<script id="sprout-data" type="application/json">{embedded}</script>')


def static_page(runs: Runs) -> str:
    return page({path: view.model_dump(mode="json") for path, view in runs.pages()})


def app(runs: Runs) -> FastAPI:
    api = FastAPI(title="Sprout view", docs_url=None, redoc_url=None, openapi_url=None)

    @api.exception_handler(SproutError)
    async def not_found(_: Request, error: SproutError) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=404)

    @api.middleware("http")
    async def headers(request: Request, call_next):
        response = await call_next(request)
        response.headers["Content-Security-Policy"] = POLICY
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    @api.get("/health")
    def health() -> dict[str, bool]:
        return {"ok": True}

    @api.get("/", response_class=HTMLResponse)
    def root() -> str:
        return page()

    @api.get("/api/index")
    def index() -> Index:
        return runs.index()

    @api.get("/api/evaluations/{number}")
    def evaluation(number: int) -> EvaluationView:
        return runs.evaluation(number)

    @api.get("/api/evaluations/{number}/attempts/{attempt}")
    def trajectory(number: int, attempt: str) -> TrajectoryView:
        return runs.trajectory(number, attempt)

    @api.get("/api/evaluations/{number}/attempts/{attempt}/turns/{turn}/diff")
    def turn_diff(number: int, attempt: str, turn: int) -> TurnDiff:
        return runs.turn_diff(number, attempt, turn)

    @api.get("/api/evaluations/{number}/events")
    def evaluation_events(number: int) -> StreamingResponse:
        runs.summary(number)  # a 404 here, not a broken stream
        return StreamingResponse(follow_evaluation(runs.evaluation_dir(number)), media_type="text/event-stream")

    @api.get("/api/groups/{number}/events")
    def group_events(number: int) -> StreamingResponse:
        return StreamingResponse(follow_group(runs.group_dir(number)), media_type="text/event-stream")

    @api.get("/api/groups/{number}")
    def group(number: int) -> GroupView:
        return runs.group(number)

    @api.get("/api/groups/{number}/slots/{slot}")
    def slot(number: int, slot: str) -> TrajectoryView:
        return runs.slot_trajectory(number, slot)

    @api.get("/api/groups/{number}/slots/{slot}/turns/{turn}/diff")
    def slot_turn_diff(number: int, slot: str, turn: int) -> TurnDiff:
        return runs.slot_turn_diff(number, slot, turn)

    return api


def write_static(runs: Runs, output: Path) -> int:
    """Writes the static page; its size in bytes."""
    text = static_page(runs)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    return len(text.encode())
