"""Tokenization with the model's own vocabulary, from a weight-less llama.cpp load.

The entry peer of a request tokenizes the prompt and detokenizes what the chain samples.
llama.cpp's ``vocab_only`` load reads just the GGUF metadata, so any peer can do this for any
model from the metadata alone (``node.gguf_slice.write_vocab_only``), whether or not it holds
any of the model's layers.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import llama_cpp

from node import llamacpp_lib
from node.errors import EngineLoadError, UnknownToken


class Tokenizer:
    def __init__(self, path: Path) -> None:
        llamacpp_lib.ensure_initialised()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        params.n_gpu_layers = 0
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise EngineLoadError(f"llama.cpp could not read the vocabulary of {path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self._lock = threading.Lock()  # llama.cpp's tokenizer caches are not thread-safe
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.bos_id = int(llama_cpp.llama_vocab_bos(self._vocab))
        self.eos_id = int(llama_cpp.llama_vocab_eos(self._vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self._piece_cache: dict[tuple[int, bool], bytes] = {}
        self.eog_ids = frozenset(
            t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)
        )

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``. A rendered chat template already holds its special tokens
        as text, so those are parsed (``parse_special``) and BOS is not added again."""
        data = text.encode("utf-8")
        with self._lock:
            capacity = len(data) + 8
            while True:
                buf = (llama_cpp.llama_token * capacity)()
                n = llama_cpp.llama_tokenize(
                    self._vocab, data, len(data), buf, capacity, add_special, parse_special
                )
                if n >= 0:
                    return list(buf[:n])
                capacity = -n

    def max_bytes_per_token(self) -> int | None:
        """The most bytes of text one token can stand for: the vocabulary's longest piece,
        special tokens spelled out (a rendered template holds them as text, parsed back).

        A byte-level BPE or a SentencePiece tokenization covers the text piece by piece (a
        byte the vocabulary lacks becomes byte-fallback tokens, one byte each), so text of N
        bytes is at least N / this many tokens. ``None`` for the other tokenizers, whose
        tokens may cover more than they spell (WordPiece's one ``[UNK]`` for a whole unknown
        word, Unigram's normalisation), so that no bound holds. Walks the vocabulary once:
        0.1 s for SmolLM2's 49,152 tokens."""
        if llama_cpp.llama_vocab_type(self._vocab) not in (llama_cpp.LLAMA_VOCAB_TYPE_SPM, llama_cpp.LLAMA_VOCAB_TYPE_BPE):
            return None
        buf = ctypes.create_string_buffer(256)
        longest = 0
        with self._lock:
            for token in range(self.n_vocab):
                n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
                longest = max(longest, -n if n < 0 else n)  # negative: the size it needs
        return longest

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token (possibly part of a UTF-8 character).

        Control tokens render as nothing unless ``special``: the end-of-turn marker must not
        leak into the reply text.
        """
        key = (token, special)
        piece = self._piece_cache.get(key)
        if piece is None:
            if not 0 <= token < self.n_vocab:
                raise UnknownToken(f"token id {token} is outside the vocabulary of {self.n_vocab}")
            buf = ctypes.create_string_buffer(64)
            with self._lock:
                n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
                if n < 0:
                    buf = ctypes.create_string_buffer(-n)
                    n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
            piece = buf.raw[:n]
            self._piece_cache[key] = piece
        return piece

    def detokenize(self, tokens: list[int], *, special: bool = False) -> str:
        return b"".join(self.token_bytes(t, special=special) for t in tokens).decode("utf-8", "replace")

    def token_text(self, token: int) -> str:
        """A special token's literal text (``<|im_end|>``), as chat templates spell it."""
        return self.token_bytes(token, special=True).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def close(self) -> None:
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> Tokenizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
