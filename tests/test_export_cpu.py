"""The AOTInductor backends end to end: one export of a tiny model (about 2 minutes on 2 cores), shared by
every test here; the other tests reuse it through the compile cache or the saved artifact.

The backend is `cpu`; `OPTIMUM_QWEN36_TEST_BACKEND=cuda` runs the same tests on a GPU (`.ci/device_check`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_checkpoint
from helpers import StubHubRepo, engine_storage, left_padded_prompts
from test_packed_prefill import (
    assert_decode_rows_ride_along,
    assert_packed_equals_one_per_call,
    assert_snapshots_equal_chunks_ending_there,
)

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.backends import aoti
from optimum_qwen36.backends.base import COMPILED_DIR
from optimum_qwen36.cli import main as cli_main
from optimum_qwen36.engine import EngineRequest, SamplingParams
from optimum_qwen36.exporters import artifact, compile_aoti, regions
from optimum_qwen36.exporters.compile_aoti import graphs_to_compile
from optimum_qwen36.exporters.compile_cache import CompileCache
from optimum_qwen36.exporters.example_args import example_step_args
from optimum_qwen36.network.cache import PADDING_SLOT

BACKEND = os.environ.get("OPTIMUM_QWEN36_TEST_BACKEND", "cpu")
if BACKEND not in ("cpu", "cuda"):
    raise ValueError(f"OPTIMUM_QWEN36_TEST_BACKEND must be 'cpu' or 'cuda', got {BACKEND!r}")
if BACKEND == "cuda" and not torch.cuda.is_available():
    pytest.skip("OPTIMUM_QWEN36_TEST_BACKEND=cuda needs a CUDA GPU", allow_module_level=True)
# Three 64-token KV blocks, so the block table width is a dynamic dimension (2..3, `regions._dims`).
SETTINGS = dict(batch_size=2, sequence_length=192, prefill_chunk_size=16, dtype="float32")
PROMPT_LENGTHS = [5, 21]  # shorter than one prefill chunk, and two chunks
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    """(checkpoint dir, transformers model, compile cache dir, exported model, saved artifact dir)."""
    root = tmp_path_factory.mktemp("export")
    checkpoint, reference = save_tiny_checkpoint(root / "checkpoint", "causal", seed=7)
    cache_dir = root / "compile_cache"
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend=BACKEND, compile_cache_dir=cache_dir, **SETTINGS
    )
    saved = root / "saved"
    model.save_pretrained(saved)
    return checkpoint, reference, cache_dir, model, saved


@pytest.fixture
def no_compilation(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("compiled although the graphs should have been reused")

    monkeypatch.setattr(regions, "CompilePool", refuse)


def _greedy(model, **kwargs) -> torch.Tensor:
    input_ids, mask = left_padded_prompts(PROMPT_LENGTHS, seed=1)
    return model.generate(
        input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs
    )


def test_compiled_backend_equals_eager_and_transformers(exported) -> None:
    checkpoint, reference, _, model, _ = exported
    assert model.backend.name == BACKEND
    ours = _greedy(model, return_dict_in_generate=True, output_logits=True)
    eager = NeuronQwen36ForCausalLM.from_pretrained(checkpoint, export=True, backend="eager", **SETTINGS)
    theirs = _greedy(eager, return_dict_in_generate=True, output_logits=True)
    assert torch.equal(ours.sequences, theirs.sequences)
    for mine, eagers in zip(ours.logits, theirs.logits, strict=True):
        torch.testing.assert_close(mine, eagers, rtol=1e-4, atol=1e-4)
    input_ids, mask = left_padded_prompts(PROMPT_LENGTHS, seed=1)
    hf = reference.generate(
        input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )
    assert torch.equal(ours.sequences, hf)


@pytest.mark.skipif(BACKEND != "cpu", reason="on cuda the twins are what every other test here runs")
def test_graphs_of_the_pytorch_twins_equal_transformers(exported, tmp_path: Path, monkeypatch) -> None:
    """The graphs the cuda backend compiles (attention, GDN and linears as their PyTorch twins, whole prefill
    chunks), compiled and run here on the CPU."""
    checkpoint, reference, _, _, _ = exported
    monkeypatch.setattr(compile_aoti, "uses_cpu_kernels", lambda device_type: False)
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend="cpu", compile_cache_dir=tmp_path, **SETTINGS
    )
    assert not model.backend.packs_prefill
    input_ids, mask = left_padded_prompts(PROMPT_LENGTHS, seed=1)
    hf = reference.generate(
        input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )
    assert torch.equal(_greedy(model), hf)


def test_saved_artifact_loads_in_a_fresh_process_without_compiling(exported) -> None:
    _, _, _, model, saved = exported
    assert {"README.md", artifact.MANIFEST_NAME, "model.safetensors", "neuron_config.json"} <= {
        p.name for p in saved.iterdir()
    }
    # One graph per layer kind for each step, and each step's head.
    steps = graphs_to_compile(model.neuron_config)
    assert steps == ["prefill_chunk", "decode_step"]  # no speculative decoding
    layers = {f"{step}.{kind}.pt2" for step in steps for kind in ("linear_attention", "full_attention")}
    heads = {"prefill_chunk.head.pt2", "decode_step.head.pt2"}
    assert {p.name for p in (saved / COMPILED_DIR).iterdir()} >= layers | heads
    script = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from helpers import StubHubRepo, left_padded_prompts
from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.exporters import regions
def refuse(*args, **kwargs):
    raise AssertionError("compiled at load")
regions.CompilePool = refuse
model = NeuronQwen36ForCausalLM.from_pretrained({str(saved)!r})
ids, mask = left_padded_prompts({PROMPT_LENGTHS}, seed=1)
out = model.generate(ids, attention_mask=mask, max_new_tokens={NEW_TOKENS}, do_sample=False)
print(json.dumps(out.tolist()))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = torch.tensor(json.loads(result.stdout.strip().splitlines()[-1]))
    assert torch.equal(loaded, _greedy(model))


@pytest.mark.parametrize("bad_id", [512, 10**6, -1])
def test_bad_token_ids_raise_instead_of_aborting(exported, bad_id: int) -> None:
    """The compiled embedding's bounds check would abort the process (a C++ exception inside an OpenMP
    region); generate() refuses the ids first, and the model keeps working."""
    model = exported[3]
    before = _greedy(model)
    with pytest.raises(ValueError, match=f"= {bad_id} is not a token"):
        model.generate(torch.tensor([[3, bad_id, 4]]), max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="integer token ids"):
        model.generate(torch.tensor([[3.0, 4.5]]), max_new_tokens=2, do_sample=False)
    assert torch.equal(_greedy(model), before)


def test_second_export_reuses_the_compile_cache(exported, no_compilation) -> None:
    checkpoint, _, cache_dir, model, _ = exported
    start = time.perf_counter()
    again = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend=BACKEND, compile_cache_dir=cache_dir, **SETTINGS
    )
    assert time.perf_counter() - start < 30
    assert torch.equal(_greedy(again), _greedy(model))


def test_tampered_or_mismatched_artifacts_are_refused(exported, tmp_path: Path, no_compilation) -> None:
    saved = exported[4]
    tampered = shutil.copytree(saved, tmp_path / "tampered")
    graph = tampered / COMPILED_DIR / "decode_step.linear_attention.pt2"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    with pytest.raises(artifact.ArtifactIntegrityError, match=r"decode_step\.linear_attention\.pt2"):
        NeuronQwen36ForCausalLM.from_pretrained(tampered)

    for field, value, error in (
        ("torch", "2.0.0", artifact.ArtifactVersionError),
        ("tp_degree", 2, artifact.ArtifactTopologyError),
        ("format", 2, artifact.ArtifactVersionError),  # whole-step graphs
    ):
        other = shutil.copytree(saved, tmp_path / field)
        manifest = json.loads((other / artifact.MANIFEST_NAME).read_text())
        if field in manifest["environment"]:
            manifest["environment"][field] = value
        else:
            manifest[field] = value
        (other / artifact.MANIFEST_NAME).write_text(json.dumps(manifest))
        with pytest.raises(error, match="re-export"):
            NeuronQwen36ForCausalLM.from_pretrained(other)


class StubHub:
    """Records what push_to_hub would send."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", {"repo_id": repo_id, **kwargs}))

    def upload_folder(self, **kwargs):
        files = sorted(
            p.relative_to(kwargs["folder_path"]).as_posix() for p in Path(kwargs["folder_path"]).rglob("*")
        )
        self.calls.append(("upload_folder", {**kwargs, "files": [f for f in files if "." in f]}))
        return "https://huggingface.co/me/tiny-qwen36/commit/0"


def test_push_to_hub_then_load_the_snapshot(
    exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_compilation
) -> None:
    _, _, _, model, saved = exported
    hub = StubHub()
    model.push_to_hub(saved, "me/tiny-qwen36", private=True, revision="v1", token="t", api=hub)
    assert [name for name, _ in hub.calls] == ["create_repo", "create_branch", "upload_folder"]
    assert hub.calls[0][1]["private"] is True
    upload = hub.calls[2][1]
    assert upload["repo_id"] == "me/tiny-qwen36" and upload["revision"] == "v1"
    graphs = {"compiled/decode_step.head.pt2", "compiled/prefill_chunk.linear_attention.pt2"}
    assert {*graphs, artifact.MANIFEST_NAME} <= set(upload["files"])

    snapshot = shutil.copytree(saved, tmp_path / "snapshot")
    import huggingface_hub

    requested = []

    def fake_snapshot_download(repo_id, revision=None, token=None, **kwargs):
        requested.append((repo_id, revision))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    with pytest.raises(artifact.UntrustedCodeError, match="trust_compiled_code=True"):
        NeuronQwen36ForCausalLM.from_pretrained("me/tiny-qwen36", revision="v1")
    loaded = NeuronQwen36ForCausalLM.from_pretrained(
        "me/tiny-qwen36", revision="v1", trust_compiled_code=True
    )
    assert requested[-1] == ("me/tiny-qwen36", "v1")
    assert torch.equal(_greedy(loaded), _greedy(model))


def test_cli_export_generate_and_cache(
    exported, tmp_path: Path, capsys: pytest.CaptureFixture, no_compilation
):
    checkpoint, _, cache_dir, _, _ = exported
    flags = [
        "--backend",
        BACKEND,
        "--batch-size",
        "2",
        "--sequence-length",
        str(SETTINGS["sequence_length"]),
        "--prefill-chunk-size",
        "16",
    ]
    flags += ["--dtype", "float32", "--compile-cache-dir", str(cache_dir)]
    output = tmp_path / "cli-export"
    assert cli_main(["export", str(checkpoint), str(output), *flags]) == 0
    artifact.verify_artifact(output, BACKEND, 1)
    # Digits are single low-id tokens, inside the tiny model's 512-token vocabulary.
    assert cli_main(["generate", str(output), "--prompt", "1234", "--max-new-tokens", "3"]) == 0
    assert "tok/s" in capsys.readouterr().err
    assert cli_main(["cache", "lookup", str(checkpoint), *flags]) == 0
    assert "hit" in capsys.readouterr().out
    assert cli_main(["cache", "lookup", "--compile-cache-dir", str(cache_dir)]) == 0
    assert "1 entries" in capsys.readouterr().out
    other_cache = shutil.copytree(cache_dir, tmp_path / "other-cache")
    assert cli_main(["cache", "clear", "--compile-cache-dir", str(other_cache)]) == 0
    assert "Removed 1" in capsys.readouterr().out


def test_export_takes_the_graphs_from_a_hub_cache_repo(
    exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_compilation
) -> None:
    """The graphs compiled by the fixture, published in a (stub) Hub compile-cache repository, are used by an
    export with an empty local cache: only with trust_compiled_code=True, and verified by their hashes."""
    checkpoint, _, cache_dir, model, _ = exported
    (entry,) = CompileCache(cache_dir).entries()
    hub = StubHubRepo(tmp_path / "hub")
    shutil.copytree(cache_dir / entry["key"], hub.root / entry["key"])
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", lambda **kwargs: hub)
    monkeypatch.setenv("OPTIMUM_QWEN36_CACHE_REPO", "me/compile-cache")
    local = tmp_path / "local-cache"
    with pytest.raises(artifact.UntrustedCodeError, match="trust_compiled_code=True"):
        NeuronQwen36ForCausalLM.from_pretrained(
            checkpoint, export=True, backend=BACKEND, compile_cache_dir=local, **SETTINGS
        )
    trusted = dict(compile_cache_dir=local, trust_compiled_code=True)
    again = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend=BACKEND, **trusted, **SETTINGS
    )
    assert dict(hub.calls)["snapshot_download"]["repo_id"] == "me/compile-cache"
    assert CompileCache(local).lookup(entry["key"]) is not None  # now in the local cache too
    assert torch.equal(_greedy(again), _greedy(model))


def test_prefix_caching_runs_on_the_same_compiled_graphs(exported, no_compilation) -> None:
    """The KV block pool is a dynamic dimension of the graphs: prefix caching (a larger pool) reuses the
    compilation, and warm runs on the compiled backend give the cold tokens and logits."""
    checkpoint, _, cache_dir, model, _ = exported
    cached = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend=BACKEND, compile_cache_dir=cache_dir, prefix_caching=True, **SETTINGS
    )
    assert cached.backend.name == BACKEND
    assert engine_storage(cached).num_blocks > engine_storage(model).num_blocks
    input_ids, mask = left_padded_prompts([100, 9], seed=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                  output_logits=True)  # fmt: skip
    cold = model.generate(input_ids, **kwargs)
    first = cached.generate(input_ids, **kwargs)
    warm = cached.generate(input_ids, **kwargs)
    assert first.cached_tokens.tolist() == [0, 0]
    assert warm.cached_tokens.tolist() == [64, 0]  # the first row's checkpoint at (100 - 1) // 64 * 64
    for output in (first, warm):
        assert torch.equal(output.sequences, cold.sequences)
        for a, b in zip(output.logits, cold.logits, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # A next turn continues the first row (100 + 7 fed tokens): it resumes from its tail, inside a block.
    turn = torch.cat([warm.sequences[0], input_ids[1, -5:]])[None]
    kwargs.pop("attention_mask")
    cold_turn, warm_turn = model.generate(turn, **kwargs), cached.generate(turn, **kwargs)
    assert warm_turn.cached_tokens.tolist() == [107] and torch.equal(warm_turn.sequences, cold_turn.sequences)
    for a, b in zip(warm_turn.logits, cold_turn.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_decode_runs_only_the_callers_rows(exported, no_compilation) -> None:
    """Every decode runs decode_step (its batch here the static 2 rows), one row padded with a dummy row
    in the scratch slot (so a row's decode is the same computation alone or in company); same tokens as
    eager."""
    checkpoint, _, _, model, _ = exported
    graphs = dict(model.backend.graphs)
    assert set(graphs) == {"prefill_chunk", "decode_step"}
    seen: list[tuple[str, int]] = []

    def recording(graph: str):
        def run(*args: torch.Tensor) -> torch.Tensor:
            seen.append((graph, args[0].shape[0]))
            return graphs[graph](*args)

        return run

    eager = NeuronQwen36ForCausalLM.from_pretrained(checkpoint, export=True, backend="eager", **SETTINGS)
    model.backend.graphs = {graph: recording(graph) for graph in graphs}
    try:
        for lengths in ([21], [21, 5]):
            prompt, mask = left_padded_prompts(lengths, seed=1)
            kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
            seen.clear()
            ours = model.generate(prompt, **kwargs)
            decoded = {step for step in seen if step[0] != "prefill_chunk"}
            assert decoded == {("decode_step", 2)}
            assert torch.equal(ours, eager.generate(prompt, **kwargs))
    finally:
        model.backend.graphs = graphs


def test_attention_reads_only_the_blocks_in_use(
    exported, no_compilation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block table width is a dynamic dimension of the graphs: each step gets the KV blocks that hold
    its positions (64-token blocks here; at least two, where the compiled width starts), not the whole
    compiled sequence_length, and generates the tokens of transformers and of full-width tables."""
    _, reference, _, model, _ = exported
    graphs = dict(model.backend.graphs)
    widths: list[tuple[str, int]] = []

    def recording(method: str):
        def run(*args: torch.Tensor) -> torch.Tensor:
            widths.append((method, args[4 if method == "prefill_chunk" else 3].shape[-1]))
            return graphs[method](*args)

        return run

    prompt, _ = left_padded_prompts([100], seed=2)
    new_tokens = 40
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
    kwargs |= dict(return_dict_in_generate=True, output_logits=True)
    model.backend.graphs = {method: recording(method) for method in graphs}
    try:
        narrow = model.generate(prompt, **kwargs)
        narrow_widths = widths[:]
        with monkeypatch.context() as full_width:
            full_width.setattr(aoti, "blocks_in_use", lambda method, args, cut_tokens: args)
            full = model.generate(prompt, **kwargs)
    finally:
        model.backend.graphs = graphs
    # prefill: 7 chunks of 16 (the last of 4) within blocks 0-1; decode: positions 100..127 in blocks 0-1,
    # then 128..138 reach block 2
    expected = [("prefill_chunk", 2)] * 7 + [("decode_step", 2)] * 28 + [("decode_step", 3)] * 11
    assert narrow_widths == expected
    assert {width for _, width in widths[len(narrow_widths) :]} == {3}  # the compiled sequence_length
    assert torch.equal(narrow.sequences, full.sequences)
    for a, b in zip(narrow.logits, full.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    hf = reference.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    assert torch.equal(narrow.sequences, hf)


def test_a_graph_refuses_a_call_outside_its_compiled_shapes(exported, no_compilation) -> None:
    """decode_step's batch is the static 2 here (no dynamic dimension starts at one row: `regions._dims`),
    and its block table width 2..3: a call with one row, or with a one-column table, raises a clear error
    instead of reading past its tensors; the shapes it was compiled for run."""
    _, _, _, model, _ = exported
    decode = model.backend.graphs["decode_step"]
    args = example_step_args(model.neuron_config, engine_storage(model))["decode_step"]
    input_ids, positions, slots, tables, *caches = args
    assert decode(*args).shape == (2, model.config.vocab_size)
    with pytest.raises(RuntimeError, match="not compiled for"):
        decode(input_ids[:1], positions[:1], slots[:1], tables[:1], *caches)
    with pytest.raises(RuntimeError, match="not compiled for"):
        decode(input_ids, positions, slots, tables[:, :1].contiguous(), *caches)


def test_engine_runs_any_slots_on_the_compiled_graphs(exported, no_compilation) -> None:
    """Continuous batching on the compiled graphs: a request takes the slot another one freed, so decode
    steps pass slots out of order ([1, 0]) and slot 1 decodes alone (padded with PADDING_SLOT, -1); every
    request gets the tokens of its solo run on eager, their log-probabilities within 1e-4."""
    checkpoint, _, _, model, _ = exported
    eager = NeuronQwen36ForCausalLM.from_pretrained(checkpoint, export=True, backend="eager", **SETTINGS)
    graphs = dict(model.backend.graphs)
    slots_seen: list[list[int]] = []

    def recording(graph: str):
        def run(*args: torch.Tensor) -> torch.Tensor:
            if graph != "prefill_chunk":
                slots_seen.append(args[2].tolist())
            return graphs[graph](*args)

        return run

    prompts = [left_padded_prompts([n], seed=s)[0][0].tolist() for n, s in ((21, 1), (5, 2), (40, 3))]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (6, 20, 8)]
    model.backend.graphs = {graph: recording(graph) for graph in graphs}
    try:
        engine = model.create_engine()
        held = [engine.request(engine.add_request(EngineRequest(prompts[i], params[i]))) for i in range(2)]
        while len(held[0].output_ids) < 6:
            engine.step()
        held.append(engine.request(engine.add_request(EngineRequest(prompts[2], params[2]))))
        engine.run()
    finally:
        model.backend.graphs = graphs
    assert [1, 0] in slots_seen and [1, PADDING_SLOT] in slots_seen, slots_seen
    for request, prompt, setting in zip(held, prompts, params, strict=True):
        alone = eager.create_engine()
        request_id = alone.add_request(EngineRequest(prompt, setting))
        reference = alone.run()[request_id]
        assert reference.output_ids == request.output_ids
        torch.testing.assert_close(
            torch.tensor(request.output_logprobs), torch.tensor(reference.output_logprobs), atol=1e-4, rtol=0
        )


def test_prompt_logprobs_on_the_compiled_graphs_equal_transformers(exported, no_compilation) -> None:
    """A prompt of three chunks (the last partial): each token's log-probability after the ones before it,
    from the compiled prefill graphs' hidden states and the eager head."""
    _, reference, _, model, _ = exported
    prompt = left_padded_prompts([40], seed=5)[0][0].tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    engine = model.create_engine()
    request_id = engine.add_request(
        EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    )
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (output,) = outputs
    assert output.request_id == request_id and output.prompt_logprobs[0] is None
    chosen = expected.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(output.prompt_logprobs[1:]), chosen, atol=1e-4, rtol=0)


def test_prefill_computes_only_the_valid_tokens(
    exported, no_compilation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the GDN chunk step is the native op, the prefill graphs take any number of tokens up to a chunk:
    a prompt shorter than a chunk and a prompt's last chunk compute their valid tokens only (one token runs
    padded to two), with the tokens and logits of whole padded chunks. Elsewhere every chunk is whole."""
    _, reference, _, model, _ = exported
    graphs = dict(model.backend.graphs)
    counts: list[int] = []

    def prefill(*args: torch.Tensor) -> torch.Tensor:
        counts.append(args[0].shape[1])
        return graphs["prefill_chunk"](*args)

    kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    model.backend.graphs = {**graphs, "prefill_chunk": prefill}
    seen = {}
    try:
        for length in (5, 33):  # chunks of 16: [5]; [16, 16, 1]
            prompt, _ = left_padded_prompts([length], seed=3)
            counts.clear()
            trimmed = model.generate(prompt, **kwargs)
            seen[length] = counts[:]
            with monkeypatch.context() as padded:
                padded.setattr(aoti, "blocks_in_use", lambda method, args, cut_tokens: args)
                whole = model.generate(prompt, **kwargs)
            assert torch.equal(trimmed.sequences, whole.sequences)
            for a, b in zip(trimmed.logits, whole.logits, strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            hf = reference.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
            assert torch.equal(trimmed.sequences, hf)
    finally:
        model.backend.graphs = graphs
    if model.backend.packs_prefill:
        assert seen == {5: [5], 33: [16, 16, 2]}
    else:
        assert seen == {5: [16], 33: [16, 16, 16]}


def test_a_saved_artifact_prefills_as_its_export_decided(
    exported, no_compilation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether the prefill graphs take any token count is recorded at export: loaded where this CPU's
    build would decide otherwise, the artifact still runs its graphs as they were compiled."""
    _, _, _, model, saved = exported
    recorded = model.backend.packs_prefill
    assert (saved / COMPILED_DIR / aoti.STEP_SHAPES).is_file()
    monkeypatch.setattr(compile_aoti, "prefill_takes_any_tokens", lambda *args, **kwargs: not recorded)
    loaded = NeuronQwen36ForCausalLM.from_pretrained(saved)
    assert loaded.backend.packs_prefill == recorded
    assert torch.equal(_greedy(loaded), _greedy(model))


def test_packed_prefill_on_the_compiled_graphs(exported, no_compilation) -> None:
    """Where the prefill graphs pack sequences (the native varlen ops), three sequences' chunks in one call
    compute each sequence's logits, KV and GDN states as one call per chunk does, decode rows riding
    beside a whole chunk (more tokens than a chunk) as a decode step does, and the states it snapshots
    inside a chunk are those of chunks ending there."""
    _, _, _, model, _ = exported
    if not model.backend.packs_prefill:
        pytest.skip("these prefill graphs take one sequence per call (no native GDN chunk op here)")
    assert model.backend.decodes_in_prefill
    assert_packed_equals_one_per_call(model, atol=1e-5)
    assert_decode_rows_ride_along(model, atol=1e-5)
    assert_snapshots_equal_chunks_ending_there(model, atol=1e-5)
