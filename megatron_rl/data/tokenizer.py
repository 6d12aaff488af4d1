"""Character-level tokenizer for the synthetic tasks, built offline with `tokenizers`.

The result is saved as a normal Hugging Face tokenizer directory (tokenizer.json +
tokenizer_config.json), so every consumer loads it with `AutoTokenizer.from_pretrained(dir)`
exactly as it would a real model's tokenizer; nothing is downloaded.
"""
from __future__ import annotations

from pathlib import Path

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
DEFAULT_ALPHABET = "0123456789+-*=() ,.?:abcdefghijklmnopqrstuvwxyz"


def build_char_tokenizer(out_dir: str | Path, alphabet: str = DEFAULT_ALPHABET):
    """Build a character-level HF fast tokenizer over `alphabet`, save it to `out_dir`, return it."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    if len(chars) != len(alphabet):
        raise ValueError("tokenizer alphabet has repeated characters")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    # Every character is its own pre-token, so WordLevel becomes a character vocabulary.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(path: str | Path):
    """Load a saved tokenizer directory (local files only)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {path} (build one with `megatron-rl data`)")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def check_encodable(tokenizer, rows, batch_size: int = 4096) -> None:
    """Encode every row's prompt and answer once, as rollouts and the warm start will; DataFormatError naming file:line otherwise.

    A row fails when its text cannot be encoded (a vocabulary without an unknown token, such as the
    character tokenizer, raises on an unseen character), encodes to the unknown token, or its
    prompt encodes to no tokens. Rows are encoded in batches; a failing batch is re-checked row by
    row to name the first bad row and its characters.
    """
    from megatron_rl.data.jsonl import DataFormatError

    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        texts = [r.prompt for r in chunk] + [str(r.answer) for r in chunk]
        try:
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        except Exception:  # tokenizers raises a bare Exception on out-of-vocabulary text; located row by row below
            ids = None
        if ids is not None and all(ids[:len(chunk)]) and not any(_has_unk(tokenizer, x) for x in ids):
            continue
        for row in chunk:
            for name, text in (("prompt", row.prompt), ("answer", str(row.answer))):
                problem = _encoding_problem(tokenizer, text, require_tokens=name == "prompt")
                if problem:
                    raise DataFormatError(f"{row.source or 'generated row'}: {name} {problem}")


def _has_unk(tokenizer, ids) -> bool:
    unk = getattr(tokenizer, "unk_token_id", None)
    return unk is not None and unk in ids


def _encoding_problem(tokenizer, text: str, require_tokens: bool) -> str:
    """Why `text` cannot be used with `tokenizer` ('' when it can)."""
    def encodes(s: str) -> bool:
        try:
            ids = tokenizer(s, add_special_tokens=False)["input_ids"]
        except Exception:  # see check_encodable
            return False
        return not _has_unk(tokenizer, ids) and (bool(ids) or not s)

    if encodes(text):
        return "" if (not require_tokens or tokenizer(text, add_special_tokens=False)["input_ids"]) else "encodes to no tokens"
    bad = sorted({c for c in text if not encodes(c)})
    shown = ", ".join(repr(c) for c in bad[:10]) if bad else repr(text[:40])
    return f"has characters outside the tokenizer's vocabulary: {shown} (data.tokenizer_dir)"
