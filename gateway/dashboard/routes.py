"""The dashboard: its page and assets (shipped in the package, nothing fetched at run time) and the current
benchmark results it shows: those docs/benchmarks/current.json lists (written by ``python -m benchmarks.report``,
the same list as the README's results table), each with its plot. The page holds no data: it asks for an API key and reads the JSON API with it
(GET /v1/sessions, /v1/sessions/{id}/graph, /v1/engines) as any client does, so it needs no key itself."""

from __future__ import annotations

from pathlib import Path

import msgspec
from litestar import Response, get
from litestar.datastructures import State
from litestar.params import FromPath
from litestar.response import File
from litestar.static_files import create_static_files_router

from gateway.errors import APIError

STATIC = Path(__file__).parent / "static"
# Where the committed benchmark results live in a checkout; absent from an installed wheel.
DEFAULT_BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
# The page handles an API key: it runs only its own scripts, talks only to this gateway, and is framed by nobody
# (nosniff, as every response has, comes from http_plumbing/request_context.py).
_PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
_PUBLIC = {"exclude_from_auth": True}


class BenchmarkResult(msgspec.Struct):
    """One row of the current results: what was measured, against whom, the ratio, where and when."""
    what: str
    vs: str
    ratio: str
    host: str
    date: str


class CurrentResult(BenchmarkResult):
    json: str
    png: str | None = None


class CurrentResults(msgspec.Struct):
    results: list[CurrentResult]


class BenchmarkPlot(msgspec.Struct):
    """One result file: its plot (``url`` None when it has none) and the rows read from it."""
    name: str
    url: str | None
    results: list[BenchmarkResult]


class BenchmarkPlots(msgspec.Struct):
    data: list[BenchmarkPlot]
    object: str = "list"


CURRENT_RESULTS = "current.json"


def current_results(directory: Path | None) -> list[BenchmarkPlot]:
    """The results the folder's current.json lists, one entry per result file in its order, each with its plot
    when the folder holds it; none when the list is missing, unreadable or malformed."""
    if directory is None:
        return []
    try:
        listed = msgspec.json.decode((directory / CURRENT_RESULTS).read_bytes(), type=CurrentResults).results
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return []
    plots: dict[str, BenchmarkPlot] = {}
    for result in listed:
        plot = plots.get(result.json)
        if plot is None:
            png = result.png if result.png and Path(result.png).name == result.png else None
            has_plot = png is not None and png.endswith(".png") and (directory / png).is_file()
            plot = plots[result.json] = BenchmarkPlot(name=png if has_plot else result.json,
                                                      url=f"/dashboard/benchmarks/{png}" if has_plot else None,
                                                      results=[])
        plot.results.append(BenchmarkResult(result.what, result.vs, result.ratio, result.host, result.date))
    return list(plots.values())


def benchmark_plots(directory: Path | None) -> dict[str, Path]:
    """The plots of the current results by file name: the only files the dashboard serves from the folder."""
    return {plot.name: directory / plot.name for plot in current_results(directory) if plot.url}


@get("/dashboard", opt=_PUBLIC, include_in_schema=False)
async def dashboard_page() -> Response:
    return Response((STATIC / "index.html").read_bytes(), media_type="text/html; charset=utf-8",
                    headers=_PAGE_HEADERS)


@get("/dashboard/benchmarks", opt=_PUBLIC, include_in_schema=False)
async def list_benchmark_plots(state: State) -> BenchmarkPlots:
    return BenchmarkPlots(data=current_results(state.benchmarks_dir))


@get("/dashboard/benchmarks/{name:str}", opt=_PUBLIC, include_in_schema=False)
async def benchmark_plot(name: FromPath[str], state: State) -> File:
    path = benchmark_plots(state.benchmarks_dir).get(name)  # listed names only: nothing else can be reached
    if path is None:
        raise APIError(404, f"no benchmark plot {name!r}", code="not_found")
    return File(path, media_type="image/png", content_disposition_type="inline")


DASHBOARD_ROUTES = [
    dashboard_page, list_benchmark_plots, benchmark_plot,
    create_static_files_router("/dashboard/static", [STATIC], opt=_PUBLIC, name="dashboard-static",
                               include_in_schema=False),
]
