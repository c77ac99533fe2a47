"""`optimum-qwen36` command line: export a checkpoint, generate from it, manage the compile cache.

optimum-qwen36 export Qwen/Qwen3.6-27B ./qwen36-cpu --backend cpu --batch-size 1 --sequence-length 4096
optimum-qwen36 generate ./qwen36-cpu --prompt "What is a Gated DeltaNet?" --chat --no-thinking
optimum-qwen36 serve ./qwen36-cpu --port 8000   # OpenAI-compatible server
optimum-qwen36 cache lookup             # list compiled graphs in the compile cache
optimum-qwen36 cache clear

A Hub repository can back the compile cache (--compile-cache-repo or $OPTIMUM_QWEN36_CACHE_REPO): exports
download its entries (with --trust-compiled-code: they are native code) and upload new compilations.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .network.neuron_config import (
    MODULE_SETS,
    NEURON_CONFIG_NAME,
    SUPPORTED_BACKENDS,
    SUPPORTED_DTYPES,
    SUPPORTED_QUANTIZATIONS,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from . import NeuronQwen36ForCausalLM


def _add_export_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=SUPPORTED_BACKENDS,
        default=None,
        help="what to compile for (default: cpu; eager: uncompiled; cuda: see 'What runs where', README)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="rows generated together, i.e. max concurrent sequences (default 1; serve: 8)",
    )
    parser.add_argument(
        "--sequence-length",
        type=int,
        default=None,
        help="max prompt + new tokens (default: min(4096, model))",
    )
    parser.add_argument(
        "--dtype", choices=sorted(SUPPORTED_DTYPES), default=None, help="default: checkpoint's"
    )
    parser.add_argument("--prefill-chunk-size", type=int, default=None, help="tokens per prefill step")
    parser.add_argument(
        "--quantization",
        choices=SUPPORTED_QUANTIZATIONS,
        default=None,
        help="quantize the weights at export (default: as the checkpoint; FP8 and 4-bit checkpoints stay so)",
    )
    parser.add_argument(
        "--fp8-modules",
        choices=MODULE_SETS,
        default=None,
        help="with --quantization fp8: the MLP linears only, or every attention / GDN / MLP linear (default)",
    )
    parser.add_argument(
        "--int4-modules",
        choices=MODULE_SETS,
        default=None,
        help="with --quantization int4: the MLP linears only, or every attention / GDN / MLP linear "
        "(default)",
    )
    parser.add_argument(
        "--int4-group-size",
        type=int,
        default=None,
        help="with --quantization int4: input features per scale and zero point: 32, 64, 128 (default), "
        "a multiple of 128, or -1 (per output channel)",
    )
    parser.add_argument("--kv-block-size", type=int, default=64, help="attention KV block size (default 64)")
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="MTP speculative decoding: tokens the checkpoint's MTP layer drafts per step, 1..3 (default 0: "
        "off; the engine and serve use it)",
    )
    parser.add_argument(
        "--tp-degree",
        type=int,
        default=1,
        help="tensor parallelism: split the model over this many processes (default 1; eager backend; "
        "started here, or one per torchrun process)",
    )
    parser.add_argument("--revision", default=None, help="Hub revision of MODEL")
    parser.add_argument(
        "--compile-cache-dir", default=None, help="default: $OPTIMUM_QWEN36_CACHE or ~/.cache"
    )
    parser.add_argument(
        "--compile-cache-repo",
        default=None,
        help="Hub repository backing the compile cache (default: $OPTIMUM_QWEN36_CACHE_REPO): entries are "
        "downloaded from it (needs --trust-compiled-code) and new compilations uploaded to it",
    )
    parser.add_argument("--no-compile-cache", action="store_true", help="always compile, store nothing")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        backend=args.backend,
        batch_size=args.batch_size,
        sequence_length=args.sequence_length,
        dtype=args.dtype,
        prefill_chunk_size=args.prefill_chunk_size,
        kv_block_size=args.kv_block_size,
        quantization=args.quantization,
        fp8_modules=args.fp8_modules,
        int4_modules=args.int4_modules,
        int4_group_size=args.int4_group_size,
        num_speculative_tokens=args.num_speculative_tokens,
        tp_degree=args.tp_degree,
    )


def _model_class(args: argparse.Namespace) -> type[NeuronQwen36ForCausalLM]:
    """NeuronQwen36ForConditionalGeneration for a checkpoint (or exported model) with a vision tower, else
    the text model."""
    from . import NeuronQwen36ForCausalLM, NeuronQwen36ForConditionalGeneration

    path = os.path.join(args.model, "config.json")
    if not os.path.isfile(path):
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(args.model, "config.json", revision=args.revision)
        except Exception:  # not a Hub repository either: from_pretrained says why
            return NeuronQwen36ForCausalLM
    with open(path) as f:
        config = json.load(f)
    vision = config.get("model_type") == "qwen3_5" and config.get("vision_config") is not None
    return NeuronQwen36ForConditionalGeneration if vision else NeuronQwen36ForCausalLM


def _export(args: argparse.Namespace) -> NeuronQwen36ForCausalLM:
    return _model_class(args).from_pretrained(
        args.model,
        export=True,
        revision=args.revision,
        compile_cache_dir=args.compile_cache_dir,
        compile_cache_repo=args.compile_cache_repo,
        use_compile_cache=not args.no_compile_cache,
        trust_compiled_code=args.trust_compiled_code,
        **_settings(args),
    )


def cmd_export(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    model = _export(args)
    model.save_pretrained(args.output_dir)
    backend = model.neuron_config.backend
    print(f"Exported {args.model} ({backend}) to {args.output_dir} in {time.perf_counter() - start:.1f} s")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from .tokenizer import load_qwen36_tokenizer

    model = _load(args)
    tokenizer = load_qwen36_tokenizer(model.tokenizer_dir)
    prompt = args.prompt
    if args.chat:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=not args.no_thinking,
        )
    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    start = time.perf_counter()
    output = model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    elapsed = time.perf_counter() - start
    new_tokens = output[0, input_ids.shape[1] :]
    print(tokenizer.decode(new_tokens, skip_special_tokens=True))
    print(
        f"[{len(new_tokens)} tokens in {elapsed:.2f} s, {len(new_tokens) / elapsed:.1f} tok/s]",
        file=sys.stderr,
    )
    return 0


def _load(args: argparse.Namespace) -> NeuronQwen36ForCausalLM:
    """An exported model directory (or Hub repository, with --trust-compiled-code) loads; a checkpoint is
    exported (the compile cache applies)."""
    if os.path.isfile(os.path.join(args.model, NEURON_CONFIG_NAME)) or args.trust_compiled_code:
        return _model_class(args).from_pretrained(args.model, trust_compiled_code=args.trust_compiled_code)
    return _export(args)


def _images_per_prompt(limit: str) -> int:
    """--limit-mm-per-prompt as vLLM writes it ('{"image": 4}') or a number."""
    try:
        value = json.loads(limit)
    except ValueError:
        value = None
    count = value.get("image") if isinstance(value, dict) else value
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise SystemExit(f"--limit-mm-per-prompt must be like '{{\"image\": 4}}' or a number, got {limit!r}")
    return count


def serve_app(args: argparse.Namespace) -> FastAPI:
    """The app `serve` runs for its parsed arguments; it loads (or exports) the model once started."""
    import pydantic

    from .server import ServedModel, ServerSettings, build_app, served_model
    from .server.images import ImageLimits
    from .server.kv_events import KVEventsConfig

    settings = ServerSettings(
        served_model_name=args.served_model_name or args.model,
        api_key=args.api_key or os.environ.get("OPTIMUM_QWEN36_API_KEY"),
        default_enable_thinking=args.default_enable_thinking == "true",
        max_waiting_requests=args.max_waiting_requests,
        web_ui=args.web_ui,
        url=f"http://{args.host}:{args.port}",
    )

    processor = json.loads(args.mm_processor_kwargs or "{}")
    limits = ImageLimits(
        max_images_per_prompt=_images_per_prompt(args.limit_mm_per_prompt),
        max_pixels=processor.get("max_pixels"),
        allowed_media_domains=tuple(args.allowed_media_domains),
    )

    kv_events = None
    if args.kv_events_config is not None:
        try:
            kv_events = KVEventsConfig.model_validate_json(args.kv_events_config)
        except pydantic.ValidationError as error:
            raise SystemExit(f"--kv-events-config: {error}") from None

    def load() -> ServedModel:
        return served_model(
            _load(args),
            prefix_caching=args.prefix_caching,
            max_num_batched_tokens=args.max_num_batched_tokens,
            image_limits=limits,
            kv_events=kv_events,
        )

    return build_app(load, settings)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from .server.draining import DrainingServer

    # uvicorn configures its own loggers; the server's (the ready line, tracebacks of failures) join them.
    log_config = copy.deepcopy(LOGGING_CONFIG)
    server_logger = {"handlers": ["default"], "level": args.log_level.upper(), "propagate": False}
    log_config["loggers"]["optimum_qwen36"] = server_logger
    app = serve_app(args)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, log_config=log_config
    )
    DrainingServer(config, app.state.server).run()
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from .exporters.compile_cache import CompileCache, HubCompileCache, compile_key, make_compile_cache

    cache = make_compile_cache(args.compile_cache_dir, args.compile_cache_repo)
    if args.action == "clear":
        print(f"Removed {cache.clear()} entries from {cache.root}")
        return 0
    if args.model is None:
        entries = cache.entries()
        print(f"{len(entries)} entries in {cache.root}")
        for entry in entries:
            print(f"{entry['key'][:16]}  {entry['bytes'] / 1e6:8.1f} MB  {json.dumps(entry['description'])}")
        return 0
    from . import NeuronQwen36ForCausalLM
    from .network.weights import resolve_checkpoint

    settings = {k: v for k, v in _settings(args).items() if v is not None}
    neuron_config = NeuronQwen36ForCausalLM.get_neuron_config(args.model, revision=args.revision, **settings)
    checkpoint_dir = resolve_checkpoint(args.model, revision=args.revision)
    _, text_config, _ = NeuronQwen36ForCausalLM.model_config(checkpoint_dir, neuron_config)
    key = compile_key(text_config.to_dict(), neuron_config.to_dict(), neuron_config.backend)
    entry = CompileCache.lookup(cache, key)  # the local cache only: downloads nothing
    if entry is None and isinstance(cache, HubCompileCache) and cache.remote_has(key):
        print(f"hit in {cache.repo_id}: {key} (downloaded by an export with --trust-compiled-code)")
        return 0
    print(f"{'hit' if entry else 'miss'}: {key} ({entry or cache.root})")
    return 0 if entry else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optimum-qwen36", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    export = commands.add_parser("export", help="export (compile) a checkpoint and save it")
    export.add_argument("model", help="transformers checkpoint: local directory or Hub id")
    export.add_argument("output_dir", help="where to save the exported model")
    export.add_argument(
        "--trust-compiled-code",
        action="store_true",
        help="allow using compiled (native) graphs downloaded from --compile-cache-repo",
    )
    _add_export_settings(export)
    export.set_defaults(func=cmd_export)

    generate = commands.add_parser("generate", help="generate text (greedy) from an exported model")
    generate.add_argument("model", help="directory written by `export`, a Hub id, or a checkpoint to export")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    generate.add_argument("--no-thinking", action="store_true", help="with --chat: disable thinking")
    generate.add_argument(
        "--trust-compiled-code",
        action="store_true",
        help="allow loading compiled (native) code from the Hub: MODEL's graphs if it is a Hub repository of "
        "an exported model, or entries of --compile-cache-repo",
    )
    _add_export_settings(generate)
    generate.set_defaults(func=cmd_generate)

    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("model", help="directory written by `export`, a Hub id, or a checkpoint to export")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the `model` clients name (default: MODEL)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $OPTIMUM_QWEN36_API_KEY)",
    )
    serve.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse computed prompt prefixes across requests (default: on, whether or not the model was "
        "exported with prefix caching: the compiled graphs are the same)",
    )
    serve.add_argument(
        "--default-enable-thinking",
        choices=("true", "false"),
        default="true",
        help="the chat template's enable_thinking when a request does not set chat_template_kwargs",
    )
    serve.add_argument(
        "--web-ui",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve a chat page at / over the OpenAI endpoints (default: on; see docs/WEB_UI.md)",
    )
    serve.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per engine step")
    serve.add_argument(
        "--limit-mm-per-prompt",
        default='{"image": 4}',
        help="images a request may carry, as vLLM writes it ('{\"image\": 4}') or a number",
    )
    serve.add_argument(
        "--allowed-media-domains",
        nargs="*",
        default=[],
        help="domains whose http(s) image URLs the server fetches (default: none; data: URLs always work)",
    )
    serve.add_argument(
        "--mm-processor-kwargs",
        default=None,
        help="the image processor's settings, as vLLM takes them: '{\"max_pixels\": 1003520}' scales larger "
        "images down",
    )
    serve.add_argument(
        "--kv-events-config",
        default=None,
        help="publish the prefix cache's KV events for KV-aware routers, as vLLM's flag takes them: "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\' (docs/SCALING.md)',
    )
    serve.add_argument(
        "--max-waiting-requests", type=int, default=256, help="queued requests beyond these get a 503"
    )
    serve.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    serve.add_argument(
        "--trust-compiled-code",
        action="store_true",
        help="allow loading compiled (native) code from the Hub (see generate)",
    )
    _add_export_settings(serve)
    serve.set_defaults(func=cmd_serve, batch_size=8)

    cache = commands.add_parser("cache", help="inspect or clear the compile cache")
    cache.add_argument("action", choices=("lookup", "clear"))
    cache.add_argument("model", nargs="?", help="with lookup: report whether this checkpoint + settings hit")
    _add_export_settings(cache)
    cache.set_defaults(func=cmd_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
