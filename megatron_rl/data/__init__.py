"""Prompt datasets (JSONL), synthetic verifiable tasks and the character tokenizer."""
