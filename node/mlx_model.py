"""The transformer arithmetic of llama-family layer ranges on MLX, from a GGUF's tensors.

Three architectures share one block here; what differs is data, not code:

* **llama**: llama.cpp's converter permutes the Q and K rows for its "normal" RoPE, which
  rotates *adjacent* pairs, so MLX must use ``traditional=True``. (``traditional=False``
  still gives a last-token cosine of 0.98 against the reference, but wrong text.)
* **qwen2**: NEOX RoPE (rotates the two halves: ``traditional=False``), biases on q, k, v.
* **qwen3**: NEOX RoPE, an RMS norm on each head of q and k before the rotation, and a
  head width of its own (``attention.key_length``).

Every other architecture is refused at load time (:class:`UnsupportedArchitecture`), as are
RoPE scalings this module does not implement: plausible but wrong text is worse than none.

Activations are float32 throughout. float16 would be faster on a GPU, but residual streams
reach tens of thousands (24,831 in SmolLM2, float16 tops out at 65,504) and other models
overflow it; bfloat16 would drift from the llama.cpp peers of a mixed chain.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from inclavate.gguf_meta import ArrayInfo, GgufMetadata
from inclavate.types import LayerRange
from node.errors import EngineLoadError, UnsupportedArchitecture
from node.mlx_weights import GgufTensorReader, Matrix

ROPE_TRADITIONAL = {"llama": True, "qwen2": False, "qwen3": False}
"""The MLX architectures, and whether their GGUF Q/K rows are laid out for adjacent-pair RoPE."""


def mlx_architectures() -> tuple[str, ...]:
    return tuple(sorted(ROPE_TRADITIONAL))


@dataclass(frozen=True)
class HParams:
    arch: str
    n_layers: int
    d_model: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    eps: float
    rope_dims: int
    rope_base: float
    rope_scale: float
    rope_traditional: bool

    @classmethod
    def from_metadata(cls, meta: GgufMetadata) -> HParams:
        arch = meta.arch
        if arch not in ROPE_TRADITIONAL:
            raise UnsupportedArchitecture(
                f"the MLX engine runs {', '.join(mlx_architectures())}, not {arch!r}; "
                "run this model with --engine llamacpp"
            )
        d_model = meta.d_model
        n_head = _scalar(meta, "attention.head_count")
        head_dim = _scalar(meta, "attention.key_length", d_model // n_head)
        embd = meta.tensors.get("token_embd.weight")
        if embd is None:
            raise EngineLoadError("the model has no token_embd tensor")
        scaling = meta.arch_value("rope.scaling.type", "none")
        factor = float(meta.arch_value("rope.scaling.factor", 1.0) or 1.0)
        if scaling not in ("none", "linear"):
            raise UnsupportedArchitecture(
                f"RoPE scaling {scaling!r} is not implemented by the MLX engine; use --engine llamacpp"
            )
        return cls(
            arch=arch,
            n_layers=meta.n_layers,
            d_model=d_model,
            n_head=n_head,
            n_head_kv=_scalar(meta, "attention.head_count_kv", n_head),
            head_dim=head_dim,
            n_vocab=int(embd.dims[1]),
            eps=float(meta.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_dims=_scalar(meta, "rope.dimension_count", head_dim),
            rope_base=float(meta.arch_value("rope.freq_base", 10000.0)),
            rope_scale=1.0 / factor if scaling == "linear" else 1.0,
            rope_traditional=ROPE_TRADITIONAL[arch],
        )


def _scalar(meta: GgufMetadata, key: str, default: int | None = None) -> int:
    value = meta.arch_value(key, default)
    if isinstance(value, ArrayInfo):
        raise UnsupportedArchitecture(
            f"{meta.arch}.{key} differs per layer; the MLX engine needs one value for every layer"
        )
    if value is None:
        raise EngineLoadError(f"the model has no {meta.arch}.{key}")
    return int(value)


@dataclass(frozen=True)
class Segment:
    """One session's rows of the batch: rows ``[row, row + n)`` at positions ``start_pos...``."""

    row: int
    n: int
    start_pos: int


KV = tuple[mx.array, mx.array]
"""One layer's cached keys and values, (1, n_head_kv, capacity, head_dim) each."""


class Block:
    """One transformer block: attention with its own RoPE layout, then a SwiGLU MLP."""

    def __init__(self, hp: HParams, reader: GgufTensorReader, layer: int, rope_freqs: mx.array | None) -> None:
        p = f"blk.{layer}."
        self.hp = hp
        self.rope_freqs = rope_freqs
        self.attn_norm = reader.vector(p + "attn_norm.weight")
        self.wq, self.wk, self.wv = (reader.matrix(p + f"attn_{n}.weight") for n in "qkv")
        self.wo = reader.matrix(p + "attn_output.weight")
        self.bq, self.bk, self.bv = (_optional(reader, p + f"attn_{n}.bias") for n in "qkv")
        self.q_norm = _optional(reader, p + "attn_q_norm.weight")
        self.k_norm = _optional(reader, p + "attn_k_norm.weight")
        if hp.arch == "qwen3" and (self.q_norm is None or self.k_norm is None):
            raise EngineLoadError(f"qwen3 layer {layer} lacks its q/k norms")
        self.ffn_norm = reader.vector(p + "ffn_norm.weight")
        self.w_gate, self.w_up = reader.matrix(p + "ffn_gate.weight"), reader.matrix(p + "ffn_up.weight")
        self.w_down = reader.matrix(p + "ffn_down.weight")

    @property
    def nbytes(self) -> int:
        parts: list[Matrix | mx.array | None] = [
            self.attn_norm, self.wq, self.wk, self.wv, self.wo, self.bq, self.bk, self.bv,
            self.q_norm, self.k_norm, self.ffn_norm, self.w_gate, self.w_up, self.w_down,
        ]  # fmt: skip
        return sum(p.nbytes for p in parts if p is not None)

    def __call__(self, x: mx.array, segments: Sequence[Segment], caches: list[KV]) -> tuple[mx.array, list[KV]]:
        """x: (rows, d_model). ``caches[i]`` belongs to ``segments[i]``; returns the new ones."""
        hp = self.hp
        h = mx.fast.rms_norm(x, self.attn_norm, hp.eps)
        q, k, v = (_linear(w, b, h) for w, b in ((self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv)))
        outs, new_caches = [], []
        for seg, cache in zip(segments, caches):
            rows = slice(seg.row, seg.row + seg.n)
            out, cache = self._attend(q[rows], k[rows], v[rows], seg, cache)
            outs.append(out)
            new_caches.append(cache)
        attn = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        x = x + self.wo(attn)
        h = mx.fast.rms_norm(x, self.ffn_norm, hp.eps)
        return x + self.w_down(_silu(self.w_gate(h)) * self.w_up(h)), new_caches

    def _attend(self, q: mx.array, k: mx.array, v: mx.array, seg: Segment, cache: KV) -> tuple[mx.array, KV]:
        hp = self.hp
        n = seg.n
        q = q.reshape(1, n, hp.n_head, hp.head_dim)
        k = k.reshape(1, n, hp.n_head_kv, hp.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = mx.fast.rms_norm(q, self.q_norm, hp.eps)
            k = mx.fast.rms_norm(k, self.k_norm, hp.eps)
        q, k = (self._rope(t.transpose(0, 2, 1, 3), seg.start_pos) for t in (q, k))
        v = v.reshape(1, n, hp.n_head_kv, hp.head_dim).transpose(0, 2, 1, 3)
        end = seg.start_pos + n
        keys = mx.slice_update(cache[0], k, mx.array([seg.start_pos]), axes=(2,))
        values = mx.slice_update(cache[1], v, mx.array([seg.start_pos]), axes=(2,))
        out = mx.fast.scaled_dot_product_attention(
            q, keys[:, :, :end], values[:, :, :end], scale=1.0 / math.sqrt(hp.head_dim),
            mask="causal" if n > 1 else None,
        )  # fmt: skip
        return out.transpose(0, 2, 1, 3).reshape(n, hp.n_head * hp.head_dim), (keys, values)

    def _rope(self, t: mx.array, offset: int) -> mx.array:
        hp = self.hp
        if self.rope_freqs is not None:
            return mx.fast.rope(
                t, hp.rope_dims, traditional=hp.rope_traditional, base=None, scale=hp.rope_scale,
                offset=offset, freqs=self.rope_freqs,
            )  # fmt: skip
        return mx.fast.rope(
            t, hp.rope_dims, traditional=hp.rope_traditional, base=hp.rope_base, scale=hp.rope_scale, offset=offset
        )


def _silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def _linear(w: Matrix, b: mx.array | None, x: mx.array) -> mx.array:
    y = w(x)
    return y if b is None else y + b


def _optional(reader: GgufTensorReader, name: str) -> mx.array | None:
    return reader.vector(name) if reader.has(name) else None


def rope_frequencies(hp: HParams, reader: GgufTensorReader) -> mx.array | None:
    """Llama 3's per-pair frequency divisors (``rope_freqs``) as MLX's ``freqs`` argument.

    llama.cpp rotates pair i by ``pos * base^(-2i/d) / factor_i``; MLX rotates by
    ``pos / freqs_i``, so ``freqs_i = base^(2i/d) * factor_i``.
    """
    if not reader.has("rope_freqs.weight"):
        return None
    factors = reader.vector("rope_freqs.weight")
    exponents = mx.arange(0, hp.rope_dims, 2, dtype=mx.float32) / hp.rope_dims
    freqs = mx.power(mx.array(hp.rope_base, mx.float32), exponents) * factors
    mx.eval(freqs)
    return freqs


@dataclass
class RangeWeights:
    """Everything one range computes with; globals only where the range needs them."""

    blocks: list[Block]
    embed: Matrix | None
    """token_embd, on the first range."""
    output_norm: mx.array | None
    output: Matrix | None
    """The vocabulary projection (``output``, or ``token_embd`` when tied), on the last range."""

    @classmethod
    def load(cls, hp: HParams, reader: GgufTensorReader, layers: LayerRange) -> RangeWeights:
        freqs = rope_frequencies(hp, reader)
        blocks = [Block(hp, reader, il, freqs) for il in range(layers.start, layers.end)]
        first, last = layers.start == 0, layers.end == hp.n_layers
        embed = reader.matrix("token_embd.weight") if first or (last and not reader.has("output.weight")) else None
        output = None
        if last:
            output = reader.matrix("output.weight") if reader.has("output.weight") else embed
        return cls(
            blocks,
            embed if first else None,
            reader.vector("output_norm.weight") if last else None,
            output,
        )

    @property
    def nbytes(self) -> int:
        total = sum(b.nbytes for b in self.blocks)
        if self.output_norm is not None:
            total += self.output_norm.nbytes
        unique = {id(m): m for m in (self.embed, self.output) if m is not None}
        return total + sum(m.nbytes for m in unique.values())

    def logits(self, hp: HParams, rows: mx.array) -> mx.array:
        assert self.output is not None and self.output_norm is not None
        return self.output(mx.fast.rms_norm(rows, self.output_norm, hp.eps))
