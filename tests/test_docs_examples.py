"""Every example in README.md and docs/ runs as written, against a real `parrot serve` (the builtin engine on
SmolLM2), and prints a useful answer.

In the Markdown, a fenced block of code is tagged after its language: ```` ```python example ```` runs here and
the line after its closing fence says what its output must contain (``<!-- expect: REGEX -->``, a Python
regular expression searched in its stdout); ```` ```toml example ```` must load as a gateway config file;
```` ```bash no-run ```` is shown only (installs, servers, benchmarks that take minutes). A block of code with
neither tag fails the test, so no example goes untested. The only change made to an example before it runs is
the gateway's address: 127.0.0.1:8000 (or localhost:8000) becomes this test gateway's. The examples run a few
at a time, each in its own process, against one gateway for the module."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.support.markers import marks_users
from tests.support.models import SMOLLM
from tests.support.servers import free_port
from tests.support import plain_http

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
CODE = {"python", "bash", "sh", "shell", "console", "toml"}
RUNNERS = {"python": [sys.executable, "-c"], "bash": ["bash", "-euo", "pipefail", "-c"]}
ADDRESS = re.compile(r"(?:127\.0\.0\.1|localhost):8000\b")
FENCE = re.compile(r"^```(\S*)(.*)$")
EXPECT = re.compile(r"^<!-- expect: (.+) -->$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    tags: tuple[str, ...]
    code: str
    expect: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks(path: Path) -> Iterator[Block]:
    """The fenced blocks of a Markdown file, with the expectation written after each."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        start, language, tags = i + 1, opened.group(1), tuple(opened.group(2).split())
        i += 1
        while i < len(lines) and lines[i] != "```":
            i += 1
        assert i < len(lines), f"{path}:{start}: fence never closed"
        code = "\n".join(lines[start:i]) + "\n"
        expect = EXPECT.match(lines[i + 1]) if i + 1 < len(lines) else None
        yield Block(path, start, language, tags, code, expect.group(1) if expect else None)
        i += 1


ALL = [block for path in DOCUMENTS for block in blocks(path)]
EXAMPLES = [b for b in ALL if "example" in b.tags and b.language != "toml"]
CONFIGS = [b for b in ALL if "example" in b.tags and b.language == "toml"]


def test_every_block_of_code_is_an_example_or_marked_no_run():
    untagged = [b.name for b in ALL if b.language in CODE and not {"example", "no-run"} & set(b.tags)]
    assert not untagged, f"tag these blocks `example` (and add <!-- expect: ... -->) or `no-run`: {untagged}"
    unlabelled = [b.name for b in ALL if not b.language]
    assert not unlabelled, f"give these fenced blocks a language (text for plain text): {unlabelled}"
    missing = [b.name for b in EXAMPLES if b.expect is None]
    assert not missing, f"examples without <!-- expect: REGEX --> after their closing fence: {missing}"
    unknown = [b.name for b in EXAMPLES if b.language not in RUNNERS]
    assert not unknown, f"examples in a language this test cannot run: {unknown}"


def test_the_readme_shows_the_three_clients_and_a_semantic_call():
    readme = [b for b in EXAMPLES if b.path.name == "README.md"]
    assert [b.language for b in readme] == ["bash", "python", "python", "python"]
    assert "from openai import OpenAI" in readme[1].code and "langchain_openai" in readme[2].code
    assert '"parrot"' in readme[3].code


@pytest.mark.parametrize("block", CONFIGS, ids=lambda b: b.name)
def test_config_example_loads(block: Block, tmp_path):
    from gateway.config import load_config

    path = tmp_path / "parrot.toml"
    path.write_text(block.code)
    config = load_config(path, env={})  # unknown keys or wrong types raise
    assert config.upstreams, "the example configures an upstream"


@pytest.fixture(scope="module")
@marks_users("model", "subprocess")
def examples_gateway() -> Iterator[str]:
    """`parrot serve` as `make serve` runs it (the builtin engine on SmolLM2), on free ports; one for every
    example of this module."""
    port, engine_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.server.cli", "serve", "--port", str(port), "--engine-port", str(engine_port)],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert process.poll() is None, "parrot serve exited during startup"
            assert time.monotonic() < deadline, "the builtin engine never became ready"
            try:
                if plain_http.get(f"{url}/health/ready", timeout=5).status_code == 200 and \
                        SMOLLM in plain_http.get(f"{url}/v1/models", timeout=5).text:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class Run:
    returncode: int | None
    stdout: str
    stderr: str


CONCURRENT = 2  # examples running at once: the engine batches their requests, and each still answers well within
                # the timeouts the examples themselves set (all at once, a loaded 2-core box could not)


@pytest.fixture(scope="module")
def runs(examples_gateway: str, request: pytest.FixtureRequest) -> dict[str, Run]:
    """Every selected example run as written, each in its own process as a reader would run it, a few at a time."""
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_example_runs_as_written"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def run(block: Block) -> Run:
        try:
            done = subprocess.run([*RUNNERS[block.language], ADDRESS.sub(examples_gateway, block.code)], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as exc:
            return Run(None, str(exc.stdout or ""), f"{exc.stderr or ''}\n(killed: still running after 300 s)")
        return Run(done.returncode, done.stdout, done.stderr)

    with ThreadPoolExecutor(CONCURRENT) as pool:
        return dict(zip([b.name for b in selected], pool.map(run, selected)))


@pytest.mark.parametrize("block", EXAMPLES, ids=lambda b: b.name)
def test_example_runs_as_written(block: Block, runs: dict[str, Run]):
    assert ADDRESS.search(block.code), f"{block.name} does not talk to the gateway at 127.0.0.1:8000"
    ran = runs[block.name]
    assert ran.returncode == 0, f"{block.name} failed:\n{ran.stdout}\n{ran.stderr}"
    assert re.search(block.expect, ran.stdout), f"{block.name} printed no useful answer ({block.expect!r}):\n{ran.stdout}"
