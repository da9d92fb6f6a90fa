"""Tiny random-weight cross-encoders (BERT and XLM-RoBERTa sequence classifiers)
saved as Hugging Face folders, with tokenizers made offline: BERT reuses the
bundled MiniLM's WordPiece tokenizer, XLM-R gets a small BPE trained here with
RoBERTa's pair template (<s> A </s></s> B </s>). transformers' own forward over
the same folder is the reference the reranker's scores are compared with."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

SIZES: dict[str, int] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}
CORPUS = [
    "What is the capital of France? Paris is the capital and largest city of France.",
    "Berlin is the capital of Germany; the quick brown fox jumps over the lazy dog.",
    "Rerankers score a query against each document and sort the documents by relevance.",
]


def make_tiny_cross_encoder(arch: str, folder: Path, seed: int = 0, **sizes: int) -> Path:
    """A tiny arch ("bert" or "xlm-roberta") sequence classifier with one label, in folder."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    if arch == "bert":
        from stoker.models.embedding import bundled_model_path

        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
            shutil.copy(os.path.join(bundled_model_path(), name), folder / name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        config: transformers.PretrainedConfig = transformers.BertConfig(
            vocab_size=tokenizer.vocab_size, num_labels=1, **{**SIZES, **sizes}
        )
        model: torch.nn.Module = transformers.BertForSequenceClassification(config)
    elif arch == "xlm-roberta":
        tokenizer = _bpe_tokenizer()
        tokenizer.save_pretrained(folder)
        config = transformers.XLMRobertaConfig(
            vocab_size=len(tokenizer),
            num_labels=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            type_vocab_size=1,
            **{**SIZES, **sizes, "max_position_embeddings": SIZES["max_position_embeddings"] + 2},
        )
        model = transformers.XLMRobertaForSequenceClassification(config)
    else:
        raise ValueError(arch)
    config.architectures = [type(model).__name__]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # wide enough that scores spread over (0, 1) and orders differ
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        # The first token's vector differs little between pairs of a random model: the head is
        # scaled and centred on the corpus's pairs so that scores spread over (0, 1) and their
        # order is a real check.
        head = model.classifier.out_proj if arch == "xlm-roberta" else model.classifier
        words = " ".join(CORPUS).split()
        pairs = tokenizer(words[:-1], words[1:], return_tensors="pt", padding=True)
        logits = model.eval()(**pairs).logits[:, 0]
        gain = 2.0 / logits.std()
        head.bias.copy_(-gain * (logits.mean() - head.bias))
        head.weight.mul_(gain)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _bpe_tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    backend.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        cls_token="<s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=SIZES["max_position_embeddings"],
    )


def reference_scores(
    folder: Path, query: str, documents: list[str], **tokenize: object
) -> tuple[list[float], list[int]]:
    """transformers' relevance scores (sigmoid of the one logit) and each pair's token count."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    encoded = tokenizer([query] * len(documents), documents, padding=True, return_tensors="pt", **tokenize)
    with torch.no_grad():
        logits = model(**encoded).logits
    return torch.sigmoid(logits[:, 0]).tolist(), encoded["attention_mask"].sum(1).tolist()
