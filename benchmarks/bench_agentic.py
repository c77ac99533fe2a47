"""Agentic serving through the field's own load generator, guidellm (`pip install guidellm`, 0.8.x): our
OpenAI-compatible server (started here), ours as two replicas behind sglang-router (`--router sglang`,
each replica half the cores), and peers already serving the same checkpoint (`--peer NAME=URL`, e.g.
llama.cpp's llama-server; one that does not answer is skipped and said so). Ours and the replicas are started
for each measurement and stopped after it (each holds a prefix cache of up to 4 GiB: idle beside another
server's measurement they would take its memory).

Workload "agentic" (guidellm's synthetic multi-turn data, /v1/chat/completions, streamed): conversations of
`--turns` turns behind one shared system prompt of `--system-prompt-tokens` tokens; each turn adds a
tool-call-sized message of `--turn-tokens MIN MAX` tokens and asks for `--output-tokens MIN MAX` new ones
(`max_completion_tokens` with `ignore_eos`, so every server computes the same tokens), and sends the whole
history: the system prompt, every earlier message and the answers the server gave. Each concurrency level
(`--concurrency`: guidellm's concurrent profile, that many requests in flight) is one `guidellm run` of
`--conversations-per-stream` conversations per stream, under its own seed: its own system prompt and
conversations, which no earlier measurement cached. Before it the system prompt is primed as a server
that has been serving it holds it: one request, then one per stream at once (llama-server caches per slot,
two replicas per replica: the concurrent ones reach the slots or replicas the measurement uses), one token
each, outside the measurement; the run checks guidellm sent the prompt primed.
Greedy (temperature 0); thinking off with `preserve_thinking` (Qwen3.6's template then renders a history
turn as it was generated); the answers are digits (`logit_bias` +100 on the ten digit tokens), whose text
re-tokenizes to the tokens generated, as a real model's answers do: a random model's arbitrary tokens would
not, and no server could reuse a history holding them.

Per server and concurrency, from guidellm's report: goodput (requests/s meeting both `--ttft-slo` and
`--tpot-slo`, guidellm's `request_goodput`; its TPOT is a request's inter-token latency, the first token
excluded) and the share of requests meeting them, request throughput, TTFT p50 / p99, TPOT p50 (guidellm's
inter-token latency distribution, weighted by tokens), the share of prompt tokens the server reported
cached (`usage.prompt_tokens_details.cached_tokens`), and the mean prompt and output tokens per request
(equal across servers when they did the same work). Each measurement is repeated `--repeats` times, the
servers alternating; the JSON keeps every run and min / median / max.

    python benchmarks/bench_agentic.py --router sglang           # the default 0.75B random model
    python benchmarks/bench_agentic.py --layers 2 --system-prompt-tokens 256 --turns 2 --concurrency 1 4 \
        --conversations-per-stream 1 --repeats 1 --router sglang --output /tmp/bench_agentic.json  # smoke
    python benchmarks/bench_agentic.py --model CKPT --router sglang --peer llama-server=http://127.0.0.1:8081

Writes benchmarks/results/bench_agentic.json and .png (or --output) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path

import torch
from bench_generate import random_checkpoint
from bench_serving import RESULTS, digit_bias, free_port, served_model_name, start_our_server
from timing import command_line, fmt, machine, spread

from optimum_qwen36.tokenizer import PACKAGE_DIR, has_tokenizer_files

OURS = "optimum-qwen36"
ROUTED = "optimum-qwen36 x2 (sglang-router)"
GUIDELLM = Path(sys.executable).parent / "guidellm"
# cache_aware sends a prompt to the replica holding most of it until the replicas' loads differ by more
# than the thresholds; under its defaults (32 requests) every conversation behind one shared system prompt
# goes to one replica. Thresholds of one request spread them (docs/SCALING.md).
ROUTER_FLAGS = ["--policy", "cache_aware", "--balance-abs-threshold", "1", "--balance-rel-threshold", "1.0"]


def answers(url: str, path: str) -> bool:
    try:
        with urllib.request.urlopen(url + path, timeout=10) as response:
            return response.status == 200
    except OSError:
        return False


@contextmanager
def our_server(args: argparse.Namespace, checkpoint: Path, threads: int | None = None) -> Iterator[str]:
    process, url = start_our_server(args, checkpoint, threads)
    try:
        yield url
    finally:
        process.terminate()  # drains: streams in flight finish first
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def sglang_router(replica_urls: list[str], log: Path) -> Iterator[str]:
    """sglang-router in front of the replicas, once it counts them all healthy: its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "sglang_router", "launch", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--worker-urls", *replica_urls, *ROUTER_FLAGS]
    # Its Prometheus exporter takes port 29000 unless told otherwise, which another process may hold.
    command += ["--prometheus-port", str(free_port()), "--log-level", "warn"]
    with open(log, "ab") as output:  # a pipe nobody reads would fill with its warnings and stall it
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"sglang-router exited with {process.returncode}: {log.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(url + "/readiness", timeout=5) as response:
                    if json.loads(response.read())["healthy_workers"] == len(replica_urls):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"sglang-router did not count every replica healthy: {log.read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextmanager
def routed_replicas(args: argparse.Namespace, checkpoint: Path, log: Path) -> Iterator[str]:
    """Two of our servers, each on half the cores, behind sglang-router: the router's URL."""
    threads = max((os.cpu_count() or 2) // 2, 1)
    with ExitStack() as replicas:
        urls = [replicas.enter_context(our_server(args, checkpoint, threads)) for _ in range(2)]
        yield replicas.enter_context(sglang_router(urls, log))


def lengths(name: str, low: int, high: int) -> dict:
    """guidellm's synthetic-data arguments for `name` (prompt_tokens, output_tokens) between low and high."""
    return {
        name: (low + high) // 2,
        f"{name}_min": low,
        f"{name}_max": high,
        f"{name}_stdev": max((high - low) // 4, 1),
    }


def agentic_data(args: argparse.Namespace) -> dict:
    """guidellm's synthetic data of the workload: conversations behind one shared system prompt."""
    return {
        "kind": "synthetic_text",
        "prefix_tokens": args.system_prompt_tokens,
        "prefix_count": 1,
        "turns": args.turns,
        **lengths("prompt_tokens", *args.turn_tokens),
        **lengths("output_tokens", *args.output_tokens),
    }


def request_body(bias: dict[str, int]) -> dict:
    """What every request adds to guidellm's: greedy, thinking off, digit answers."""
    return {
        "temperature": 0,
        "logit_bias": bias,
        "chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": True},
    }


def scenario(
    args: argparse.Namespace, url: str, streams: int, tokenizer: Path, body: dict, seed: int
) -> dict:
    """The guidellm scenario of one measurement: one concurrency level against one server."""
    requests = streams * args.conversations_per_stream * args.turns
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": served_model_name(url),
                "request_format": "/v1/chat/completions",
                "timeout": 3600,
                "extras": {"body": body},
            },
            "profile": {"kind": "concurrent", "streams": streams},
            "data": [agentic_data(args)],
            "constraints": [{"kind": "max_requests", "count": requests}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "seed": {"kind": "static", "value": seed},
            # The report keeps every request's data: its token counts, timings and messages.
            "metrics": {
                "kind": "generative",
                "slo": {"ttft_ms": args.ttft_slo * 1e3, "tpot_ms": args.tpot_slo * 1e3},
            },
        }
    }


def system_prompt(data: dict, tokenizer: Path, seed: int) -> str:
    """The shared system prompt guidellm sends in a run of `seed`, drawn by guidellm's own generator, seeded
    as guidellm's data loader seeds its first dataset (`sent_system_prompt` checks the two agree)."""
    from guidellm.data.deserializers.synthetic import SyntheticTextDataset
    from guidellm.schemas.data.deserializers import SyntheticTextDataArgs
    from transformers import AutoTokenizer

    dataset = SyntheticTextDataset(
        SyntheticTextDataArgs.model_validate(data),
        AutoTokenizer.from_pretrained(tokenizer),
        random_seed=random.Random(seed).getrandbits(32),
    )
    conversation = json.loads(next(iter(dataset))["conversation_turns"])
    return conversation["turns"][0]["columns"]["prefix_column"][0]


def sent_system_prompt(benchmark: dict) -> str:
    """The system message of the level's first request."""
    return json.loads(benchmark["requests"]["successful"][0]["request_args"])["body"]["messages"][0][
        "content"
    ]


def prime(url: str, prompt: str, streams: int, body: dict) -> None:
    """The system prompt into the server's prefix cache before a measurement, as a server that has been
    serving it holds it: one request, then `streams` at once (a server that caches per slot or per
    replica, as llama-server and two replicas do, then holds it wherever the measurement's concurrent
    requests land). One token each."""

    def ask(index: int) -> None:
        messages = [{"role": "system", "content": prompt}, {"role": "user", "content": f"Warm-up {index}."}]
        request = {"model": served_model_name(url), "messages": messages, "max_tokens": 1, **body}
        post = urllib.request.Request(
            url + "/v1/chat/completions", json.dumps(request).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(post, timeout=3600) as response:
            response.read()

    ask(0)
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(ask, range(1, streams + 1)))


def run_guidellm(spec: dict, directory: Path, name: str) -> dict:
    """One `guidellm run` of the scenario; its JSON report."""
    scenario_path, report_path = directory / f"{name}.scenario.json", directory / f"{name}.report.json"
    outputs = [{"kind": "json", "path": str(report_path)}, {"kind": "console"}]
    scenario_path.write_text(json.dumps({**spec, "spec": {**spec["spec"], "outputs": outputs}}, indent=2))
    # One worker process drives every stream: on a machine of few cores more would take the servers' CPU.
    environment = {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    command = [str(GUIDELLM), "run", "--scenario", str(scenario_path), "--disable-console-interactive"]
    subprocess.run(command, check=True, env=environment)
    return json.loads(report_path.read_text())


def summary(benchmark: dict) -> dict:
    """The figures of one concurrency level of a guidellm report."""
    metrics = benchmark["metrics"]
    requests = benchmark["requests"]["successful"]
    prompt = sum(r["input_metrics"]["text_tokens"] or 0 for r in requests)
    reported = [r["input_metrics"]["cached_tokens"] for r in requests]
    # None where the server reports no cached tokens (vLLM without --enable-prompt-tokens-details).
    cached = None if all(c is None for c in reported) else sum(c or 0 for c in reported)
    return {
        "goodput_requests_per_s": metrics["request_goodput"]["successful"]["mean"],
        "slo_attainment": metrics["slo_attainment"],
        "requests_per_s": metrics["requests_per_second"]["successful"]["mean"],
        "ttft_p50_s": metrics["time_to_first_token_ms"]["successful"]["percentiles"]["p50"] / 1e3,
        "ttft_p99_s": metrics["time_to_first_token_ms"]["successful"]["percentiles"]["p99"] / 1e3,
        "tpot_p50_s": metrics["inter_token_latency_ms"]["successful"]["percentiles"]["p50"] / 1e3,
        "cached_prompt_share": None if cached is None else cached / prompt if prompt else 0.0,
        "prompt_tokens_mean": metrics["prompt_token_count"]["successful"]["mean"],
        "output_tokens_mean": metrics["output_token_count"]["successful"]["mean"],
        "requests": len(requests),
        "errored": metrics["request_totals"]["errored"],
    }


def spread_or_none(values: list) -> dict | None:
    """spread() of the runs, or None where a run has no value (a figure the server does not report)."""
    return None if any(value is None for value in values) else spread(values)


def table(report: dict) -> str:
    lines = [
        "| server | concurrency | goodput req/s | meeting SLOs | req/s | TTFT p50 s | TTFT p99 s "
        "| TPOT p50 ms | cached | prompt / output tok |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for server, levels in report["results"].items():
        if "skipped" in levels:
            lines.append(f"| {server} | skipped: {levels['skipped']} | | | | | | | | |")
            continue
        for level, m in levels.items():
            tpot_ms = {key: value * 1e3 for key, value in m["tpot_p50_s"].items() if key != "runs"}
            lines.append(
                f"| {server} | {level} | {fmt(m['goodput_requests_per_s'], 3)} "
                f"| {fmt(m['slo_attainment'], 2)} | {fmt(m['requests_per_s'], 3)} "
                f"| {fmt(m['ttft_p50_s'], 2)} | {fmt(m['ttft_p99_s'], 2)} | {fmt(tpot_ms, 0)} "
                f"| {fmt(m['cached_prompt_share'], 2) if m['cached_prompt_share'] else 'not reported'} "
                f"| {m['prompt_tokens_mean']['median']:.0f} / {m['output_tokens_mean']['median']:.0f} |"
            )
    return "\n".join(lines)


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = {name: levels for name, levels in report["results"].items() if "skipped" not in levels}
    concurrency = report["settings"]["concurrency"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(servers), 1)
    for axis, key, label in (
        (axes[0], "goodput_requests_per_s", "goodput, requests / s"),
        (axes[1], "ttft_p50_s", "TTFT p50, s"),
    ):
        for i, (server, levels) in enumerate(servers.items()):
            cells = [levels[f"concurrency@{c}"][key] for c in concurrency]
            medians = [cell["median"] for cell in cells]
            errors = [[c["median"] - c["min"] for c in cells], [c["max"] - c["median"] for c in cells]]
            positions = [x + i * width for x in range(len(concurrency))]
            axis.bar(positions, medians, width, yerr=errors, capsize=3, label=server)
        axis.set_xticks([x + width * (len(servers) - 1) / 2 for x in range(len(concurrency))], concurrency)
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel(f"{label} (median, min-max)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"agentic workload through guidellm: {report['model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def peer(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not (sep and name and url):
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {text!r}")
    return name, url.rstrip("/").removesuffix("/v1")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, help="a checkpoint (default: a random model of --layers layers)"
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--backend", default="cpu", choices=["eager", "cpu", "cuda"])
    parser.add_argument("--batch-size", type=int, default=8, help="our server's concurrent sequences")
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--prefill-chunk-size", type=int, default=256)
    parser.add_argument("--compile-cache-dir", type=Path)
    parser.add_argument("--system-prompt-tokens", type=int, default=1500)
    parser.add_argument("--turns", type=int, default=4, help="turns of each conversation")
    parser.add_argument("--turn-tokens", type=int, nargs=2, default=[50, 150], metavar=("MIN", "MAX"))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=[50, 100], metavar=("MIN", "MAX"))
    parser.add_argument("--conversations-per-stream", type=int, default=2, help="conversations per stream")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    parser.add_argument("--tpot-slo", type=float, default=0.25, help="seconds")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--router", choices=["sglang"], help="also: ours as two replicas behind this router")
    parser.add_argument("--peer", type=peer, action="append", default=[], metavar="NAME=URL")
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_agentic.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-agentic-") as tmp:
        directory = Path(tmp)
        dtype = getattr(torch, args.dtype)
        checkpoint = args.model or random_checkpoint(directory / "ckpt", args.layers, dtype)
        # The tokenizer our server loads: the checkpoint's own, else the one this package ships.
        tokenizer = checkpoint if has_tokenizer_files(checkpoint) else PACKAGE_DIR
        body = request_body(digit_bias(checkpoint))
        # Ours is started for each measurement and stopped after it: a server idle beside another's
        # measurement would hold memory the other's prefix cache may need (each holds up to 4 GiB).
        targets: dict[str, Callable[[], AbstractContextManager[str]]] = {
            OURS: lambda: our_server(args, checkpoint)
        }
        if args.router == "sglang":
            targets[ROUTED] = lambda: routed_replicas(args, checkpoint, directory / "router.log")
        skipped = {}
        for name, url in args.peer:
            if answers(url, "/v1/models"):
                targets[name] = lambda url=url: nullcontext(url)
            else:
                skipped[name] = f"{url} did not answer /v1/models"
        runs: dict[str, list[dict]] = {name: [] for name in targets}
        scenarios = []
        for repeat in range(args.repeats):
            for index, (name, target) in enumerate(targets.items()):  # alternate: all see the same load
                levels = {}
                with target() as url:
                    for level, streams in enumerate(args.concurrency):
                        # Each level and repeat its own seed: its own system prompt and conversations,
                        # none cached by a measurement before.
                        seed = args.seed + 100 * repeat + level
                        prompt = system_prompt(agentic_data(args), tokenizer, seed)
                        prime(url, prompt, streams, body)
                        spec = scenario(args, url, streams, tokenizer, body, seed)
                        report = run_guidellm(spec, directory, f"{repeat}-{index}-{streams}")
                        if sent_system_prompt(report["benchmarks"][0]) != prompt:
                            raise RuntimeError("guidellm sent another system prompt than the one primed")
                        levels[f"concurrency@{streams}"] = summary(report["benchmarks"][0])
                        scenarios.append(spec)
                runs[name].append(levels)
                print(f"repeat {repeat}: {name} done", flush=True)

    results: dict[str, dict] = {}
    for name, per_run in runs.items():
        results[name] = {
            level: {key: spread_or_none([run[level][key] for run in per_run]) for key in per_run[0][level]}
            for level in per_run[0]
        }
    results.update({name: {"skipped": reason} for name, reason in skipped.items()})
    report = {
        "command": command_line(),
        "machine": machine(),
        "guidellm": subprocess.run(
            [str(GUIDELLM), "--version"], capture_output=True, text=True
        ).stdout.strip(),
        "model": str(args.model)
        if args.model
        else f"random {args.layers}-layer Qwen3.6-shaped model ({args.dtype})",
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
        "router": {"command": "sglang_router launch", "flags": ROUTER_FLAGS} if args.router else None,
        # The first measurement's scenario; the others differ in target, streams, requests and seed
        # (--seed + 100 x repeat + level index).
        "guidellm_scenario": scenarios[0],
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
