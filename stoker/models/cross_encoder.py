"""Rerankers: BERT and XLM-RoBERTa sequence classifiers scoring a (query,
document) pair, as sentence-transformers' CrossEncoder and vLLM score them:
encoder over the pair -> classification head on the first token -> one logit
-> sigmoid. Plus a micro-batcher so concurrent requests share forward passes.

Like the embedding model (stoker/models/embedding.py, whose encoder layers
this reuses) it runs on numpy in the front end: small, and never on the chat
engine's step loop. Only one-label heads load: a multi-label classifier has no
single relevance score, and picking one of its labels would be a guess.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from typing import Literal

import numpy as np
from threadpoolctl import threadpool_limits

from stoker.models.embedding import Array, EncoderWeights
from stoker.models.micro_batch import MicroBatcher
from stoker.models.tokenizer import backend_from_file

ModelKind = Literal["generate", "rerank"]

# Architecture -> the weights' prefix (the encoder's name inside the classifier).
ARCHITECTURES: dict[str, str] = {
    "BertForSequenceClassification": "bert",
    "XLMRobertaForSequenceClassification": "roberta",
    "RobertaForSequenceClassification": "roberta",
}


def model_kind(path: str) -> ModelKind:
    """What a model path serves, from its config.json's architectures: a
    sequence classifier reranks; anything else (a GGUF file, a causal LM
    folder) generates. Blocking (reads one small file)."""
    config = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.isfile(config):
        return "generate"
    try:
        with open(config) as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return "generate"  # the engine's loader says what is wrong with it
    return "rerank" if any(str(a).endswith("ForSequenceClassification") for a in architectures) else "generate"


@dataclass(frozen=True)
class PairTokens:
    """One (query, document) pair as the model reads it."""

    ids: list[int]
    type_ids: list[int]


class PairTooLongError(ValueError):
    """A pair over the model's length that was not to be truncated (or cannot be: its query alone fills it)."""


class CrossEncoder:
    """A sequence-classification encoder over a Hugging Face folder (config.json,
    model.safetensors, tokenizer.json)."""

    def __init__(self, path: str, name: str) -> None:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        architecture = next((a for a in raw.get("architectures") or [] if a in ARCHITECTURES), None)
        if architecture is None:
            raise ValueError(
                f"{path}: rerankers must be one of {', '.join(ARCHITECTURES)} (architectures: {raw.get('architectures')})"
            )
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: hidden_act {raw.get('hidden_act')!r} is not supported (gelu only)")
        labels = len(raw.get("id2label") or {}) or int(raw.get("num_labels", 1))
        if labels != 1:
            raise ValueError(f"{path}: the classifier has {labels} labels; a reranker needs one relevance logit")
        self.name = name
        self.architecture = architecture
        self.roberta = ARCHITECTURES[architecture] == "roberta"
        self.vocab_size = int(raw["vocab_size"])
        self.hidden_size = int(raw["hidden_size"])
        self.intermediate_size = int(raw["intermediate_size"])
        self.num_layers = int(raw["num_hidden_layers"])
        self.num_heads = int(raw["num_attention_heads"])
        self.max_position_embeddings = int(raw["max_position_embeddings"])
        self.layer_norm_eps = float(raw["layer_norm_eps"])
        # RoBERTa numbers positions from padding_idx + 1: its table's first rows are never used.
        self.position_offset = int(raw.get("pad_token_id", 1)) + 1 if self.roberta else 0
        self.max_tokens = self.max_position_embeddings - self.position_offset
        self.max_tokens = min(self.max_tokens, _tokenizer_limit(path) or self.max_tokens)
        self.tokenizer = backend_from_file(os.path.join(path, "tokenizer.json"))
        self.special_tokens = self.tokenizer.num_special_tokens_to_add(is_pair=True)
        self._load_weights(os.path.join(path, "model.safetensors"), ARCHITECTURES[architecture])
        # As the embedding model: the engine processes own the cores, the front end's BLAS
        # stays on one thread (a process-wide setting).
        threadpool_limits(limits=1, user_api="blas")

    def _load_weights(self, file: str, prefix: str) -> None:
        weights = EncoderWeights(file, f"a {self.architecture}", self.layer_norm_eps, optional_prefix=f"{prefix}.")
        e = f"{prefix}.embeddings"
        self.word_embeddings = weights.tensor(f"{e}.word_embeddings.weight")
        self.position_embeddings = weights.tensor(f"{e}.position_embeddings.weight")
        self.token_type_embeddings = weights.tensor(f"{e}.token_type_embeddings.weight")
        self.embeddings_norm = weights.norm(f"{e}.LayerNorm")
        self.layers = weights.encoder_layers(f"{prefix}.encoder", self.num_layers)
        # Both heads are dense -> tanh on the first token, then one logit: BERT's
        # pooler and classifier, RoBERTa's classifier.dense and out_proj.
        if self.roberta:
            self.head_dense, self.head_out = weights.linear("classifier.dense"), weights.linear("classifier.out_proj")
        else:
            self.head_dense, self.head_out = weights.linear(f"{prefix}.pooler.dense"), weights.linear("classifier")

    def parameter_bytes(self) -> int:
        arrays = [self.word_embeddings, self.position_embeddings, self.token_type_embeddings]
        for layer in self.layers:
            arrays += [layer.qkv.weight_t, layer.intermediate.weight_t, layer.output.weight_t]
            arrays += [layer.attention_out.weight_t]
        return sum(a.nbytes for a in arrays)

    def pair(self, query: str, document: str, truncate: bool) -> PairTokens:
        """The pair's tokens with the model's special tokens. Over max_tokens:
        the document is cut from its end when truncate (transformers'
        truncation="only_second"), else PairTooLongError."""
        first = self.tokenizer.encode(query, add_special_tokens=False)
        second = self.tokenizer.encode(document, add_special_tokens=False)
        room = self.max_tokens - self.special_tokens - len(first.ids)
        if len(second.ids) > room:
            total = len(first.ids) + len(second.ids) + self.special_tokens
            if not truncate or room < 1:
                why = "" if truncate else " (send truncate: true to cut the document to fit)"
                if room < 1:
                    why = ": the query alone fills it"
                raise PairTooLongError(f"{total} tokens; {self.name} reads at most {self.max_tokens}{why}")
            second.truncate(room)
        encoding = self.tokenizer.post_process(first, second, add_special_tokens=True)
        ids = list(encoding.ids)
        # A one-row type table (XLM-R) reads every token as type 0, whatever the tokenizer says.
        types = list(encoding.type_ids) if len(self.token_type_embeddings) > 1 else [0] * len(ids)
        return PairTokens(ids, types)

    def forward(self, batch: list[PairTokens]) -> Array:
        """One relevance score in (0, 1) per pair: sigmoid of the head's logit.
        Packed, not padded, as the embedding model is: a score does not depend
        on what else is in the batch."""
        lengths = [len(p.ids) for p in batch]
        starts = [0, *itertools.accumulate(lengths)]
        ids = np.fromiter(itertools.chain.from_iterable(p.ids for p in batch), dtype=np.int64, count=starts[-1])
        types = np.fromiter(itertools.chain.from_iterable(p.type_ids for p in batch), dtype=np.int64, count=starts[-1])
        positions = np.concatenate([np.arange(n) for n in lengths]) + self.position_offset
        x = self.word_embeddings[ids] + self.position_embeddings[positions] + self.token_type_embeddings[types]
        x = self.embeddings_norm(x)
        for layer in self.layers:
            x = layer(x, starts, self.num_heads)
        first_tokens = x[starts[:-1]]
        logits = self.head_out(np.tanh(self.head_dense(first_tokens)))[:, 0]
        scores: Array = (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(np.float32)
        return scores


def _tokenizer_limit(path: str) -> int | None:
    """tokenizer_config.json's model_max_length, where it is a real limit (not transformers' 1e30 for none)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            value = json.load(f).get("model_max_length")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int | float) and 0 < value < 1_000_000 else None


class PairBatcher(MicroBatcher[PairTokens, float]):
    """Pairs from concurrent requests, scored together."""

    def __init__(self, model: CrossEncoder, max_batch: int = 32) -> None:
        super().__init__(model.name, lambda pairs: model.forward(pairs).tolist(), max_batch)
        self.model = model

    async def score(self, pairs: list[PairTokens]) -> list[float]:
        return await self.run(pairs)
