"""Tiny random-weight decoders saved as Hugging Face folders, for fast tests.

Each folder holds config.json, *.safetensors (sharded on request), the default
model's converted tokenizer (so prompts tokenize like the real model) and its
ChatML template. transformers' own forward over the same folder is the
reference that the engine's output is compared with.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
TINY_SIZES: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
}


@functools.lru_cache(maxsize=1)
def default_tokenizer_files() -> dict[str, bytes]:
    """The default model's converted tokenizer as files (converted once, then cached)."""
    from stoker.config import default_model_path
    from stoker.models.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.hf.save_pretrained(tmp)
        return {name: (Path(tmp) / name).read_bytes() for name in os.listdir(tmp)}


def make_tiny_hf_model(
    arch: str,
    tmp_path: str | os.PathLike[str],
    *,
    tie: bool = False,
    shards: int = 1,
    seed: int = 0,
) -> Path:
    """Build, randomize and save a tiny model of arch (llama, qwen2, qwen3, mistral); returns its folder.
    The same arguments give the same files: built once per process, then copied (with
    fresh times) into tmp_path, and torch's global generator left as the build leaves it."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(ARCHITECTURES)}")
    name = f"tiny-{arch}{'-tied' if tie else ''}{f'-{shards}shards' if shards > 1 else ''}-s{seed}"
    key = (arch, tie, shards, seed)
    if key not in _BUILT:
        built = _built_root() / name
        _build(arch, built, tie, shards, seed)
        _BUILT[key] = (built, torch.get_rng_state())
    built, rng_state = _BUILT[key]
    folder = Path(tmp_path) / name
    shutil.copytree(built, folder, copy_function=shutil.copy, dirs_exist_ok=True)
    torch.set_rng_state(rng_state)
    return folder


_BUILT: dict[tuple[str, bool, int, int], tuple[Path, torch.Tensor]] = {}
"""(arch, tie, shards, seed) -> the pristine folder and torch's generator state after its build.
A build imports and randomizes a transformers model (~0.5 s); a copy of its ~27 MiB takes milliseconds."""


@functools.cache
def _built_root() -> Path:
    root = tempfile.mkdtemp(prefix="stoker-tiny-models-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return Path(root)


def _build(arch: str, folder: Path, tie: bool, shards: int, seed: int) -> None:
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    for name, data in default_tokenizer_files().items():
        (folder / name).write_bytes(data)
    tokenizer_vocab = 49152  # the default SmolLM2 tokenizer; embeddings must cover every id

    class_name = ARCHITECTURES[arch]
    config_cls = getattr(transformers, class_name.replace("ForCausalLM", "Config"))
    extra: dict[str, object] = {}
    if arch in ("qwen2", "qwen3", "mistral"):
        # Sliding-window attention would make transformers' reference differ from a full-attention engine.
        extra = {"sliding_window": None, "use_sliding_window": False} if arch != "mistral" else {"sliding_window": None}
    config = config_cls(
        vocab_size=tokenizer_vocab,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **TINY_SIZES,
        **extra,
    )
    config.architectures = [class_name]
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config).to(torch.float32).eval()
    _randomize(model, seed)
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    max_shard = total if shards <= 1 else total // shards + 1
    model.save_pretrained(folder, max_shard_size=max_shard, safe_serialization=True)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers zero-inits biases and one-inits norms; random values make every
    parameter matter, so a loader that drops or misplaces one fails the comparison."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                # Larger than the usual 0.02 so logits are well separated and greedy ties are unlikely.
                param.copy_(0.1 * noise)


def set_config(folder: Path, **updates: object) -> None:
    """Edit config.json in place (for tests of rope scaling, eos lists and the like)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(updates)
    path.write_text(json.dumps(config, indent=2))


FIXTURES = Path(__file__).parent / "fixtures"
THINKING_TEMPLATES = {"qwen3": "qwen3_chat_template.jinja", "deepseek_r1": "deepseek_r1_distill_chat_template.jinja"}
"""Real chat templates of thinking families (tests/fixtures/), by the parser that reads them."""


def make_thinking_model(family: str, tmp_path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """A tiny random-weight Qwen3 that thinks as family does: the real chat template
    of that family, and <think> and </think> added to the tokenizer as the two new
    tokens (ids 49152 and 49153, not special, as Qwen3 and the R1 distills hold them)."""
    import transformers

    base = make_tiny_hf_model("qwen3", Path(tmp_path) / "base", seed=seed)
    folder = Path(tmp_path) / f"thinking-{family}-s{seed}"
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = (FIXTURES / THINKING_TEMPLATES[family]).read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # the new rows random like the rest, not transformers' init
        for weights in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            weights[old:] = 0.1 * torch.randn(weights[old:].shape, generator=gen)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
