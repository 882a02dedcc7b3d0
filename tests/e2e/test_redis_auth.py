"""A Redis that refuses kvhive's credentials stops startup (exit 2, the flag and the URL named, the
password not), for a replica and a gateway; an unreachable Redis does not (a runtime fault).

A real redis-server that requires a password; ``kvhive serve`` and ``kvhive gateway`` as real
processes. The check runs before the model loads, so a refused start costs no model load.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.redis_server import needs_redis_server, running_redis_server
from support.servers import REPO_ROOT, free_port, subprocess_env

from kvhive.core.redis_check import redacted, redis_refusal

pytestmark = needs_redis_server
PASSWORD = "s3cret-pw"


@pytest.fixture(scope="module")
def redis_with_password(tmp_path_factory):
    """A redis-server that requires PASSWORD."""
    with running_redis_server(str(tmp_path_factory.mktemp("redis-auth")), password=PASSWORD) as server:
        yield server


def kvhive(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvhive.cli ARGS``, run to its end."""
    return subprocess.run([sys.executable, "-m", "kvhive.cli", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=subprocess_env(), timeout=120)


def urls(server, password: str | None, db: int = 0) -> str:
    """The server's URL with ``password`` (none: no credentials) and database ``db``."""
    auth = f":{password}@" if password else ""
    return f"redis://{auth}127.0.0.1:{server.port}/{db}"


@pytest.mark.parametrize("password,db,why", [("wrong", 0, "credentials"), (None, 0, "credentials"),
                                             (PASSWORD, 99, "DB index is out of range")])
def test_refusals_are_named(redis_with_password, password, db, why):
    url = urls(redis_with_password, password, db)
    problem = redis_refusal(url, "--redis-url")
    assert problem is not None and why in problem
    assert problem.startswith(f"--redis-url {redacted(url)}:")
    assert "wrong" not in problem and PASSWORD not in problem


def test_accepted_and_unreachable_urls_pass(redis_with_password):
    assert redis_refusal(urls(redis_with_password, PASSWORD), "--redis-url") is None
    assert redis_refusal(f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0", "--redis-url") is None


@pytest.mark.parametrize("flag", ["--redis-url", "--register"])
def test_serve_exits_2_naming_the_url(redis_with_password, flag):
    url = urls(redis_with_password, "wrong")
    done = kvhive("serve", "--port", str(free_port()), flag, url)
    assert done.returncode == 2, done.stderr
    assert f"kvhive serve: {flag} redis://:***@127.0.0.1:{redis_with_password.port}/0: Redis refused" \
        in done.stderr
    assert "wrong" not in done.stderr


@pytest.mark.parametrize("flag", ["--redis-url", "--discover"])
def test_gateway_exits_2_naming_the_url(redis_with_password, flag):
    url = urls(redis_with_password, None)
    done = kvhive("gateway", "--port", str(free_port()), "--replica", f"http://127.0.0.1:{free_port()}",
                  "--model-fingerprint", "", "--block-size", "16", "--hash-seed", "0", flag, url)
    assert done.returncode == 2, done.stderr
    assert f"kvhive gateway: {flag} {url}: Redis refused the credentials" in done.stderr
