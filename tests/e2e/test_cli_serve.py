"""``kvhive serve`` and ``kvhive gateway`` as processes: argument errors (the subcommand's usage, exit
2), a taken port (exit 2 at once, before the model loads), and SIGINT (a clean exit). Their help texts:
tests/unit/test_cli_help.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest
from support.servers import REPO_ROOT, free_port, healthy, subprocess_env, wait_until

from kvhive.cli import build_parser


def _kvhive(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvhive.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO_ROOT, env=subprocess_env())


@pytest.mark.parametrize("command", list(build_parser()[1]))
def test_an_unknown_flag_prints_the_subcommand_usage(command: str) -> None:
    done = _kvhive(command, "--bogus")
    assert done.returncode == 2
    assert done.stderr.startswith(f"usage: kvhive {command} "), done.stderr
    assert f"kvhive {command}: error: unrecognized arguments: --bogus" in done.stderr
    assert done.stdout == ""


def test_argument_errors_belong_to_the_parser_they_concern() -> None:
    before = _kvhive("--bogus", "serve")
    assert before.returncode == 2 and before.stderr.startswith("usage: kvhive [-h]"), before.stderr
    bad_port = _kvhive("serve", "--port", "70000")
    assert bad_port.returncode == 2 and bad_port.stderr.startswith("usage: kvhive serve ")
    assert "70000 is not a port number" in bad_port.stderr
    bad_value = _kvhive("gateway", "--load-weight", "x")
    assert bad_value.returncode == 2 and bad_value.stderr.startswith("usage: kvhive gateway ")


DEEP = "[" * 60_000 + "]" * 60_000      # past Python's JSON and YAML parsers' stacks (one argument < 128 KiB)


@pytest.mark.parametrize("flag", ["--speculative-config", "--kv-transfer-config", "--kv-events-config",
                                  "--allowed-origins", "--config", "--hf-config", "--generation-config"])
def test_json_or_yaml_nested_too_deep_exits_2_naming_the_flag(tmp_path, flag: str) -> None:
    value = DEEP
    if flag in ("--config", "--hf-config"):
        value = str(tmp_path / "deep.yaml")
        (tmp_path / "deep.yaml").write_text(f"port: {DEEP}\n" if flag == "--config" else DEEP)
    elif flag == "--generation-config":
        value = str(tmp_path)
        (tmp_path / "generation_config.json").write_text(DEEP)
    done = _kvhive("serve", flag, value, *(["--load-format", "dummy"] if flag == "--hf-config" else []))
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr and last.startswith("kvhive serve:"), done.stderr[-2000:]
    assert flag in last or value in last, last


@pytest.mark.parametrize(("command", "args", "flag"), [
    ("serve", ("--kv-cache-gb", "nan"), "--kv-cache-gb"),
    ("serve", ("--kv-cache-gb", "1e308"), "--kv-cache-gb"),
    ("serve", ("--cpu-offload-gb", "inf"), "--cpu-offload-gb"),
    ("serve", ("--disk-cache-dir", "DIR", "--disk-cache-gb", "1e308"), "--disk-cache-gb"),
    ("serve", ("--redis-url", "redis://127.0.0.1:9", "--redis-ttl", "1e308"), "--redis-ttl"),
    ("serve", ("--http-header-timeout", "nan"), "--http-header-timeout"),
    ("serve", ("--register", "redis://127.0.0.1:9", "--register-ttl", "1e308"), "--register-ttl"),
    ("serve", ("--max-session-ttl", "1000000000000000000"), "--max-session-ttl"),
    ("serve", ("--num-threads", "100000"), "--num-threads"),
    # Past this machine's memory: refused before anything is allocated (a lazy budget would end in
    # the OOM killer), and a pool given in blocks once the model says how large a block is.
    ("serve", ("--kv-cache-gb", "500000"), "--kv-cache-gb"),
    ("serve", ("--cpu-offload-gb", "100000"), "--cpu-offload-gb"),
    ("serve", ("--num-blocks", "1000000000000"), "--num-blocks"),
    # A context past the model's (8,192 tokens) is refused once the model says its own, not capped.
    ("serve", ("--max-model-len", "8193"), "--max-model-len"),
    ("serve", ("--max-model-len", "0"), "--max-model-len"),
    ("gateway", ("--replica", "http://127.0.0.1:9", "--cache-weight", "nan"), "--cache-weight"),
    ("gateway", ("--replica", "http://127.0.0.1:9", "--load-weight", "inf"), "--load-weight"),
    ("gateway", ("--replica", "http://127.0.0.1:9", "--cache-weight", "1e308"), "--cache-weight"),
    ("gateway", ("--replica", "http://127.0.0.1:9", "--health-interval", "1e308"), "--health-interval"),
    ("gateway", ("--replica", "http://127.0.0.1:9", "--session-affinity-ttl", "10" * 11), "--session-affinity-ttl"),
])
def test_numbers_that_are_not_finite_or_past_any_machine_exit_2(tmp_path, command: str, args: tuple[str, ...],
                                                                 flag: str) -> None:
    done = _kvhive(command, "--port", "0", *(str(tmp_path) if a == "DIR" else a for a in args), timeout_s=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert last.startswith(f"kvhive {command}:") and flag in last, last


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_a_taken_port_fails_fast_before_the_model_loads(taken_port: int, command: str) -> None:
    # In a fresh interpreter, so the modules loaded are the command's own: a taken port must stop it
    # before torch (and so the model) is imported.
    flags = ["--replica", "http://127.0.0.1:9"] if command == "gateway" else []
    code = ("import sys\nfrom kvhive.cli import main\n"
            f"rc = main([{command!r}, '--port', '{taken_port}', *{flags!r}])\n"
            "print('torch' in sys.modules, 'kvhive.engine.llm_engine' in sys.modules)\nsys.exit(rc)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT, env=subprocess_env())
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"kvhive {command}: port {taken_port} on 127.0.0.1 is in use (pick another with --port)\n"
    assert done.stdout.split() == ["False", "False"]
    assert elapsed < 5, f"took {elapsed:.1f}s"


def test_the_serve_command_reports_a_taken_port_within_seconds(taken_port: int) -> None:
    start = time.monotonic()
    done = _kvhive("serve", "--port", str(taken_port))
    elapsed = time.monotonic() - start
    assert done.returncode == 2
    assert f"port {taken_port} on 127.0.0.1 is in use" in done.stderr
    assert elapsed < 5, f"took {elapsed:.1f}s"


def test_sigint_stops_the_server_cleanly() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvhive.cli", "serve", "--port", str(port),
                             "--kv-cache-gb", "0.1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
                            env=subprocess_env())
    try:
        wait_until(lambda: proc.poll() is not None or healthy(f"http://127.0.0.1:{port}"), 180, "kvhive serve")
        assert proc.poll() is None
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_flags_from_a_config_file_and_the_positional_model(taken_port: int, tmp_path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(f"port: {taken_port}\nkv-cache-gb: 0.5\nshare_prefix_cache: true\n")
    from_file = _kvhive("serve", "--config", str(config))
    assert from_file.returncode == 2 and f"port {taken_port} on 127.0.0.1 is in use" in from_file.stderr
    config.write_text(f"port: {free_port()}\n")
    overridden = _kvhive("serve", "--config", str(config), "--port", str(taken_port))   # the command line wins
    assert overridden.returncode == 2 and f"port {taken_port} on 127.0.0.1 is in use" in overridden.stderr
    config.write_text("prot: 8000\n")
    unknown = _kvhive("serve", "--config", str(config))
    assert unknown.returncode == 2 and unknown.stderr.startswith("usage: kvhive serve ")
    assert f"--config {config}: unknown key 'prot'" in unknown.stderr
    config.write_text("kv_cache_gb: lots\n")
    bad = _kvhive("serve", "--config", str(config))
    assert bad.returncode == 2 and f"--config {config}: argument --kv-cache-gb: 'lots' is not a number" in bad.stderr
    positional = _kvhive("serve", "/no/such/model.gguf", "--port", str(free_port()))
    assert positional.returncode == 2 and "/no/such/model.gguf does not exist" in positional.stderr
    both = _kvhive("serve", "/no/such/model.gguf", "--model", "/other/model.gguf")
    assert both.returncode == 2
    assert "MODEL '/no/such/model.gguf' and --model '/other/model.gguf' name different models" in both.stderr
