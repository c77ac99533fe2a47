"""Export a Qwen3.6-architecture model and generate from a real chat prompt.

With no arguments, builds a small random checkpoint of the Qwen3.6 architecture (4 layers in the real
3 x Gated DeltaNet + 1 gated attention pattern, the real 248,320-token vocabulary and tokenizer), exports it
(compiled for this machine's default backend: cpu without a GPU; the compile cache makes later runs fast)
and generates. The text is gibberish (random weights); the point is the whole path from checkpoint to tokens.
With --model PATH_OR_HUB_ID, a real Qwen3.5/3.6 checkpoint is used instead.

    python examples/generate.py
    python examples/generate.py --model Qwen/Qwen3.6-27B --dtype bfloat16 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.tokenizer import load_qwen36_tokenizer


def build_random_checkpoint(directory: Path) -> Path:
    """A small random model with Qwen3.6's layout: layer pattern, gated attention, GDN heads, vocab."""
    config = Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        eos_token_id=[248046, 248044],  # <|im_end|>, <|endoftext|>
        pad_token_id=248044,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint directory or Hub id (default: a small random model)")
    parser.add_argument("--backend", help="cpu, cuda, neuron or eager (default: cuda with a GPU, else cpu)")
    parser.add_argument(
        "--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)"
    )
    parser.add_argument("--sequence-length", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--prompt", default="Explain in one paragraph why hybrid linear-attention models are fast."
    )
    parser.add_argument("--no-thinking", action="store_true", help="render the chat prompt with thinking off")
    parser.add_argument("--save-dir", help="also save the exported model there")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="optimum-qwen36-"))
    model_id = args.model or build_random_checkpoint(workdir / "random-qwen36")
    start = time.perf_counter()
    model = NeuronQwen36ForCausalLM.from_pretrained(
        model_id, export=True, backend=args.backend, dtype=args.dtype, sequence_length=args.sequence_length
    )
    print(
        f"exported {model_id} ({model.neuron_config.backend}, {model.neuron_config.dtype}) "
        f"in {time.perf_counter() - start:.1f} s"
    )
    if args.save_dir:
        model.save_pretrained(args.save_dir)
        print(f"saved to {args.save_dir}")

    tokenizer = load_qwen36_tokenizer(model.tokenizer_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=not args.no_thinking,
    )
    inputs = tokenizer(prompt, return_tensors="pt")
    start = time.perf_counter()
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    elapsed = time.perf_counter() - start
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    print(f"prompt ({inputs['input_ids'].shape[1]} tokens):\n{prompt}")
    print(f"completion ({len(new_tokens)} tokens):\n{tokenizer.decode(new_tokens)}")
    print(f"{len(new_tokens) / elapsed:.1f} tokens/s (prefill + decode, batch 1)")


if __name__ == "__main__":
    main()
