"""The neuron backend without the Neuron SDK: the error that says what to install, and, against the stand-in
SDK of neuron_standin.py (which reads and writes the NEFF cache where TorchNeuron does), what the backend does
with the compiler's cache: where a fresh export compiles to, what save_pretrained carries, that a load reuses
the NEFFs without compiling or writing into the verified artifact, and when the NKI ops are imported."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import add_random_mtp_weights, save_tiny_checkpoint, tiny_text_config
from helpers import export_eager, free_port, image_patches, image_tokens, left_padded_prompts
from neuron_standin import (
    DEVICE,
    FAIL_COMPILE_ON_RANK_ENV,
    NEFF_CACHE_ENV,
    NEURON_OPS,
    OPS,
    VISIBLE_CORES_ENV,
    Build,
    StandInNeuronSDK,
)

from optimum_qwen36 import NeuronQwen36ForCausalLM, NeuronQwen36ForConditionalGeneration
from optimum_qwen36 import nki as nki_ops
from optimum_qwen36.backends import neuron
from optimum_qwen36.distributed.group import TensorParallelWorkerError
from optimum_qwen36.engine import EngineRequest, SamplingParams
from optimum_qwen36.exporters import artifact

SETTINGS = dict(batch_size=2, sequence_length=64, prefill_chunk_size=16, dtype="float32")
STEP_OPTIONS = dict(backend="neuron", fullgraph=True, dynamic=False)


def new_process(sdk: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a fresh Python process starts from: no runtime, no process NEFF cache, the variable unset."""
    sdk.restart()
    monkeypatch.setattr(neuron, "_process_cache", None)
    monkeypatch.delenv(NEFF_CACHE_ENV, raising=False)
    monkeypatch.delenv(VISIBLE_CORES_ENV, raising=False)


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[StandInNeuronSDK]:
    standin = StandInNeuronSDK(tmp_path / "default-neff-cache")
    standin.install(monkeypatch)
    new_process(standin, monkeypatch)
    monkeypatch.delenv("TORCH_NEURONX_NEFF_DISABLE_CACHE", raising=False)
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)
    # The stand-in's device is the CPU.
    monkeypatch.setitem(neuron.NeuronBackend.__init__.__kwdefaults__, "device", DEVICE)
    yield standin
    standin.restart()  # drops the stand-in neuron_ops module


@pytest.fixture
def checkpoint(tiny_checkpoint) -> Path:
    path, _ = tiny_checkpoint("causal", seed=3)
    return path


def greedy(model: NeuronQwen36ForCausalLM) -> torch.Tensor:
    ids, mask = left_padded_prompts([5, 9], seed=1)
    return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)


def export(checkpoint: Path, **settings: Any) -> NeuronQwen36ForCausalLM:
    return NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend="neuron", **{**SETTINGS, **settings}
    )


def outcomes(builds: list[Build]) -> list[tuple[str, str]]:
    return [(b.step, b.outcome) for b in builds]


def artifact_neffs(directory: Path) -> dict[str, bytes]:
    root = directory / "compiled" / neuron.NEURON_CACHE_DIR
    return {name: (root / name).read_bytes() for name in neuron.neff_files(root)}


def test_missing_sdk_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)  # makes the import fail
    with pytest.raises(neuron.NeuronSDKUnavailableError) as error:
        neuron.require_torch_neuronx()
    assert "pip.repos.neuron.amazonaws.com" in str(error.value)
    assert "torch-neuronx==2.14.*" in str(error.value)
    assert "backend='cpu'" in str(error.value)


def test_export_with_neuron_backend_fails_clearly_without_sdk(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)
    with pytest.raises(neuron.NeuronSDKUnavailableError, match="AWS Neuron"):
        export(checkpoint)


def test_export_save_and_load_reuse_the_neffs(
    checkpoint: Path, sdk: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    want = greedy(export_eager(checkpoint, **SETTINGS))
    model = export(checkpoint)
    assert sdk.compile_calls == [("prefill_chunk", STEP_OPTIONS), ("decode_step", STEP_OPTIONS)]
    # The runtime read TORCH_NEURONX_NEFF_CACHE_DIR, which the backend pointed at the process's private cache
    # (not the shared default /tmp/neff_cache), and the warm-up compiled both steps there.
    work = sdk.cache_dir
    assert work == model.backend.neff_cache.directory == Path(os.environ[NEFF_CACHE_ENV])
    assert work != sdk.default_cache_dir and not sdk.default_cache_dir.exists()
    assert [(b.step, b.outcome) for b in sdk.builds] == [
        ("prefill_chunk", "compiled"),
        ("decode_step", "compiled"),
    ]
    built = {name: (work / name).read_bytes() for name in neuron.neff_files(work)}
    assert sorted(built) == sorted(f"{b.key[:2]}/{b.key[2:4]}/{b.key}.neff" for b in sdk.builds)
    assert torch.equal(greedy(model), want)
    assert len(sdk.builds) == 2  # generate() ran the shapes the warm-up compiled: no compilation at run time

    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    assert artifact_neffs(saved) == built
    manifest = artifact.read_manifest(saved)
    assert {f"compiled/neuron_cache/{name}" for name in built} <= set(manifest["files"])

    # Another process, or another machine: the export's cache is gone; only the artifact has the NEFFs.
    new_process(sdk, monkeypatch)
    shutil.rmtree(work)
    sdk.events.clear()
    loaded = NeuronQwen36ForCausalLM.from_pretrained(saved)
    # The NKI ops were imported (and registered) before the steps were handed to torch.compile.
    kinds = [kind for kind, _ in sdk.events]
    assert sdk.events[: 1 + len(OPS)] == [("import", NEURON_OPS)] + [("register", op) for op in OPS]
    assert kinds.index("torch.compile") > len(OPS)
    assert torch.equal(greedy(loaded), want)
    loads = sdk.builds[2:]
    assert [(b.step, b.outcome) for b in loads] == [
        ("prefill_chunk", "persistent hit"),
        ("decode_step", "persistent hit"),
    ]
    assert [b.key for b in loads] == [b.key for b in sdk.builds[:2]]
    # The runtime read the NEFFs from a working copy, not from the verified artifact, and wrote nothing there.
    assert saved.resolve() not in (sdk.cache_dir.resolve(), *sdk.cache_dir.resolve().parents)
    assert artifact_neffs(saved) == built
    artifact.verify_artifact(saved, "neuron", 1)

    # Saving the loaded model carries the NEFFs on.
    resaved = tmp_path / "resaved"
    loaded.save_pretrained(resaved)
    assert artifact_neffs(resaved) == built


def test_exporting_again_in_the_same_process_still_saves_the_neffs(
    checkpoint: Path, sdk: StandInNeuronSDK, tmp_path: Path
) -> None:
    export(checkpoint)
    again = export(checkpoint)
    # The runtime found the second export's graphs in memory: nothing new was written to the cache.
    assert [b.outcome for b in sdk.builds] == ["compiled", "compiled", "memory hit", "memory hit"]
    again.save_pretrained(tmp_path / "saved")
    assert sorted(artifact_neffs(tmp_path / "saved")) == sorted(neuron.neff_files(sdk.cache_dir))
    assert len(artifact_neffs(tmp_path / "saved")) == 2


def test_a_cache_dir_set_by_the_user_is_used_and_only_this_process_neffs_are_saved(
    checkpoint: Path, sdk: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    shared = tmp_path / "shared-neff-cache"
    unrelated = shared / "ab" / "cd" / f"abcd{'0' * 28}.neff"
    unrelated.parent.mkdir(parents=True)
    unrelated.write_bytes(b"another model's NEFF")
    monkeypatch.setenv(NEFF_CACHE_ENV, str(shared))
    model = export(checkpoint)
    assert sdk.cache_dir == shared
    model.save_pretrained(tmp_path / "saved")
    saved = artifact_neffs(tmp_path / "saved")
    assert len(saved) == 2 and unrelated.relative_to(shared).as_posix() not in saved

    # A later process with the same shared cache, where one of those NEFFs was changed since: the load
    # puts the artifact's verified bytes back, and the runtime finds them.
    new_process(sdk, monkeypatch)
    monkeypatch.setenv(NEFF_CACHE_ENV, str(shared))
    changed = shared / sorted(saved)[0]
    changed.write_bytes(b"not the NEFF the manifest verified")
    greedy(NeuronQwen36ForCausalLM.from_pretrained(tmp_path / "saved"))
    assert changed.read_bytes() == saved[sorted(saved)[0]]
    assert [b.outcome for b in sdk.builds[2:]] == ["persistent hit", "persistent hit"]


def test_neuron_work_before_the_model_is_reported(
    checkpoint: Path, sdk: StandInNeuronSDK, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    # Something compiled on Neuron before the model was created: the runtime has read the (unset) variable.
    torch.compile(lambda x: x + 1, backend="neuron")(torch.ones(1))
    with caplog.at_level(logging.WARNING, logger=neuron.__name__):
        model = export(checkpoint)
    assert sdk.cache_dir == sdk.default_cache_dir  # where the steps' NEFFs went, out of the backend's sight
    assert "wrote no NEFF" in caplog.text
    with pytest.raises(RuntimeError, match="no NEFF of its steps"):
        model.save_pretrained(tmp_path / "saved")


def test_saving_refuses_when_the_steps_neffs_were_already_in_the_users_cache(
    checkpoint: Path, sdk: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A shared cache that already holds the steps' NEFFs: the warm-up only reads them, and which of the
    cache's files are this model's is unknown, so the save refuses rather than write an artifact that
    would compile again at load."""
    shared = tmp_path / "shared-neff-cache"
    monkeypatch.setenv(NEFF_CACHE_ENV, str(shared))
    export(checkpoint)
    new_process(sdk, monkeypatch)
    monkeypatch.setenv(NEFF_CACHE_ENV, str(shared))
    model = export(checkpoint)
    assert [b.outcome for b in sdk.builds[2:]] == ["persistent hit", "persistent hit"]
    with pytest.raises(RuntimeError, match=NEFF_CACHE_ENV):
        model.save_pretrained(tmp_path / "saved")


def test_the_cache_variable_stays_where_the_runtime_read_it(
    sdk: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    first = neuron.process_neff_cache().directory
    assert os.environ[NEFF_CACHE_ENV] == str(first) and first.is_dir()
    monkeypatch.setenv(NEFF_CACHE_ENV, "/somewhere/else")
    with caplog.at_level(logging.WARNING, logger=neuron.__name__):
        assert neuron.process_neff_cache().directory == first
    assert os.environ[NEFF_CACHE_ENV] == str(first)
    assert "reads the variable once per process" in caplog.text


def test_neuron_ops_are_imported_before_tracing(
    sdk: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inside a trace, a first import of neuron_ops is refused (Dynamo would have to trace the import).
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="load_neuron_ops"):
        nki_ops._neuron_ops()
    assert sdk.events == []
    module = nki_ops.load_neuron_ops()
    assert nki_ops._neuron_ops() is module  # once imported, the trace only looks it up
    assert sdk.events == [("import", NEURON_OPS)] + [("register", op) for op in OPS]


def test_the_traced_step_only_looks_neuron_ops_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a real Dynamo trace (fullgraph, as the neuron backend compiles), the dispatch finds the
    already imported ops module without a graph break."""
    import types as module_types

    ops = module_types.ModuleType(NEURON_OPS)
    ops.scale = lambda x: x * 2
    monkeypatch.setitem(sys.modules, NEURON_OPS, ops)

    def step(x: torch.Tensor) -> torch.Tensor:
        return nki_ops._neuron_ops().scale(x) + 1

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))


def test_speculative_decoding_runs_only_the_shapes_the_warm_up_compiled(
    tiny_checkpoint, sdk: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """num_speculative_tokens=2: the warm-up compiles the chunk with its hidden states, the verify step (3
    tokens of every row) and the MTP step at 3 and 16 positions; the engine, serving requests of several
    chunks in a continuous batch, gives the eager model's tokens and compiles nothing more (static shapes:
    verify and MTP calls padded to the full batch, MTP positions to a compiled width); saved and loaded in
    another process, every step is read from the artifact's NEFFs."""
    checkpoint, _ = tiny_checkpoint("causal", seed=4)
    add_random_mtp_weights(checkpoint, tiny_text_config(), seed=4)
    prompts = [[(7 * i + n) % 500 + 1 for i in range(n)] for n in (5, 20, 37)]

    def serve(model: NeuronQwen36ForCausalLM) -> tuple[list[list[int]], dict]:
        engine = model.create_engine()
        ids = [
            engine.add_request(EngineRequest(p, SamplingParams(max_tokens=12, temperature=0.0)))
            for p in prompts
        ]
        done = engine.run()
        return [done[i].output_ids for i in ids], engine.stats()["speculative"]

    want, _ = serve(export_eager(checkpoint, num_speculative_tokens=2, **SETTINGS))
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend="neuron", num_speculative_tokens=2, **SETTINGS
    )
    steps = ["prefill_chunk", "decode_step", "prefill_chunk_hidden", "verify_step", "mtp_step", "mtp_step"]
    assert [b.step for b in sdk.builds] == steps
    got, stats = serve(model)
    assert got == want
    assert stats["drafted_per_position"][1] > 0
    assert len(sdk.builds) == len(steps)  # nothing compiled at run time

    model.save_pretrained(tmp_path / "saved")
    new_process(sdk, monkeypatch)
    loaded = NeuronQwen36ForCausalLM.from_pretrained(tmp_path / "saved")
    assert serve(loaded)[0] == want
    assert {b.outcome for b in sdk.builds[len(steps) :]} == {"persistent hit"}


# ------------------------------------------------------------------------------------------ tensor parallel
# tp_degree 2 against the stand-in installed in rank 0's process (this one) and in the worker processes: each
# rank creates TorchNeuron's process group before its runtime starts, on a NeuronCore of its own
# (TorchNeuron's choice, or the launcher's share of NEURON_RT_VISIBLE_CORES), the compiled steps'
# collectives run on that group, the tokens are one eager process's, and a saved model holds every rank's
# NEFFs (the ranks' graphs differ: each holds its vocabulary start), so loading it compiles on no rank.
# One KV head for 2 ranks (replicated), 6 GDN value heads over 2 key heads.
TP_AWKWARD = dict(num_key_value_heads=1, linear_num_value_heads=6)


@pytest.fixture
def tp_checkpoint(tmp_path: Path) -> Path:
    directory, _ = save_tiny_checkpoint(tmp_path / "ckpt", seed=3, **TP_AWKWARD)
    return directory


@pytest.fixture
def workers_too(sdk: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandInNeuronSDK]:
    """The stand-in in this process (rank 0) and in the workers it starts; no NeuronCores chosen yet."""
    sdk.reach_new_processes(monkeypatch)
    yield sdk


def generated_with_logits(model: NeuronQwen36ForCausalLM) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = left_padded_prompts([5, 9], seed=1)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.logits)


def close(model: NeuronQwen36ForCausalLM) -> list[int]:
    """Close a tensor-parallel model (as its finalizer does); the workers' exit codes."""
    model.tensor_parallel.close()
    return [worker.returncode for worker in model.tensor_parallel.group.workers]


def build_outcomes(events: list[tuple[str, str]]) -> list[str]:
    """What each build among a process's logged events found: "compiled", or a hit in the cache."""
    return [kind for kind, _ in events if kind in ("compiled", "persistent hit", "memory hit")]


def worker_events(sdk: StandInNeuronSDK, seen: set[int]) -> list[tuple[str, str]]:
    """The events of the one worker process started since the pids `seen`."""
    logs = {pid: events for pid, events in sdk.logged_events().items() if pid not in seen}
    assert len(logs) == 1, logs
    return next(iter(logs.values()))


def test_tp2_gives_one_process_tokens_and_reloads_without_compiling_on_any_rank(
    tp_checkpoint: Path, workers_too: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sdk = workers_too
    want, want_logits = generated_with_logits(export_eager(tp_checkpoint, **SETTINGS))

    model = export(tp_checkpoint, tp_degree=2)
    tokens, logits = generated_with_logits(model)
    assert torch.equal(tokens, want)
    assert (logits - want_logits).abs().max() <= 1e-5 * want_logits.abs().max()
    # Each rank: its process group first, then its runtime, on a core of its own; compiling the steps
    # resolved their collectives' group name to that group. TorchNeuron chose the cores (rank r: core r).
    rank_1 = worker_events(sdk, set())
    for events, rank in ((sdk.events, 0), (rank_1, 1)):
        kinds = [kind for kind, _ in events]
        assert kinds.index("process group") < kinds.index("runtime") < kinds.index("compiled")
        assert ("process group", f"rank {rank} of 2") in events
        assert ("cores", str(rank)) in events
        assert ("collective group", "neuron on ranks [0, 1]") in events
    # Each rank compiled its prefill_chunk and decode_step; the ranks' graphs differ (each holds where its
    # share of the vocabulary starts), so four NEFFs, in the one cache directory the ranks share.
    for events in (sdk.events, rank_1):
        assert [what for kind, what in events if kind == "compiled"] == ["prefill_chunk", "decode_step"]
    cache = model.backend.neff_cache.directory
    assert len(neuron.neff_files(cache)) == 4

    saved = tmp_path / "saved"
    model.save_pretrained(saved)  # rank 0 finds rank 1's NEFFs in the shared cache (torchrun's test: sent)
    assert set(artifact_neffs(saved)) == neuron.neff_files(cache)
    assert close(model) == [0]
    # This process's runtime was set up for that model's group: a second one is refused, saying why.
    with pytest.raises(RuntimeError, match="already started the Neuron runtime"):
        NeuronQwen36ForCausalLM.from_pretrained(saved)

    # Another process, with the cores the model may use named: the launcher gives each rank one of them.
    new_process(sdk, monkeypatch)
    monkeypatch.setenv(VISIBLE_CORES_ENV, "2-3")
    sdk.events.clear()
    seen = set(sdk.logged_events())
    loaded = NeuronQwen36ForCausalLM.from_pretrained(saved)
    tokens, _ = generated_with_logits(loaded)
    assert torch.equal(tokens, want)
    rank_1 = worker_events(sdk, seen)
    for events, core in ((sdk.events, "2"), (rank_1, "3")):
        assert ("cores", core) in events
        assert build_outcomes(events) == [
            "persistent hit",
            "persistent hit",
        ]  # every rank's NEFFs came with the artifact
    assert close(loaded) == [0]


def test_visible_cores_are_shared_out_or_refused_before_any_worker_starts(
    tp_checkpoint: Path, workers_too: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert neuron.visible_cores("0-3, 6") == [0, 1, 2, 3, 6]
    with pytest.raises(ValueError, match="is not a list of NeuronCores"):
        neuron.visible_cores("3-1")
    monkeypatch.setenv(VISIBLE_CORES_ENV, "4,6-9")
    cores = [environment[VISIBLE_CORES_ENV] for environment in neuron.tensor_parallel_environments(4)]
    assert cores == ["4", "6", "7", "8"]
    monkeypatch.setenv(VISIBLE_CORES_ENV, "5")
    with pytest.raises(ValueError, match=r"tp_degree=2 runs one rank per NeuronCore.*names 1"):
        export(tp_checkpoint, tp_degree=2)
    assert workers_too.logged_events() == {}  # no worker started
    assert os.environ[VISIBLE_CORES_ENV] == "5"


def rank_events(logs: dict[int, list[tuple[str, str]]], rank: int) -> list[tuple[str, str]]:
    """The logged events of the one process that was rank `rank`."""
    (events,) = [events for events in logs.values() if ("process group", f"rank {rank} of 2") in events]
    return events


def test_torchrun_ranks_with_caches_of_their_own_save_every_ranks_neffs(
    tp_checkpoint: Path, workers_too: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Under torchrun each process has a NEFF cache of its own (and TorchNeuron gives it the core of its
    LOCAL_RANK): saving sends rank 1's NEFFs to rank 0, and the artifact then loads without compiling."""
    sdk = workers_too
    want, _ = generated_with_logits(export_eager(tp_checkpoint, **SETTINGS))
    saved = tmp_path / "saved"
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from optimum_qwen36 import NeuronQwen36ForCausalLM, NeuronQwen36ForConditionalGeneration
            model = NeuronQwen36ForCausalLM.from_pretrained(
                {str(tp_checkpoint)!r}, export=True, backend="neuron", tp_degree=2, **{SETTINGS!r}
            )
            model.save_pretrained({str(saved)!r})
            model.tensor_parallel.close()
            """
        )
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-port", str(free_port()), str(script)]  # not the default: other tests may hold it
    result = subprocess.run(torchrun, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    logs = sdk.logged_events()
    caches = set()
    for rank in range(2):
        events = rank_events(logs, rank)
        kinds = [kind for kind, _ in events]
        assert kinds.index("process group") < kinds.index("runtime") < kinds.index("compiled")
        assert ("cores", str(rank)) in events
        assert ("collective group", "neuron on ranks [0, 1]") in events
        caches |= {what for kind, what in events if kind == "runtime"}
    assert len(caches) == 2  # a cache directory each
    assert len(artifact_neffs(saved)) == 4  # prefill_chunk and decode_step of each rank

    seen = set(logs)
    loaded = NeuronQwen36ForCausalLM.from_pretrained(saved)
    assert torch.equal(generated_with_logits(loaded)[0], want)
    for events in (sdk.events, worker_events(sdk, seen)):
        assert build_outcomes(events) == ["persistent hit", "persistent hit"]
    assert close(loaded) == [0]


def test_a_worker_without_the_sdk_fails_the_export_at_once_with_its_error(
    tp_checkpoint: Path, sdk: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stand-in is in this process only: rank 1 cannot import torch_neuronx, and says so before it
    would join the process group (where rank 0 would wait for it)."""
    start = time.monotonic()
    with pytest.raises(
        TensorParallelWorkerError, match="rank 1 failed to build its model: NeuronSDKUnavailable"
    ):
        export(tp_checkpoint, tp_degree=2)
    assert time.monotonic() - start < 60


def test_a_worker_failing_to_compile_ends_the_export_with_its_error(
    tp_checkpoint: Path, workers_too: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 fails in the warm-up, after the ranks joined: rank 0, in the step's collective, reports rank
    1's error, not the broken collective's."""
    monkeypatch.setenv(FAIL_COMPILE_ON_RANK_ENV, "1")
    monkeypatch.setenv(VISIBLE_CORES_ENV, "2-3")
    start = time.monotonic()
    with pytest.raises(
        TensorParallelWorkerError, match="rank 1 failed to build its model: RuntimeError: neuronx-cc"
    ):
        export(tp_checkpoint, tp_degree=2)
    assert time.monotonic() - start < 60
    assert not torch.distributed.is_initialized()  # rank 0's group went with the failed export
    assert os.environ[VISIBLE_CORES_ENV] == "2-3"  # rank 0's share ("2") undone


def test_images_run_graphs_of_their_own_compiled_at_export(
    sdk: StandInNeuronSDK, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A vision-language checkpoint: the warm-up also compiles the prefill and decode steps with image
    arguments (the tower runs on the host); a prompt with an image then gives the eager model's tokens
    without compiling, and a saved model reads all four graphs from its NEFFs."""
    checkpoint, reference = save_tiny_checkpoint(tmp_path / "ckpt", layout="conditional", seed=2)
    grid = (1, 8, 6)
    prompt = torch.tensor([[3, 4, *image_tokens(grid), *range(20, 40)]])
    images = dict(pixel_values=image_patches(reference.config.vision_config, grid, 1), image_grid_thw=[grid])

    def generate(model: NeuronQwen36ForConditionalGeneration) -> list[int]:
        return model.generate(prompt, **images, max_new_tokens=6, do_sample=False)[0].tolist()

    eager = NeuronQwen36ForConditionalGeneration.from_pretrained(checkpoint, export=True, **SETTINGS)
    model = NeuronQwen36ForConditionalGeneration.from_pretrained(
        checkpoint, export=True, backend="neuron", **SETTINGS
    )
    assert [b.step for b in sdk.builds] == ["prefill_chunk", "decode_step"] * 2
    assert generate(model) == generate(eager)
    assert len(sdk.builds) == 4  # nothing compiled at run time
    model.save_pretrained(tmp_path / "saved")
    new_process(sdk, monkeypatch)
    loaded = NeuronQwen36ForConditionalGeneration.from_pretrained(tmp_path / "saved")
    assert generate(loaded) == generate(eager)
    assert {b.outcome for b in sdk.builds[4:]} == {"persistent hit"}
