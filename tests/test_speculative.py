"""MTP speculative decoding: exact by construction.

- The verify step's GDN state after each of its positions equals the state one-token decode steps reach.
- Greedy: the engine with k = 1, 2, 3 drafts gives the tokens (and log-probabilities) of the engine without
  speculation, in continuous batches whose rows accept different numbers of drafts, with stop tokens,
  max_tokens and grammar-constrained rows, with prefix caching (warm == cold, a multi-turn reuse of a
  speculative answer) and under forced preemption.
- Sampling: the kept tokens are distributed as one-token-at-a-time sampling (the acceptance rule alone,
  and the whole engine on a small-vocabulary model with its real MTP layer).

Random MTP weights accept almost nothing, so the greedy tests replace the MTP layer's proposals by an
oracle's: the plain run's own next tokens, each corrupted with probability 0.35 (the MTP layer still runs,
so its KV and hidden states are exercised). fp32, eager backend, tiny models.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from collections import Counter
from typing import Any

import pytest
import torch
from conftest import add_random_mtp_weights, save_tiny_checkpoint, tiny_text_config
from fp8_checkpoints import write_official_fp8
from helpers import after_drafting, engine_storage, export_eager, recording_drafts
from safetensors.torch import load_file, save_file

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.engine import EngineRequest, SamplingParams
from optimum_qwen36.engine.sampling import SamplingRow, filter_logits, request_generator, verify_drafts
from optimum_qwen36.exporters.compile_cache import compile_key
from optimum_qwen36.network.quantization import Fp8Linear
from optimum_qwen36.network.weights import CheckpointError

SETTINGS = dict(batch_size=4, sequence_length=1024, prefill_chunk_size=64)
VOCAB = 512
MISS_RATE = 0.35


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    directory, _ = save_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "ckpt", "causal", seed=9)
    add_random_mtp_weights(directory, tiny_text_config(), seed=3)
    return directory


@pytest.fixture(scope="module")
def plain(checkpoint):
    return export_eager(checkpoint, prefix_caching=True, **SETTINGS)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class EvenTokens:
    """A grammar stand-in: only even token ids (speculation must not draft for such a request)."""

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        return torch.arange(vocab_size) % 2 == 0

    def accept(self, token_id: int) -> None:
        assert token_id % 2 == 0


def run_engine(model, requests: list[tuple[list[int], dict[str, Any]]], **engine_kwargs: Any):
    """Submit all requests, step until done; returns ([request objects], engine)."""
    engine = model.create_engine(**engine_kwargs)
    ids = []
    for prompt, settings in requests:
        settings = dict(settings)
        constraint = settings.pop("constraint", None)
        params = SamplingParams(**{"temperature": 0, "logprobs": 3, **settings})
        ids.append(engine.add_request(EngineRequest(prompt, params, constraint=constraint)))
    done = engine.run()
    return [done[i] for i in ids], engine


@pytest.fixture
def oracle_drafts(monkeypatch: pytest.MonkeyPatch):
    """Replace the MTP layer's drafts by the reference run's tokens, some corrupted; returns the dict of
    reference outputs by prompt to fill in."""
    references: dict[tuple[int, ...], list[int]] = {}

    def proposal(request, index: int) -> int:
        reference = references[tuple(request.prompt_ids)]
        rng = random.Random(f"{len(request.prompt_ids)}-{request.prompt_ids[:4]}-{index}")
        if index < len(reference) and rng.random() >= MISS_RATE:
            return reference[index]
        return (reference[index] + 1 if index < len(reference) else 1) % VOCAB

    def rewrite(request) -> None:
        done = len(request.output_ids)
        request.draft_ids = [proposal(request, done + j) for j in range(len(request.draft_ids))]

    after_drafting(monkeypatch, rewrite)
    return references


def assert_same_outputs(ours, reference) -> None:
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine.output_ids == theirs.output_ids, (mine.request_id, mine.output_ids, theirs.output_ids)
        assert mine.finish_reason == theirs.finish_reason
        torch.testing.assert_close(
            torch.tensor(mine.output_logprobs), torch.tensor(theirs.output_logprobs), atol=1e-4, rtol=0
        )


def mixed_requests() -> list[tuple[list[int], dict[str, Any]]]:
    return [
        (tokens(1, 1), dict(max_tokens=40, ignore_eos=True)),
        (tokens(5, 2), dict(max_tokens=23, ignore_eos=True)),
        (tokens(64, 3), dict(max_tokens=31, ignore_eos=True)),
        (tokens(100, 4), dict(max_tokens=17, ignore_eos=True)),
        (tokens(200, 5), dict(max_tokens=40, ignore_eos=True, constraint=EvenTokens())),
        (tokens(300, 6), dict(max_tokens=29, ignore_eos=True, min_tokens=3)),
        (tokens(33, 7), dict(max_tokens=35, ignore_eos=True)),
    ]


def with_stop_token(requests, plain_outputs, index: int, position: int):
    """Request `index` again, stopping on the token its plain run produced at `position`."""
    prompt, settings = requests[index]
    stop = plain_outputs[index].output_ids[position]
    return [*requests, (prompt, {**settings, "stop_token_ids": (stop,), "max_tokens": 40})]


def test_verify_step_states_equal_one_token_decode_steps(checkpoint) -> None:
    """The verify step leaves the slot's state alone and writes, for each position t, the state t + 1 decode
    steps reach (conv and recurrent state within float32 rounding; the logits of the same tokens)."""
    model = export_eager(checkpoint, num_speculative_tokens=3, **SETTINGS)
    cache = engine_storage(model)
    runner_args = dict(block_tables=cache.row_block_tables()[:2], slots=torch.tensor([0, 1]))
    backend = model.backend
    prompt = [tokens(70, 11), tokens(9, 12)]
    for row, ids in enumerate(prompt):
        for start in range(0, len(ids), 64):
            chunk = torch.zeros((1, 64), dtype=torch.long)
            part = ids[start : start + 64]
            chunk[0, : len(part)] = torch.tensor(part)
            backend.prefill_chunk(
                chunk, torch.tensor(start), torch.tensor(len(part)), torch.tensor(row),
                cache.row_block_tables()[row], *cache.step_tensors(),
            )  # fmt: skip
    fed = torch.tensor([tokens(4, 13), tokens(4, 14)])
    starts = torch.tensor([len(p) for p in prompt])
    before = [t.clone() for t in cache.step_tensors()[2:]]
    logits, _ = backend.verify_step(
        fed, starts, torch.tensor([4, 3]), runner_args["slots"], runner_args["block_tables"],
        *cache.step_tensors(), *cache.spec_tensors(),
    )  # fmt: skip
    for now, then in zip(cache.step_tensors()[2:], before, strict=True):
        assert torch.equal(now, then)  # the slots' states are untouched
    spec_conv, spec_recurrent = cache.spec_tensors()
    for t in range(4):
        step_logits = backend.decode_step(
            fed[:, t : t + 1],
            starts + t,
            runner_args["slots"],
            runner_args["block_tables"],
            *cache.step_tensors(),
        )
        for row in range(2):
            if row == 1 and t == 3:
                continue  # beyond row 1's 3 real tokens
            # Not bitwise: the verify step's projections multiply T rows at once (~1e-6 rounding here).
            torch.testing.assert_close(spec_conv[:, row, t], cache.conv_state[:, row], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                spec_recurrent[:, row, t], cache.recurrent_state[:, row], atol=1e-5, rtol=1e-5
            )
            scale = float(step_logits[row].abs().max())
            assert float((logits[row, t] - step_logits[row]).abs().max()) <= 1e-5 * scale


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_tokens_equal_plain_decoding_with_mixed_acceptance(
    checkpoint, plain, oracle_drafts, k
) -> None:
    """7 requests on 4 slots (continuous batching), one constrained by a grammar, one ending on a stop token
    in the middle of a step's accepted drafts: same tokens, finish reasons and log-probabilities as without
    speculation, while rows accept 0..k drafts in the same steps."""
    requests = mixed_requests()
    reference, _ = run_engine(plain, requests)
    requests = with_stop_token(requests, reference, 3, 9)
    reference, _ = run_engine(plain, requests)
    assert reference[-1].output_ids[-1] == reference[3].output_ids[9]
    for (prompt, _), out in zip(requests, reference, strict=True):
        oracle_drafts[tuple(prompt)] = out.output_ids
    model = export_eager(checkpoint, num_speculative_tokens=k, prefix_caching=True, **SETTINGS)
    ours, engine = run_engine(model, requests)
    assert_same_outputs(ours, reference)
    stats = engine.stats()["speculative"]
    drafted, accepted = stats["drafted_per_position"], stats["accepted_per_position"]
    assert len(drafted) == k and all(0 < a < d for a, d in zip(accepted, drafted, strict=True)), stats
    assert stats["acceptance_rate_per_position"][0] == pytest.approx(accepted[0] / drafted[0])


def test_prefix_caching_warm_equals_cold_across_turns(checkpoint, plain, oracle_drafts) -> None:
    """A second turn whose prompt holds the first turn's speculative answer: warm (reusing the cached
    prefix, with GDN checkpoints taken inside verify steps) gives the cold and the plain tokens."""
    model = export_eager(checkpoint, num_speculative_tokens=2, prefix_caching=True, **SETTINGS)
    first = (tokens(150, 21), dict(max_tokens=70, ignore_eos=True))
    (plain_first,), _ = run_engine(plain, [first])
    oracle_drafts[tuple(first[0])] = plain_first.output_ids
    engine = model.create_engine()
    (turn1,) = [
        engine.add_request(
            EngineRequest(first[0], SamplingParams(temperature=0, max_tokens=70, ignore_eos=True))
        )
    ]
    answer = engine.run()[turn1].output_ids
    assert answer == plain_first.output_ids
    second_prompt = first[0] + answer + tokens(20, 22)
    second = (second_prompt, dict(max_tokens=30, ignore_eos=True))
    (plain_second,), _ = run_engine(plain, [second])
    oracle_drafts[tuple(second_prompt)] = plain_second.output_ids
    warm = engine.add_request(
        EngineRequest(second_prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    )
    warm_request = engine.run()[warm]
    # The first turn's decode-time checkpoints (every 64 tokens) reach into its answer.
    assert warm_request.cached_prompt_tokens >= 192
    engine.prefix_cache.clear()
    cold = engine.add_request(
        EngineRequest(second_prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    )
    cold_request = engine.run()[cold]
    assert cold_request.cached_prompt_tokens == 0
    assert warm_request.output_ids == cold_request.output_ids == plain_second.output_ids


def test_preemption_resumes_exactly(checkpoint, plain, oracle_drafts) -> None:
    """A KV pool too small for the batch: requests are preempted mid-decode, their drafts dropped, and
    resumed from the prefix cache; tokens still equal plain decoding."""
    requests = [(tokens(180 + 10 * i, 30 + i), dict(max_tokens=60, ignore_eos=True)) for i in range(4)]
    reference, _ = run_engine(plain, requests)
    for (prompt, _), out in zip(requests, reference, strict=True):
        oracle_drafts[tuple(prompt)] = out.output_ids
    model = export_eager(checkpoint, num_speculative_tokens=3, prefix_caching=True, **SETTINGS)
    ours, engine = run_engine(model, requests, num_kv_blocks=1 + 12)
    assert engine.stats()["preemptions"] > 0
    assert_same_outputs(ours, reference)


def chi_square_critical(df: int, z: float = 3.29) -> float:
    """The chi-square value exceeded with probability ~5e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_acceptance_rule_keeps_the_target_distribution() -> None:
    """verify_drafts with a likely and an unlikely draft, with temperature and top-k: the first kept token
    follows the target's (filtered) distribution at the first position, and after an accepted draft the
    next token follows the distribution at the next position."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 1.5, -0.5, 0.7, 1.0]])
    params = SamplingParams(temperature=0.8, top_k=4, max_tokens=8)
    targets = [filter_logits(logits[i : i + 1], [_row(params, 0)]).softmax(-1)[0] for i in range(2)]
    draws = 8000
    for draft in (0, 4):
        generator = request_generator(draft)
        first, second = Counter(), Counter()
        for _ in range(draws):
            row = SamplingRow(params, [1], [], (), generator)
            kept = verify_drafts(logits, row, [draft])
            first[kept[0].token] += 1
            if kept[0].token == draft:
                second[kept[1].token] += 1
        for counts, target in ((first, targets[0]), (second, targets[1])):
            total = sum(counts.values())
            support = [t for t in range(5) if target[t] > 0]
            assert set(counts) <= set(support)
            if total < 400:
                continue  # an unlikely draft is rarely accepted: too few second tokens to test
            statistic = sum((counts[t] - total * target[t]) ** 2 / (total * target[t]) for t in support)
            assert statistic < chi_square_critical(len(support) - 1), (draft, counts, target)


def _row(params: SamplingParams, seed: int) -> SamplingRow:
    return SamplingRow(params, [1], [], (), request_generator(seed))


def test_greedy_acceptance_rule_keeps_the_argmax_prefix() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    params = SamplingParams(temperature=0)
    assert [v.token for v in verify_drafts(logits, _row(params, 0), [1, 0])] == [1, 0, 2]
    assert [v.token for v in verify_drafts(logits, _row(params, 0), [1, 2])] == [1, 0]
    assert [v.token for v in verify_drafts(logits, _row(params, 0), [2, 0])] == [1]


@pytest.mark.slow
def test_engine_sampling_distribution_equals_plain_sampling(tmp_path) -> None:
    """A 12-token vocabulary with the model's own (random) MTP layer, which accepts some drafts: over 600
    seeded requests each, the marginal distributions of output tokens 2..4 with k = 2 equal those of plain
    sampling (two-sample chi-square)."""
    directory, _ = save_tiny_checkpoint(tmp_path / "small", "causal", seed=4, vocab_size=12)
    add_random_mtp_weights(directory, tiny_text_config(vocab_size=12), seed=5)
    settings = dict(batch_size=8, sequence_length=128, prefill_chunk_size=16)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    runs = {}
    for k in (0, 2):
        model = export_eager(directory, num_speculative_tokens=k, **settings)
        engine = model.create_engine()
        ids = [
            engine.add_request(
                EngineRequest(prompt, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=s))
            )
            for s in range(600)
        ]
        done = engine.run()
        runs[k] = [done[i].output_ids for i in ids]
        if k:
            stats = engine.stats()["speculative"]
            assert 0.05 < stats["acceptance_rate_per_position"][0] < 0.95, stats
    for position in (1, 2, 3):
        a = Counter(out[position] for out in runs[0])
        b = Counter(out[position] for out in runs[2])
        support = sorted(set(a) | set(b))
        statistic = sum((a[t] - b[t]) ** 2 / (a[t] + b[t]) for t in support)
        assert statistic < chi_square_critical(len(support) - 1), (position, a, b)


def test_settings_are_checked(checkpoint, tiny_checkpoint) -> None:
    without_mtp, _ = tiny_checkpoint()
    with pytest.raises(CheckpointError, match=r"no multi-token-prediction weights \(`mtp\.\*`\)"):
        export_eager(without_mtp, num_speculative_tokens=1)
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in 0\.\.3"):
        export_eager(checkpoint, num_speculative_tokens=4)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=3 needs prefill_chunk_size >= 4 \(got 3\)"):
        export_eager(checkpoint, num_speculative_tokens=3, prefill_chunk_size=3)
    # An FP8 export without MTP weights: the missing layer is named, not its missing scales.
    with pytest.raises(CheckpointError, match=r"no multi-token-prediction weights"):
        export_eager(without_mtp, num_speculative_tokens=1, quantization="fp8")
    # Without speculation the MTP weights are not loaded, and nothing changes.
    assert export_eager(checkpoint).model.mtp is None


@pytest.fixture
def recorded_drafts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], int, tuple[int, ...]]]:
    return recording_drafts(monkeypatch)


@pytest.mark.parametrize("backend", ["eager", pytest.param("cpu", marks=pytest.mark.slow)])
def test_fp8_mtp_layer_drafts_as_its_dequantized_weights(backend, tmp_path, recorded_drafts) -> None:
    """An FP8 checkpoint whose MTP layer is FP8 too (every linear, `fc` included, as Qwen's FP8 releases
    store it): the MTP layer loads as FP8 and proposes exactly the drafts of the same model holding the
    dequantized weights in float32 (an independent per-block dequantization), eagerly and in the cpu
    backend's compiled verify and MTP graphs; speculative decoding keeps plain decoding's tokens and
    log-probabilities."""
    reference_dir = tmp_path / "dequantized"
    directory, _ = write_official_fp8(tmp_path / "fp8", seed=8, block=(16, 16), mtp_reference=reference_dir)
    requests = [(tokens(n, n), dict(max_tokens=24, ignore_eos=True)) for n in (7, 40, 90)]
    compiled = dict(backend="cpu", compile_cache_dir=tmp_path / "cache") if backend == "cpu" else {}
    fp8 = export_eager(directory, num_speculative_tokens=2, **compiled, **SETTINGS)
    linears = {name: type(m) for name, m in fp8.model.mtp.named_modules() if name.endswith(("fc", "proj"))}
    assert set(linears.values()) == {Fp8Linear} and len(linears) == 8
    ours, engine = run_engine(fp8, requests)
    fp8_drafts = list(recorded_drafts)
    recorded_drafts.clear()
    reference, _ = run_engine(export_eager(reference_dir, num_speculative_tokens=2, **SETTINGS), requests)
    assert len(fp8_drafts) > 20 and fp8_drafts == recorded_drafts
    assert [out.output_ids for out in ours] == [out.output_ids for out in reference]
    plain, _ = run_engine(export_eager(directory, **SETTINGS), requests)
    assert_same_outputs(ours, plain)
    assert engine.stats()["speculative"]["drafted_per_position"][0] > 0


def test_an_fp8_mtp_layer_listed_as_unconverted_loads_as_stored(tmp_path) -> None:
    """transformers drops `mtp.*`, so an FP8 release may list the MTP layer in modules_to_not_convert while
    storing it in FP8 with its scales: the stored weights decide (the trunk's contradictions stay errors)."""
    reference = tmp_path / "dequantized"
    directory, _ = write_official_fp8(tmp_path / "fp8", seed=8, block=(16, 16), mtp_reference=reference)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append("mtp")
    (directory / "config.json").write_text(json.dumps(config))
    model = export_eager(directory, num_speculative_tokens=1, **SETTINGS)
    assert isinstance(model.model.mtp.fc, Fp8Linear)


def test_whether_the_mtp_layer_is_fp8_changes_the_compile_key(tmp_path) -> None:
    """Two FP8 checkpoints that differ only in whether their MTP layer is FP8 compile different MTP graphs:
    their compile keys differ (the saved quantization_config lists the MTP linears kept unquantized)."""
    fp8_dir, _ = write_official_fp8(tmp_path / "fp8", seed=8, block=(16, 16), mtp_reference=tmp_path / "ref")
    kept_dir = shutil.copytree(fp8_dir, tmp_path / "kept")
    trunk = {k: v for k, v in load_file(kept_dir / "model.safetensors").items() if not k.startswith("mtp.")}
    save_file({**trunk, **load_file(tmp_path / "ref" / "mtp.safetensors")}, kept_dir / "model.safetensors")
    keys = []
    for directory in (fp8_dir, kept_dir):
        get_settings = NeuronQwen36ForCausalLM.get_neuron_config
        settings = get_settings(directory, backend="cpu", num_speculative_tokens=1)
        _, text_config, quantization = NeuronQwen36ForCausalLM.model_config(str(directory), settings)
        keys.append(compile_key(text_config.to_dict(), settings.to_dict(), "cpu"))
        assert ("mtp.fc" in quantization.modules) == (directory == fp8_dir)
    assert keys[0] != keys[1]


def test_quantized_at_export_mtp_layer_follows_fp8_modules(checkpoint, oracle_drafts) -> None:
    """quantization="fp8" on a bf16 / fp32 checkpoint quantizes the MTP layer's attention and MLP linears as
    `fp8_modules` names them ("linear": both, "mlp": the MLP) and keeps its `fc`; speculative decoding with
    the FP8 layers keeps plain FP8 decoding's tokens and log-probabilities."""
    requests = mixed_requests()[:3]
    for fp8_modules, expected in (("linear", {"q_proj", "k_proj", "v_proj", "o_proj"}), ("mlp", set())):
        quantized = dict(quantization="fp8", fp8_modules=fp8_modules, **SETTINGS)
        model = export_eager(checkpoint, num_speculative_tokens=3, **quantized)
        mtp = model.model.mtp.named_modules()
        fp8 = {name.rpartition(".")[2] for name, module in mtp if isinstance(module, Fp8Linear)}
        assert fp8 == expected | {"gate_proj", "up_proj", "down_proj"}, fp8_modules
        reference, _ = run_engine(export_eager(checkpoint, **quantized), requests)
        for (prompt, _), out in zip(requests, reference, strict=True):
            oracle_drafts[tuple(prompt)] = out.output_ids
        ours, engine = run_engine(model, requests)
        assert_same_outputs(ours, reference)
        assert engine.stats()["speculative"]["accepted_per_position"][2] > 0


def test_metrics_and_generate(checkpoint) -> None:
    """/metrics reports drafts and acceptances per position; generate() says it does not speculate and
    decodes the same tokens as a model without the MTP layer."""
    from optimum_qwen36.server.metrics import ServerMetrics

    model = export_eager(checkpoint, num_speculative_tokens=2, **SETTINGS)
    (request,), engine = run_engine(model, [(tokens(20, 40), dict(max_tokens=12, ignore_eos=True))])
    text = ServerMetrics("tiny").render(engine.stats()).decode()
    drafted = engine.stats()["speculative"]["drafted_per_position"]
    assert (
        f'optimum_qwen36:spec_decode_num_draft_tokens{{model_name="tiny",position="1"}} {float(drafted[1])}'
        in text
    )
    assert 'optimum_qwen36:spec_decode_num_accepted_tokens{model_name="tiny",position="0"}' in text
    prompt = torch.tensor([tokens(20, 40)])
    with pytest.warns(UserWarning, match="MTP speculative decoding .* runs in the engine"):
        ours = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert ours[0, 20:].tolist() == request.output_ids


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 2])
def test_cpu_backend_gives_the_plain_tokens(checkpoint, plain, oracle_drafts, tmp_path, batch_size) -> None:
    """The compiled verify and MTP graphs (cpu: the one-row ones for a batch of one, else the batched ones,
    one row padded to two; a single MTP position is padded), saved and reloaded: greedy tokens and
    log-probabilities of plain decoding."""
    from optimum_qwen36 import NeuronQwen36ForCausalLM

    requests = mixed_requests()[:4]
    reference, _ = run_engine(plain, requests)
    for (prompt, _), out in zip(requests, reference, strict=True):
        oracle_drafts[tuple(prompt)] = out.output_ids
    settings = {**SETTINGS, "batch_size": batch_size}
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend="cpu", dtype="float32", num_speculative_tokens=2,
        prefix_caching=True, compile_cache_dir=tmp_path / "cache", **settings,
    )  # fmt: skip
    ours, engine = run_engine(model, requests)
    assert_same_outputs(ours, reference)
    assert engine.stats()["speculative"]["accepted_per_position"][1] > 0
    model.save_pretrained(tmp_path / "saved")
    reloaded = NeuronQwen36ForCausalLM.from_pretrained(tmp_path / "saved")
    rows = "row" if batch_size == 1 else "step"
    assert {p.name for p in (tmp_path / "saved" / "compiled").glob("*verify_*.pt2")} == {
        f"verify_{rows}.linear_attention.pt2",
        f"verify_{rows}.full_attention.pt2",
        f"verify_{rows}.head.pt2",
    }
    assert {p.name for p in (tmp_path / "saved" / "compiled").glob("mtp_*.pt2")} == {f"mtp_{rows}.mtp.pt2"}
    again, _ = run_engine(reloaded, requests[:2])
    assert_same_outputs(again, reference[:2])


@pytest.mark.slow
def test_cpu_bf16_speculative_graphs_give_the_decisive_models_tokens(oracle_drafts, tmp_path) -> None:
    """The bf16 verify and MTP graphs (cpu, batch 3, one row padded to two) on the trained pattern model,
    whose logits are decisive (bf16 rounding cannot flip a greedy token): each prompt's greedy tokens, in one
    batch and alone, are the pattern's continuation (what transformers gives in fp32), with drafts accepted
    and rejected along the way; and batch invariance, bitwise: a request's log-probabilities alone equal
    those it gets in company."""
    from pattern_model import NEW_TOKENS, pattern_prompts, train_pattern_checkpoint
    from pattern_model import SETTINGS as PATTERN_SETTINGS

    from optimum_qwen36 import NeuronQwen36ForCausalLM

    checkpoint, _ = train_pattern_checkpoint(tmp_path / "ckpt")
    add_random_mtp_weights(checkpoint, tiny_text_config(), seed=3)
    input_ids, mask, expected = pattern_prompts()
    prompts = [ids[row_mask.bool()].tolist() for ids, row_mask in zip(input_ids, mask, strict=True)]
    for prompt, continuation in zip(prompts, expected.tolist(), strict=True):
        oracle_drafts[tuple(prompt)] = continuation
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint,
        export=True,
        backend="cpu",
        num_speculative_tokens=2,
        compile_cache_dir=tmp_path / "cache",
        **PATTERN_SETTINGS,
    )
    assert model.neuron_config.dtype == "bfloat16"
    requests = [(prompt, dict(max_tokens=NEW_TOKENS, ignore_eos=True)) for prompt in prompts]
    together, engine = run_engine(model, requests)
    alone = [run_engine(model, [request])[0][0] for request in requests]
    for outputs in (together, alone):
        assert [output.output_ids for output in outputs] == expected.tolist()
    assert [output.output_logprobs for output in alone] == [output.output_logprobs for output in together]
    accepted = engine.stats()["speculative"]["accepted_per_position"]
    assert accepted[0] > 0 and accepted[1] > 0
