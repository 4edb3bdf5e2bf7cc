"""A float64 NumPy forward pass of a llama / qwen2 / qwen3 GGUF: the MLX engine's yardstick.

Written apart from the engine on purpose: it reads tensors through ``gguf.GGUFReader``, and
dequantizes every type with ``gguf``'s dequantizers, computes attention with an explicit
mask and RoPE from its definition (llama: adjacent pairs, as llama.cpp's converter permutes
llama's Q/K; qwen: the two halves), all in float64, one sequence, no cache.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize

ADJACENT_PAIR_ROPE = {"llama": True, "qwen2": False, "qwen3": False}


class NumpyModel:
    def __init__(self, path: Path) -> None:
        reader = gguf.GGUFReader(path)
        self.arch = arch = str(reader.get_field("general.architecture").contents())

        def value(key: str, default: float | None = None) -> float:
            field = reader.get_field(f"{arch}.{key}")
            return default if field is None else field.contents()

        self.n_layers = int(value("block_count"))
        self.n_head = int(value("attention.head_count"))
        self.n_head_kv = int(value("attention.head_count_kv", self.n_head))
        d_model = int(value("embedding_length"))
        self.head_dim = int(value("attention.key_length", d_model // self.n_head))
        self.eps = float(value("attention.layer_norm_rms_epsilon"))
        self.base = float(value("rope.freq_base", 10000.0))
        self.t = {t.name: _float64(t) for t in reader.tensors}

    def hidden(self, tokens: list[int], layers: range | None = None, x: np.ndarray | None = None) -> np.ndarray:
        """The residual stream after ``layers`` (all by default), from tokens or ``x``."""
        layers = layers if layers is not None else range(self.n_layers)
        if x is None:
            x = self.t["token_embd.weight"][np.asarray(tokens)]
        for il in layers:
            x = self._block(x, il)
        return x

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Next-token logits after the last of ``tokens``."""
        x = self.hidden(tokens)[-1]
        head = self.t.get("output.weight", self.t["token_embd.weight"])
        return head @ _rms(x, self.t["output_norm.weight"], self.eps)

    def _block(self, x: np.ndarray, il: int) -> np.ndarray:
        w = {k[len(f"blk.{il}.") :]: v for k, v in self.t.items() if k.startswith(f"blk.{il}.")}
        n, hd = x.shape[0], self.head_dim
        h = _rms(x, w["attn_norm.weight"], self.eps)
        q, k, v = (h @ w[f"attn_{p}.weight"].T + w.get(f"attn_{p}.bias", 0.0) for p in "qkv")
        q, k, v = q.reshape(n, self.n_head, hd), k.reshape(n, self.n_head_kv, hd), v.reshape(n, self.n_head_kv, hd)
        if "attn_q_norm.weight" in w:
            q, k = _rms(q, w["attn_q_norm.weight"], self.eps), _rms(k, w["attn_k_norm.weight"], self.eps)
        q, k = self._rope(q), self._rope(k)
        group = self.n_head // self.n_head_kv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
        x = x + attn @ w["attn_output.weight"].T
        h = _rms(x, w["ffn_norm.weight"], self.eps)
        gate = h @ w["ffn_gate.weight"].T
        return x + (gate / (1 + np.exp(-gate)) * (h @ w["ffn_up.weight"].T)) @ w["ffn_down.weight"].T

    def _rope(self, x: np.ndarray) -> np.ndarray:
        n, _, hd = x.shape
        angles = np.arange(n)[:, None] * self.base ** (-np.arange(0, hd, 2) / hd)[None, :]
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        if ADJACENT_PAIR_ROPE[self.arch]:
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return out
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _rms(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def _float64(t: gguf.ReaderTensor) -> np.ndarray:
    shape = tuple(int(d) for d in reversed(t.shape))  # ggml ne[] order -> numpy order
    values = dequantize(np.asarray(t.data), t.tensor_type)
    return np.asarray(values, dtype=np.float64).reshape(shape)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
