"""`stoker generate` / `stoker chat`: offline generation without a server."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from stoker.config import QuantizationName


def add_parser(subparsers: Any) -> None:
    for name, help_text in (
        ("generate", "complete a prompt offline with the engine (no server)"),
        ("chat", "answer one user message offline with the model's chat template"),
    ):
        p = subparsers.add_parser(name, help=help_text, description=help_text)
        p.add_argument("prompt", help="the prompt text (or the user message for chat)")
        p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder; default SmolLM2-135M-Instruct")
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        p.add_argument(
            "--quantization",
            default="auto",
            choices=get_args(QuantizationName),
            help="weight format (docs/quantization.md); default auto: a GGUF keeps its own",
        )
        p.add_argument("--max-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--seed", type=int, default=None)
        p.set_defaults(func=_run, chat=name == "chat")


def _run(args: argparse.Namespace) -> int:
    from stoker.engine.llm import LLM
    from stoker.engine.params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
    except ValueError as exc:
        raise SystemExit(f"stoker: {exc}") from None
    try:
        llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, num_kv_blocks=256)
    except ValueError as exc:
        raise SystemExit(f"stoker: {exc}") from None
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.outputs[0].text)
    return 0
