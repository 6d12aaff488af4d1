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


CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
"""ChatML turn markers of the chat variant (as Qwen's tokenizers)."""
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A ChatML chat template (the format of Qwen's templates, without tools or reasoning markers)."""
PRINTABLE_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"
"""Printable ASCII plus newline: enough for LaTeX math prompts."""


def build_char_tokenizer(out_dir: str | Path, alphabet: str = DEFAULT_ALPHABET, chat_template: str | None = None):
    """Build a character-level HF fast tokenizer over `alphabet`, save it to `out_dir`, return it.

    With `chat_template` the ChatML markers become special tokens, <|im_end|> is the EOS (a turn ends
    the completion, as in Qwen) and the template is saved with the tokenizer.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    if len(chars) != len(alphabet):
        raise ValueError("tokenizer alphabet has repeated characters")
    specials = SPECIAL_TOKENS + (CHAT_TOKENS if chat_template else [])
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    # Every character is its own pre-token, so WordLevel becomes a character vocabulary ('.' skips newlines).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]" if "\n" in alphabet else "."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN,
        eos_token=CHAT_TOKENS[1] if chat_template else EOS_TOKEN, clean_up_tokenization_spaces=False,
    )
    if chat_template:
        fast.chat_template = chat_template
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
