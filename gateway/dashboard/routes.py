"""The dashboard: its page and assets (shipped in the package, nothing fetched at run time) and the
benchmark plots it links. The page holds no data: it asks for an API key and reads the JSON API with it
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


class BenchmarkPlot(msgspec.Struct):
    name: str
    url: str


class BenchmarkPlots(msgspec.Struct):
    data: list[BenchmarkPlot]
    object: str = "list"


def benchmark_plots(directory: Path | None) -> dict[str, Path]:
    """The PNGs of the benchmarks folder by file name; none when it is missing or unreadable."""
    try:
        return {p.name: p for p in sorted(directory.glob("*.png")) if p.is_file()} if directory else {}
    except OSError:
        return {}


@get("/dashboard", opt=_PUBLIC, include_in_schema=False)
async def dashboard_page() -> Response:
    return Response((STATIC / "index.html").read_bytes(), media_type="text/html; charset=utf-8",
                    headers=_PAGE_HEADERS)


@get("/dashboard/benchmarks", opt=_PUBLIC, include_in_schema=False)
async def list_benchmark_plots(state: State) -> BenchmarkPlots:
    return BenchmarkPlots(data=[BenchmarkPlot(name=name, url=f"/dashboard/benchmarks/{name}")
                                for name in benchmark_plots(state.benchmarks_dir)])


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
