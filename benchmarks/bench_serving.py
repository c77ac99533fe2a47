"""Serving latency and throughput over HTTP: our OpenAI-compatible server (`optimum-qwen36 serve`, started
here as a subprocess) and, when one is given, a peer's OpenAI-compatible server (vLLM-CPU's, started with
`../shared/peers/vllm_serve.sh CKPT PORT`) on the same request trace, from the `openai` client.

Workloads (every request greedy, `ignore_eos`, so each side computes the same number of tokens; prompts are
random token ids of `--prompt-tokens MIN MAX` from a fixed seed, each workload and repeat its own, so none
hits another's prefixes; `--output-tokens` new tokens each):
- `poisson@R`: `--requests` requests arriving at R requests/s (`--rates`);
- `concurrency@C`: `--requests` requests, C in flight at any time (`--concurrency`);
- `multi-turn`: `--conversations` chats of `--turns` turns, one after another: a first message of
  `--first-turn-tokens` random words, then follow-ups of `--turn-tokens`; each turn sends the history
  (earlier messages and the answers the server gave). TTFT of each later turn (warm: the history is in the
  prefix cache) against the same prompt under another system message (cold: same length, nothing cached).
  Thinking is off and the template's `preserve_thinking` on (Qwen3.6's flag: history turns keep their think
  block, here the empty one the generation prompt holds), so the rendered history is what was generated.
  The answers are digits (`logit_bias` +100 on the ten digit tokens): their text re-tokenizes to the tokens
  generated, as a real model's answers do; a random model's arbitrary tokens would not, and no server could
  then reuse an answer it cached.
Per workload and server: request and output throughput, TTFT, inter-token latency (gaps between streamed
tokens), TPOT (per request: (last - first token) / (tokens - 1)) and end-to-end latency, p50 / p99; prompt
tokens served from the prefix cache (`usage.prompt_tokens_details.cached_tokens`). Each workload is run
`--repeats` times, the servers alternating; the JSON keeps every run and min / median / max.

    python benchmarks/bench_serving.py                 # the default 0.75B model
    python benchmarks/bench_serving.py --layers 4 --requests 16 --rates 1 \\
        --concurrency 1 4 8 --prompt-tokens 64 512 --output-tokens 32 --conversations 2 --turns 3
    python benchmarks/bench_serving.py --model CKPT --peer-url http://127.0.0.1:8000 --peer-name vllm-cpu

The peer (flag or $OPTIMUM_QWEN36_PEER_URL) must serve the same checkpoint; without one the peer column says
it was skipped. Writes benchmarks/results/bench_serving.json and .png (or --output) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai
import torch
from bench_generate import random_checkpoint
from timing import command_line, fmt, machine, spread

RESULTS = Path(__file__).resolve().parent / "results"
PEER_ENV = "OPTIMUM_QWEN36_PEER_URL"
OURS = "optimum-qwen36"


@dataclass
class Timeline:
    """One request as the client saw it (seconds after the workload's start)."""

    sent: float
    tokens: list[float] = field(default_factory=list)  # arrival of each streamed token
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""


def percentile(values: list[float], q: float) -> float:
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q)) if values else float("nan")


def summary(timelines: list[Timeline], elapsed: float) -> dict:
    ttft = [t.tokens[0] - t.sent for t in timelines if t.tokens]
    itl = [b - a for t in timelines for a, b in zip(t.tokens, t.tokens[1:], strict=False)]
    tpot = [(t.tokens[-1] - t.tokens[0]) / (len(t.tokens) - 1) for t in timelines if len(t.tokens) > 1]
    e2e = [t.tokens[-1] - t.sent for t in timelines if t.tokens]
    prompt = sum(t.prompt_tokens for t in timelines)
    return {
        "requests_per_s": len(timelines) / elapsed,
        "output_tok_per_s": sum(len(t.tokens) for t in timelines) / elapsed,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "itl_p50_s": percentile(itl, 0.5),
        "itl_p99_s": percentile(itl, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5),
        "tpot_p99_s": percentile(tpot, 0.99),
        "e2e_p50_s": percentile(e2e, 0.5),
        "e2e_p99_s": percentile(e2e, 0.99),
        "prefix_hit_rate": sum(t.cached_tokens for t in timelines) / prompt if prompt else 0.0,
    }


class Client:
    def __init__(self, url: str, model: str, output_tokens: int) -> None:
        self.url = url
        self.model = model
        self.output_tokens = output_tokens

    def connect(self) -> None:
        """A fresh HTTP client and clock for one workload (each runs in its own event loop)."""
        self.api = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="bench", max_retries=0, timeout=3600)
        self.start = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.start

    async def _consume(self, stream, timeline: Timeline, chat: bool) -> Timeline:
        async for chunk in stream:
            if chunk.usage is not None:
                timeline.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                timeline.cached_tokens = (details.cached_tokens or 0) if details else 0
            for choice in chunk.choices:
                piece = (choice.delta.content or "") if chat else choice.text
                if piece or choice.finish_reason is None:
                    timeline.tokens.append(self.now())
                    timeline.text += piece or ""
        return timeline

    async def complete(self, prompt: list[int]) -> Timeline:
        timeline = Timeline(self.now())
        stream = await self.api.completions.create(
            model=self.model, prompt=prompt, max_tokens=self.output_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        return await self._consume(stream, timeline, chat=False)

    async def chat(
        self, messages: list[dict], logit_bias: dict[str, int], max_tokens: int | None = None
    ) -> Timeline:
        timeline = Timeline(self.now())
        template = {"enable_thinking": False, "preserve_thinking": True}
        stream = await self.api.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens or self.output_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, logit_bias=logit_bias,
            extra_body={"ignore_eos": True, "chat_template_kwargs": template},
        )  # fmt: skip
        return await self._consume(stream, timeline, chat=True)


def prompts(args: argparse.Namespace, vocab: int, count: int, seed: str) -> list[list[int]]:
    rng = random.Random(seed)
    low, high = args.prompt_tokens
    return [[rng.randrange(1000, vocab - 1000) for _ in range(rng.randint(low, high))] for _ in range(count)]


async def poisson(client: Client, work: list[list[int]], rate: float, seed: int) -> tuple[list, float]:
    rng = random.Random(seed)
    client.connect()
    tasks = []
    for prompt in work:
        tasks.append(asyncio.create_task(client.complete(prompt)))
        await asyncio.sleep(rng.expovariate(rate))
    done = await asyncio.gather(*tasks)
    await client.api.close()
    return done, client.now()


async def concurrency(client: Client, work: list[list[int]], limit: int) -> tuple[list, float]:
    client.connect()
    gate = asyncio.Semaphore(limit)

    async def one(prompt: list[int]) -> Timeline:
        async with gate:
            return await client.complete(prompt)

    done = await asyncio.gather(*(one(p) for p in work))
    await client.api.close()
    return done, client.now()


def digit_bias(checkpoint: Path) -> dict[str, int]:
    """logit_bias (+100) on the ten digit tokens of the tokenizer the checkpoint is served with."""
    from optimum_qwen36.tokenizer import load_qwen36_tokenizer

    tokenizer = load_qwen36_tokenizer(checkpoint)
    ids = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    if tokenizer.unk_token_id in ids or None in ids:
        raise ValueError(f"{checkpoint}'s tokenizer has no single token for every digit: {ids}")
    return {str(i): 100 for i in ids}


async def multi_turn(
    client: Client, args: argparse.Namespace, seed: int, bias: dict[str, int]
) -> tuple[dict, float]:
    """Conversations one after another: a first message of `--first-turn-tokens` words (a document),
    then follow-ups of `--turn-tokens` words. Each later turn is sent twice: as the conversation goes on
    (`warm`: the prefix cache holds the history), then the same prompt under another system message
    (`cold`: same length, no block of it cached)."""
    rng = random.Random(seed)
    words = ["alpha", "river", "stone", "cloud", "ember", "quartz", "meadow", "signal", "harbor", "violet"]
    client.connect()
    warm, cold = [], []
    for index in range(args.conversations):
        history: list[dict] = [{"role": "system", "content": f"Conversation {seed}-{index}."}]
        for turn in range(args.turns):
            size = args.first_turn_tokens if turn == 0 else args.turn_tokens
            history.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(size))})
            timeline = await client.chat(history, bias)
            history.append({"role": "assistant", "content": timeline.text})
            if turn:
                warm.append(timeline)
                salted = [{"role": "system", "content": f"Unseen {rng.random()}."}, *history[1:-1]]
                cold.append(await client.chat(salted, bias, max_tokens=1))
    await client.api.close()
    return {"warm": warm, "cold": cold}, client.now()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_our_server(
    args: argparse.Namespace, checkpoint: Path, threads: int | None = None
) -> tuple[subprocess.Popen, str]:
    """Our server on `checkpoint` (torch's default threads, one per core, unless `threads`), once healthy."""
    port = free_port()
    command = [sys.executable, "-m", "optimum_qwen36.cli", "serve", str(checkpoint), "--port", str(port)]
    command += ["--backend", args.backend, "--dtype", args.dtype, "--batch-size", str(args.batch_size)]
    command += ["--sequence-length", str(args.sequence_length), "--prefix-caching", "--log-level", "warning"]
    command += ["--served-model-name", "bench", "--prefill-chunk-size", str(args.prefill_chunk_size)]
    if args.compile_cache_dir:
        command += ["--compile-cache-dir", str(args.compile_cache_dir)]
    environment = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    process = subprocess.Popen(command, env=environment)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"our server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            time.sleep(1)
    raise TimeoutError("our server did not become healthy")


def served_model_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def run_workloads(
    client: Client, args: argparse.Namespace, vocab: int, bias: dict[str, int], seed: int
) -> dict[str, dict]:
    """Every workload once, each on its own prompts (one workload must not hit another's prefixes: that
    would measure the prefix cache, not the batching); {workload: summary}."""
    out: dict[str, dict] = {}
    for rate in args.rates:
        name = f"poisson@{rate:g}"
        work = prompts(args, vocab, args.requests, f"{seed}/{name}")
        done, elapsed = asyncio.run(poisson(client, work, rate, seed))
        out[name] = summary(done, elapsed)
    for limit in args.concurrency:
        name = f"concurrency@{limit}"
        work = prompts(args, vocab, args.requests, f"{seed}/{name}")
        done, elapsed = asyncio.run(concurrency(client, work, limit))
        out[name] = summary(done, elapsed)
    if args.conversations:
        turns, elapsed = asyncio.run(multi_turn(client, args, seed, bias))
        cold, warm = summary(turns["cold"], elapsed), summary(turns["warm"], elapsed)
        out["multi-turn"] = {
            "ttft_cold_p50_s": cold["ttft_p50_s"],
            "ttft_warm_p50_s": warm["ttft_p50_s"],
            "warm_over_cold_ttft": warm["ttft_p50_s"] / cold["ttft_p50_s"],
            "prefix_hit_rate_warm": warm["prefix_hit_rate"],
            "prefix_hit_rate_cold": cold["prefix_hit_rate"],
        }
    return out


def _scaled(summary: dict, factor: float) -> dict:
    return {key: value * factor for key, value in summary.items() if key != "runs"}


def table(report: dict) -> str:
    lines = [
        "| workload | server | output tok/s | req/s | TTFT p50 / p99 s | ITL p50 / p99 ms | TPOT p99 ms "
        "| cached |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for workload, servers in report["results"].items():
        for server, m in servers.items():
            if "skipped" in m:
                lines.append(f"| {workload} | {server} | skipped: {m['skipped']} | | | | | |")
            elif workload == "multi-turn":
                lines.append(
                    f"| {workload} | {server} | TTFT p50 cold {fmt(m['ttft_cold_p50_s'], 2)} s, warm "
                    f"{fmt(m['ttft_warm_p50_s'], 2)} s, warm / cold {fmt(m['warm_over_cold_ttft'], 2)}; "
                    f"prompt tokens from the prefix cache: warm {fmt(m['prefix_hit_rate_warm'], 2)}, cold "
                    f"{fmt(m['prefix_hit_rate_cold'], 2)} | | | | | |"
                )
            else:
                ms = {k: _scaled(m[k], 1e3) for k in ("itl_p50_s", "itl_p99_s", "tpot_p99_s")}
                lines.append(
                    f"| {workload} | {server} | {fmt(m['output_tok_per_s'])} | "
                    f"{fmt(m['requests_per_s'], 2)} | "
                    f"{fmt(m['ttft_p50_s'], 2)} / {fmt(m['ttft_p99_s'], 2)} | {fmt(ms['itl_p50_s'], 0)} / "
                    f"{fmt(ms['itl_p99_s'], 0)} | {fmt(ms['tpot_p99_s'], 0)} | "
                    f"{fmt(m['prefix_hit_rate'], 2)} |"
                )
    return "\n".join(lines)


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in report["results"] if w != "multi-turn"]
    servers = [
        s for s in report["servers"] if all("skipped" not in report["results"][w][s] for w in workloads)
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(servers), 1)
    for i, server in enumerate(servers):
        medians = [report["results"][w][server]["output_tok_per_s"]["median"] for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], medians, width, label=server)
    ax.set_xticks([x + width * (len(servers) - 1) / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("output tokens / s (median)")
    ax.set_title(report["model"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a checkpoint (default: a random model of --layers layers)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--backend", default="cpu", choices=["eager", "cpu", "cuda"])
    parser.add_argument("--batch-size", type=int, default=8, help="our server's concurrent sequences")
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--prefill-chunk-size", type=int, default=256)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[64, 2048], metavar=("MIN", "MAX"))
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rates", type=float, nargs="*", default=[0.25, 0.5, 1.0])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 8, 16])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-turn-tokens", type=int, default=1024, help="words of the first message")
    parser.add_argument("--turn-tokens", type=int, default=32, help="words of each follow-up message")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-cache-dir", type=Path)
    parser.add_argument("--peer-url", default=os.environ.get(PEER_ENV), help=f"default ${PEER_ENV}")
    parser.add_argument("--peer-name", default="peer")
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_serving.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        dtype = getattr(torch, args.dtype)
        checkpoint = (
            Path(args.model) if args.model else random_checkpoint(Path(tmp) / "ckpt", args.layers, dtype)
        )
        vocab = json.loads((checkpoint / "config.json").read_text()).get("vocab_size", 248320)
        bias = digit_bias(checkpoint)
        process, url = start_our_server(args, checkpoint)
        try:
            servers = {OURS: Client(url, "bench", args.output_tokens)}
            if args.peer_url:
                servers[args.peer_name] = Client(
                    args.peer_url, served_model_name(args.peer_url), args.output_tokens
                )
            runs: dict[str, list[dict]] = {name: [] for name in servers}
            for client in servers.values():  # warm-up: first calls allocate and compile
                asyncio.run(concurrency(client, prompts(args, vocab, 2, seed=-1), 2))
            for repeat in range(args.repeats):
                for name, client in servers.items():  # alternate: both sides see the same load
                    # Each repeat its own prompts (a repeat must not hit the previous one's prefixes).
                    runs[name].append(run_workloads(client, args, vocab, bias, args.seed + repeat))
                    print(f"repeat {repeat}: {name} done", flush=True)
        finally:
            process.terminate()
            process.wait(timeout=60)

    results: dict[str, dict] = {}
    for workload in runs[OURS][0]:
        results[workload] = {}
        for name in [OURS, args.peer_name]:
            if name not in runs:
                results[workload][name] = {"skipped": f"no peer server (--peer-url or ${PEER_ENV})"}
                continue
            per_run = [r[workload] for r in runs[name]]
            results[workload][name] = {key: spread([r[key] for r in per_run]) for key in per_run[0]}
    report = {
        "command": command_line(),
        "machine": machine(),
        "model": args.model or f"random {args.layers}-layer Qwen3.6-shaped model ({args.dtype})",
        "servers": [OURS, args.peer_name],
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    chart(report, args.output.with_suffix(".png"))
    print(table(report))
    print(f"\nwrote {args.output} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
