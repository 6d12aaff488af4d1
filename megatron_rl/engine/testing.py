"""Test helpers for the engine and rollout tests: a tiny random Qwen3 saved to disk, a tiny word-level tokenizer, and an
embedded server running in a background thread (real HTTP on 127.0.0.1, no subprocess start-up cost).
"""
from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from typing import Optional

import torch

TINY_VOCAB = 40
TINY_EOS = 1


def tiny_qwen3_config(vocab_size: int = TINY_VOCAB, initializer_range: float = 0.3, **overrides):
    """A 2-layer, hidden-64 Qwen3Config (EOS 1, BOS 0, pad 2); a large init range gives peaked, non-uniform logits."""
    from transformers import Qwen3Config

    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  eos_token_id=TINY_EOS, bos_token_id=0, pad_token_id=2, tie_word_embeddings=True,
                  initializer_range=initializer_range)
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def make_tiny_model(path: str, seed: int = 0, **config_overrides) -> torch.nn.Module:
    """Build a random tiny Qwen3 with `seed`, save it with save_pretrained into `path`, return it (eval, fp32)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config(**config_overrides)).eval()
    model.save_pretrained(path)
    return model


def make_tiny_tokenizer(path: str, vocab_size: int = TINY_VOCAB):
    """A word-level tokenizer ('<bos>' 0, '<eos>' 1, '<pad>' 2, then 'w3'..) saved into `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "<eos>": 1, "<pad>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(path)
    return fast


class ThreadedServer:
    """A `RolloutServer` served from a background thread on 127.0.0.1 (context manager)."""

    def __init__(self, model_path: str, tokenizer_path: Optional[str] = None, startup_timeout_s: float = 60.0, **kwargs):
        """Arguments are passed to RolloutServer; the port is chosen by the OS."""
        from megatron_rl.engine.server import RolloutServer

        self.server = RolloutServer(model_path, tokenizer_path, **kwargs)
        self.startup_timeout_s = startup_timeout_s
        self.url = ""
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stop: Optional[asyncio.Event] = None
        self._error: Optional[BaseException] = None

    def _run(self, ready: threading.Event) -> None:
        from aiohttp import web

        async def serve() -> None:
            from megatron_rl.engine.http import SERVER_LOG

            runner = web.AppRunner(self.server.make_app(), access_log=None,
                                   keepalive_timeout=self.server.read_timeout_s, logger=SERVER_LOG)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            self._stop = asyncio.Event()
            ready.set()
            try:
                await self._stop.wait()
            finally:
                await runner.cleanup()

        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(serve())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            ready.set()
        finally:
            self._loop.close()

    def start(self) -> "ThreadedServer":
        """Start serving and wait until /health answers 200."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(self.startup_timeout_s)
        if self._error is not None:
            raise RuntimeError(f"server thread failed: {self._error!r}")
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.server.load_error:
                raise RuntimeError(self.server.load_error)
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2.0) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server at {self.url} not healthy after {self.startup_timeout_s} s")

    def stop(self) -> None:
        """Stop serving and join the thread."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> "ThreadedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """[len(completion), V] log_softmax of a plain full-sequence forward at the positions predicting `completion`."""
    full = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=full).logits.float()[0]
    p = len(prompt)
    return torch.log_softmax(logits[p - 1: p - 1 + len(completion)], dim=-1)


SLOW_FORWARD_S = 0.05
"""Delay of each forward call of `load_slow_model` (tests kill an engine mid-generation deterministically)."""


def load_slow_model(path: str) -> torch.nn.Module:
    """Model loader (`--model-loader megatron_rl.engine.testing:load_slow_model`): the default HF model, each forward delayed by SLOW_FORWARD_S."""
    from megatron_rl.engine.generation import load_hf_model

    model = load_hf_model(path)

    def delay(module, args, kwargs):
        time.sleep(SLOW_FORWARD_S)

    model.register_forward_pre_hook(delay, with_kwargs=True)
    return model
