"""``/metrics`` over real HTTP: ``kvhive serve --metrics-compat vllm`` exports vLLM's names and types
with counts that match the requests made; without the flag no ``vllm:`` name appears; and
docs/metrics.md lists exactly the metric families ``kvhive serve`` and ``kvhive gateway`` export.

Rows of docs/metrics.md name when a family appears (``always``, ``a store tier``, ``a replica with
events``, ``no --redis-url``, ``--redis-url``, ``--metrics-compat vllm``, ``a response created``,
``--kv-role prefill or decode``); the processes here meet every condition but the last three, so those rows are checked for being documented
(with their type when they show), not for being scraped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.cluster import Cluster, start_gateway, stop_gateway
from support.kvhive_serve import ServeProcess
from support.servers import REPO_ROOT, ServerProcess, free_port, subprocess_env

from kvhive.server.metrics_vllm import VLLM_NAMES

MODEL = "smollm2-135m"
DOC = os.path.join(REPO_ROOT, "docs", "metrics.md")
MET_HERE = {"always", "a store tier", "a replica with events", "no --redis-url", "--metrics-compat vllm",
            "--speculative-config"}
SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
REQUESTS = [  # (route, body): greedy, ignore_eos, so each ends by length with max_tokens tokens
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4}),
    ("/v1/completions", {"prompt": "One, two, three,", "max_tokens": 3, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 5}),
]


def scrape(url: str) -> dict[str, object]:
    """{family name: family} of one /metrics scrape (prometheus_client's own parser; counters
    without ``_total``, as in the exposition's families)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def sample(families: dict, family: str, name: str | None = None, **labels: str) -> float:
    """The sum of ``family``'s samples called ``name`` (default: the family's) whose labels include ``labels``."""
    wanted = name or family
    return sum(s.value for s in families[family].samples
               if s.name == wanted and all(s.labels.get(k) == v for k, v in labels.items()))


def documented(section: str) -> dict[str, tuple[str, str]]:
    """{family name: (type, when)} of the table rows under ``## <section>`` in docs/metrics.md."""
    rows, current = {}, None
    with open(DOC) as f:
        for line in f:
            if line.startswith("## "):
                current = line[3:].strip()
            elif current == section and line.startswith("| `"):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                name, kind, when = cells[0].strip("`"), cells[1], cells[2]
                rows[name.removesuffix("_total") if kind == "counter" else name] = (kind, when)
    return rows


def documented_vllm_names() -> dict[str, tuple[str, str]]:
    """{kvhive family: (vLLM family, type)} of the name table in docs/metrics.md."""
    names = {}
    with open(DOC) as f:
        for line in f:
            match = re.match(r"\| `(kvhive_\w+)` \| `(vllm:\w+)` \| (\w+) \|", line)
            if match:
                kvhive, vllm, kind = match.groups()
                names[kvhive.removesuffix("_total")] = (vllm.removesuffix("_total"), kind)
    return names


@pytest.fixture(scope="module")
def vllm_server() -> Iterator[tuple[ServeProcess, int]]:
    events_port = free_port()
    server = ServeProcess("--metrics-compat", "vllm", "--cpu-offload-gb", "0.05", "--max-model-len", "1024",
                          "--kv-events", f"tcp://127.0.0.1:{events_port}", "--speculative-config", SPECULATIVE)
    yield server, events_port
    server.stop()


@pytest.fixture(scope="module")
def answered(vllm_server) -> list[dict]:
    """The usage of each of REQUESTS, made once against the vLLM-compatible server."""
    server, _ = vllm_server
    usages = []
    for route, body in REQUESTS:
        body = {"model": MODEL, "temperature": 0, "ignore_eos": True, **body}
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
            with httpx.stream("POST", server.url + route, json=body, timeout=120) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line.startswith("data: {")]
            usages.append(httpx.Response(200, content=lines[-1][6:]).json()["usage"])
        else:
            r = httpx.post(server.url + route, json=body, timeout=120)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
    return usages


def test_each_vllm_name_has_vllms_type_and_counts_the_requests_made(vllm_server, answered) -> None:
    server, _ = vllm_server
    m = scrape(server.url)
    for kvhive_name, alias in VLLM_NAMES.items():
        assert alias.name in m, alias.name
        assert m[alias.name].type == m[kvhive_name].type, alias.name
        for s in m[alias.name].samples:
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0", s
    n = len(REQUESTS)
    prompt = sum(u["prompt_tokens"] for u in answered)
    output = sum(u["completion_tokens"] for u in answered)
    assert output == sum(body["max_tokens"] for _, body in REQUESTS)
    assert sample(m, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == n
    assert sample(m, "vllm:request_success", "vllm:request_success_total") == n
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                 "request_decode_time", "request_inference_time", "request_time_per_output_token"):
        assert sample(m, f"vllm:{name}_seconds", f"vllm:{name}_seconds_count") == n, name
    assert sample(m, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == output - n
    assert sample(m, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt
    assert sample(m, "vllm:generation_tokens", "vllm:generation_tokens_total") == output
    assert sample(m, "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == prompt
    assert sample(m, "vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == output
    assert sample(m, "vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == output
    assert sample(m, "vllm:num_requests_running") == 0 and sample(m, "vllm:num_requests_waiting") == 0
    assert 0 <= sample(m, "vllm:kv_cache_usage_perc") <= 1
    queries = sample(m, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
    assert queries >= prompt and 0 <= sample(m, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") <= queries
    external = sample(m, "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_queries_total")
    assert 0 <= sample(m, "vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_hits_total") <= external
    (info,) = m["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["enable_prefix_caching"] == "True"
    assert float(info.labels["num_gpu_blocks"]) == sample(m, "kvhive_cache_num_blocks")
    drafts = sample(m, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total")
    accepted = sample(m, "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [sample(m, "vllm:spec_decode_num_accepted_tokens_per_pos",
                      "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in range(4)]
    assert sorted(s.labels["position"] for s in m["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
                  if s.name.endswith("_total")) == ["0", "1", "2", "3"]
    assert sum(per_pos) == accepted <= sample(m, "vllm:spec_decode_num_draft_tokens",
                                               "vllm:spec_decode_num_draft_tokens_total")
    assert drafts >= per_pos[0] and per_pos == sorted(per_pos, reverse=True)     # a later position only after an earlier


def test_vllm_names_show_the_same_values_as_the_kvhive_names(vllm_server, answered) -> None:
    server, _ = vllm_server
    m = scrape(server.url)
    for kvhive_name, alias in VLLM_NAMES.items():
        ours = sorted(s.value for s in m[kvhive_name].samples)
        theirs = sorted(s.value for s in m[alias.name].samples)
        assert ours == theirs, kvhive_name


def test_without_the_flag_no_vllm_name_appears(tiny_server: ServerProcess, tiny_client: httpx.Client) -> None:
    r = tiny_client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    text = httpx.get(f"{tiny_server.base_url}/metrics", timeout=10).text
    assert "vllm:" not in text
    m = scrape(tiny_server.base_url)
    assert sample(m, "kvhive_e2e_request_latency_seconds", "kvhive_e2e_request_latency_seconds_count") >= 1
    assert sample(m, "kvhive_request_queue_time_seconds", "kvhive_request_queue_time_seconds_count") >= 1


def test_an_unknown_metrics_compat_is_a_startup_error_naming_it() -> None:
    done = subprocess.run([sys.executable, "-m", "kvhive.cli", "serve", "--metrics-compat", "prometheus"],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, env=subprocess_env())
    assert done.returncode == 2
    assert "argument --metrics-compat: invalid choice: 'prometheus'" in done.stderr


def check_documented(scraped: dict, rows: dict[str, tuple[str, str]]) -> None:
    """Every scraped family is a row with its type; every row whose condition is met here is scraped."""
    undocumented = sorted(set(scraped) - set(rows))
    assert not undocumented, f"exported but not in docs/metrics.md: {undocumented}"
    for name, (kind, when) in rows.items():
        assert when in MET_HERE | {"--redis-url", "a response created", "--kv-role prefill or decode",
                                   "a sliding-window model", "--speculative-config"}, (name, when)
        if name in scraped:
            assert scraped[name].type == kind, (name, kind, scraped[name].type)
        else:
            assert when not in MET_HERE, f"in docs/metrics.md but not exported: {name}"


def test_the_doc_lists_what_the_server_exports(vllm_server, answered) -> None:
    server, _ = vllm_server
    names = documented_vllm_names()
    assert {k: name for k, (name, _) in names.items()} == {k: v.name for k, v in VLLM_NAMES.items()}
    rows = documented("`kvhive serve`")
    for kvhive_name, (vllm_name, kind) in names.items():
        assert rows[kvhive_name][0] == kind, kvhive_name
        rows[vllm_name] = (kind, "--metrics-compat vllm")
    check_documented(scrape(server.url), rows)


@dataclass
class RunningReplica:
    """The vLLM-compatible server as a gateway replica: its URL and KV-event socket."""

    url: str
    spec: str


@pytest.fixture()
def gateway(vllm_server) -> Iterator[Cluster]:
    server, events_port = vllm_server
    cluster = start_gateway([RunningReplica(server.url, f"{server.url},events=tcp://127.0.0.1:{events_port},"
                                                        "kind=kvhive")])
    yield cluster
    stop_gateway(cluster)


def test_the_doc_lists_what_the_gateway_exports(gateway: Cluster) -> None:
    with gateway.client() as client:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Routing test", "max_tokens": 2})
        assert r.status_code == 200, r.text
    check_documented(scrape(gateway.gateway_url), documented("`kvhive gateway`"))
