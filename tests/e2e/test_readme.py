"""README.md's examples, run as written against a real server on the default model.

Every fenced ``bash`` and ``python`` block of README.md is either run here or listed in ``SKIPPED``
with the reason. A block that is run talks to ``http://127.0.0.1:8000``: that address becomes the
test server's, and ``SESSION_ID`` the id the block's own create call answered (``x-session-id``).
Each curl command of a bash block runs on its own and must answer 2xx; a python block runs in a
fresh interpreter and must exit 0. ``ANSWERS`` lists what some blocks' output must say.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.servers import REPO_ROOT, ServerProcess, start_server, stop_server

README = os.path.join(REPO_ROOT, "README.md")
README_URL = "http://127.0.0.1:8000"

# Blocks not run, by their first line: they install software or start servers.
SKIPPED = {
    "python3 -m venv .venv && . .venv/bin/activate":
        "creates and activates a virtual environment (the suite runs in one already)",
    "bash scripts/install.sh && kvhive serve --port 8000":
        "installs the package, then starts a server on port 8000 (the test's server stands in for it)",
    "bash scripts/test.sh":
        "installs Debian packages and runs this whole suite",
    "kvhive serve --cpu-offload-gb 4 --disk-cache-dir ~/.cache/kvhive/kv-tier --disk-cache-gb 50 \\":
        "starts a server with a disk tier and a Redis tier (tests/e2e/test_tiers_e2e.py runs the tiers)",
    "kvhive serve --port 8001 --kv-events 'tcp://*:5557' --kv-events-replay 'tcp://*:5558' &":
        "starts two replicas and a gateway in the background (tests/e2e/test_gateway.py runs them)",
    "ray start --head --num-cpus 1                                    # one node; on each other node:":
        "starts a Ray cluster and the Ray Serve application (tests/e2e/test_ray_cluster.py runs them)",
    "kvhive serve --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'":
        "starts a server with n-gram speculation (tests/e2e/test_speculative_serve.py runs one)",
    "kvhive serve --port 8200 --kv-role decode --kv-transfer-port 7600 &":
        "starts a decode and a prefill replica and a gateway in the background "
        "(tests/e2e/test_disagg_serve.py runs them)",
}

# What the output of a block must contain, by a line of the block.
ANSWERS = {
    """  -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "What is the capital of """
    """France?"}], "max_tokens": 32, "temperature": 0}'""": "Paris",
    "r = client.chat.completions.create(model=\"smollm2-135m\", max_tokens=32, temperature=0,": "Paris",
    "print(r2.output_text, r2.usage.input_tokens_details.cached_tokens)": "Rome",
    """  -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "The capital of France, as """
    """JSON."}], "max_tokens": 64, "temperature": 0, "response_format": {"type": "json_schema", "json_schema": """
    """{"name": "city", """
    """"schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}}'""":
        "city",
    """  -d '{"model": "smollm2-135m", "max_tokens": 32, "system": [{"type": "text", "text": "You answer from this """
    """manual: ...", "cache_control": {"type": "ephemeral"}}], "messages": [{"role": "user", "content": "How do I """
    """reset it?"}]}'""": '"type":"message"',
}


@dataclass(frozen=True)
class Block:
    """One fenced code block of README.md."""

    language: str
    line: int           # of its first line of code, 1-based
    code: str

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0]

    @property
    def name(self) -> str:
        return f"README.md:{self.line}:{self.language}"


def readme_blocks() -> list[Block]:
    """The ```bash and ```python blocks of README.md, in order."""
    text = Path(README).read_text()
    blocks = []
    for match in re.finditer(r"^```(bash|python)\n(.*?)^```$", text, re.M | re.S):
        line = text.count("\n", 0, match.start(2)) + 1
        blocks.append(Block(match.group(1), line, match.group(2)))
    return blocks


BLOCKS = readme_blocks()
RUN = [b for b in BLOCKS if b.first_line not in SKIPPED]


def commands(block: Block) -> list[str]:
    """A bash block's commands: continuation lines joined, comment-only and blank lines dropped."""
    joined = re.sub(r"\\\n", " ", block.code)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_every_block_is_run_or_skipped_with_a_reason() -> None:
    assert {b.language for b in BLOCKS} == {"bash", "python"}
    assert len(RUN) >= 4
    for block in RUN:
        assert README_URL in block.code, f"{block.name} is not skipped and does not talk to {README_URL}"
        if block.language == "bash":
            assert all(c.lstrip().startswith("curl ") for c in commands(block)), block.name
    listed = [b.first_line for b in BLOCKS if b.first_line in SKIPPED]
    assert sorted(listed) == sorted(SKIPPED), "SKIPPED names a block README.md no longer has"
    answered = [line for b in RUN for line in b.code.splitlines() if line in ANSWERS]
    assert sorted(answered) == sorted(ANSWERS), "ANSWERS names a line no block that runs has"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    pytest.importorskip("openai")
    proc = start_server("default")
    yield proc
    stop_server(proc)


def _expected(block: Block) -> str | None:
    return next((ANSWERS[line] for line in block.code.splitlines() if line in ANSWERS), None)


def _run_curl(command: str, cwd: Path) -> tuple[int, str]:
    """Run one curl command with bash; (HTTP status, what it printed before the status)."""
    script = "curl() { command curl --write-out '\\n%{http_code}' \"$@\"; }\n" + command
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert done.returncode == 0, f"{command}\nexit {done.returncode}: {done.stderr}"
    output, _, status = done.stdout.rpartition("\n")
    return int(status), output


@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_readme_example_runs_as_written(block: Block, server: ServerProcess, tmp_path: Path) -> None:
    expected = _expected(block)
    if block.language == "python":
        code = block.code.replace(README_URL, server.base_url)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip(), "printed nothing"
        if expected is not None:
            assert expected in done.stdout, done.stdout
        return
    session_id: str | None = None
    outputs = []
    for command in commands(block):
        if "SESSION_ID" in command:
            assert session_id is not None, f"{command}: no earlier command answered x-session-id"
            command = command.replace("SESSION_ID", session_id)
        status, output = _run_curl(command.replace(README_URL, server.base_url), tmp_path)
        assert 200 <= status < 300, f"{command}\nHTTP {status}: {output}"
        header = re.search(r"^x-session-id: (\S+)\r?$", output, re.M | re.I)
        if header:
            session_id = header.group(1)
        outputs.append(output)
    if expected is not None:
        assert expected in "\n".join(outputs), outputs
