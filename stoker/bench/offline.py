"""`stoker bench offline` / `python -m stoker.bench.offline`: stoker's engine
without HTTP against Hugging Face transformers `generate` on the same prompts
(input lengths spread over 100–1000 tokens, 128 output tokens, ignore_eos,
greedy), in the same process and dtype, with the ratio at each side's best
batch size. `--profile` shows where a stoker step spends its time."""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from typing import TYPE_CHECKING, Any, Protocol, cast, get_args

if TYPE_CHECKING:
    import torch

from stoker.bench.workload import parse_int_list
from stoker.config import KVCacheDTypeName, QuantizationName


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF folder; default: stoker's default model")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", default="100:1000", help="A:B: prompt lengths evenly spread over [A, B] tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (ignore_eos)")
    p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument(
        "--hf-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="transformers' dtype for every --dtype (default: the same dtype); e.g. stoker's quantized"
        " float32 path against transformers' faster bfloat16",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=get_args(QuantizationName),
        help="stoker's weight format (docs/quantization.md)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(get_args(KVCacheDTypeName)),
        help="stoker's KV cache format (docs/quantization.md#kv-cache-quantization)",
    )
    p.add_argument("--batch-sizes", default="1,8,16,32", help="transformers static batch sizes")
    p.add_argument("--stoker-batch-sizes", default=None, help="stoker max_num_seqs values (default: --batch-sizes)")
    p.add_argument("--skip-hf", action="store_true", help="only stoker")
    p.add_argument("--skip-stoker", action="store_true", help="only the transformers baseline")
    p.add_argument("--profile", action="store_true", help="profile a few stoker steps (torch.profiler, cProfile)")
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, metavar="DIR", help="write offline.json and offline.md here")


def prompt_lengths(spec: str, n: int, seed: int) -> list[int]:
    """Evenly spread, then shuffled: every run sees the same lengths, and batch
    order does not follow length (transformers' batches are sorted separately)."""
    lo, hi = (int(x) for x in spec.split(":")) if ":" in spec else (int(spec), int(spec))
    lens = [round(lo + (hi - lo) * i / max(1, n - 1)) for i in range(n)]
    random.Random(seed).shuffle(lens)
    return lens


class HFGenerator(Protocol):
    """The one call run_hf makes on a transformers causal LM (whose own annotations mypy cannot follow)."""

    def generate(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        min_new_tokens: int,
        do_sample: bool,
        pad_token_id: int,
    ) -> torch.Tensor: ...


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_hf(model_path: str, dtype: str) -> HFGenerator:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    if model_path.endswith(".gguf"):
        kwargs["gguf_file"] = os.path.basename(model_path)
        try:  # newer transformers keep GGUF blocks packed; the baseline is the dense model stoker runs too
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:  # older transformers always dequantize
            pass
    folder = os.path.dirname(model_path) if model_path.endswith(".gguf") else model_path
    model: torch.nn.Module
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=_torch_dtype(dtype), **kwargs)
    except TypeError:  # transformers < 4.56 calls it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=_torch_dtype(dtype), **kwargs)
    model.train(False)  # eval mode; transformers leaves its override of eval() unannotated
    return cast("HFGenerator", model)


def run_hf(model: HFGenerator, prompts: list[list[int]], batch_size: int, out_len: int, pad_id: int) -> dict[str, Any]:
    """Static batches of similar lengths (sorted: the baseline's best case), left padded."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]

    def generate(batch: list[list[int]], n: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad_id,
            )
        new_tokens: list[list[int]] = out[:, width:].tolist()
        return new_tokens

    generate([prompts[order[0]][:16]], 2)  # first call pays for lazy init
    t = time.perf_counter()
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        for i, toks in zip(idx, generate([prompts[i] for i in idx], out_len)):
            outputs[i] = toks
    return _figures("transformers", batch_size, time.perf_counter() - t, prompts, outputs)


def stoker_available() -> str | None:
    """None if the engine can run, else why not (the engine is being written)."""
    try:
        from stoker.engine.llm import LLM  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def run_stoker(
    model_path: str | None,
    dtype: str,
    max_num_seqs: int,
    prompts: list[list[int]],
    out_len: int,
    quantization: str = "auto",
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    from stoker import LLM, SamplingParams

    llm = LLM(
        model=model_path,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )
    params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0)
    # Warm up on reversed tokens so the measured prompts find nothing in the prefix cache.
    llm.generate([prompts[0][::-1][:32]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    outputs = [o.outputs[0].token_ids for o in outs]
    del llm
    gc.collect()
    return _figures("stoker", max_num_seqs, elapsed, prompts, outputs)


def _figures(
    engine: str, batch: int, elapsed: float, prompts: list[list[int]], outputs: list[list[int]]
) -> dict[str, Any]:
    n_in, n_out = sum(map(len, prompts)), sum(map(len, outputs))
    return {
        "engine": engine,
        "batch_size": batch,
        "time_s": elapsed,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "output_tok_s": n_out / elapsed,
        "total_tok_s": (n_in + n_out) / elapsed,
        "outputs": outputs,
    }


def profile_stoker(
    model_path: str | None,
    dtype: str,
    max_num_seqs: int,
    prompts: list[list[int]],
    out_len: int,
    steps: int,
    quantization: str = "auto",
) -> str:
    """Where a step's time goes: torch ops (torch.profiler) for `steps` steps in
    the middle of the workload, then Python functions (cProfile) for as many more."""
    import cProfile
    import io
    import pstats

    import torch

    from stoker import LLM, SamplingParams
    from stoker.engine.params import EngineCoreRequest

    llm = LLM(model=model_path, dtype=dtype, max_num_seqs=max_num_seqs, quantization=quantization)
    core = llm.engine
    params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"profile-{i}", p, params, time.time()))
    # Profile the steady state: once every prompt is admitted and mostly decoding.
    for _ in range(500):
        core.step()
        if core.stats().num_waiting == 0 and core.stats().num_waiting_tokens == 0:
            break
    core.step()
    report = io.StringIO()
    walls = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t = time.perf_counter()
            core.step()
            walls.append(time.perf_counter() - t)
    stats = core.stats()
    report.write(
        f"{steps} steps, mean {1000 * sum(walls) / len(walls):.1f} ms/step; running {stats.num_running}, "
        f"waiting {stats.num_waiting}, last step {stats.last_step_tokens} tokens\n\n"
    )
    report.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    cp = cProfile.Profile()
    cp.enable()
    for _ in range(steps):
        core.step()
    cp.disable()
    report.write("\n")
    pstats.Stats(cp, stream=report).sort_stats("tottime").print_stats(20)
    core.abort_requests([f"profile-{i}" for i in range(len(prompts))])
    return report.getvalue()


def best(rows: list[dict[str, Any]], engine: str, dtype: str) -> dict[str, Any] | None:
    rows = [r for r in rows if r["engine"] == engine and r["dtype"] == dtype]
    return max(rows, key=lambda r: r["output_tok_s"]) if rows else None


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from rich.console import Console
    from rich.table import Table

    from stoker.bench.workload import load_tokenizer
    from stoker.config import default_model_path

    console = Console()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_path = args.model or default_model_path()
    tok = load_tokenizer(model_path)
    from stoker.bench.workload import synthetic_token_ids

    prompts = synthetic_token_ids(tok, prompt_lengths(args.input_len, args.num_prompts, args.seed), args.seed)
    console.print(
        f"{len(prompts)} prompts of {min(map(len, prompts))}–{max(map(len, prompts))} tokens, "
        f"{args.output_len} output tokens each; torch threads {torch.get_num_threads()}"
    )
    why_not = None if args.skip_stoker else stoker_available()
    if why_not:
        console.print(f"[yellow]stoker engine unavailable, running the baseline only ({why_not})")
    rows: list[dict[str, Any]] = []
    hf_sizes = parse_int_list(args.batch_sizes)
    stoker_sizes = parse_int_list(args.stoker_batch_sizes or args.batch_sizes)
    # The transformers baseline pads with the underlying Hugging Face tokenizer's ids.
    hf_tok: Any = getattr(tok, "hf", tok)
    pad_id = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else hf_tok.eos_token_id
    for dtype in args.dtype.split(","):
        if not args.skip_stoker and not why_not:
            for b in stoker_sizes:
                rows.append(
                    {
                        **run_stoker(
                            args.model, dtype, b, prompts, args.output_len, args.quantization, args.kv_cache_dtype
                        ),
                        "dtype": dtype,
                    }
                )
                console.print(_line(rows[-1]))
        hf_dtype = args.hf_dtype or dtype
        if not args.skip_hf and not any(r["engine"] == "transformers" and r["dtype"] == hf_dtype for r in rows):
            model = load_hf(model_path, hf_dtype)
            for b in hf_sizes:
                rows.append({**run_hf(model, prompts, b, args.output_len, pad_id), "dtype": hf_dtype})
                console.print(_line(rows[-1]))
            del model
            gc.collect()
    table = Table(title="offline throughput (best batch size of each)")
    for col in (
        "dtype (stoker / transformers)",
        "stoker out tok/s (batch)",
        "transformers out tok/s (batch)",
        "output ratio",
        "total ratio",
        "same greedy tokens",
    ):
        table.add_column(col, justify="right")
    summary = []
    for dtype in args.dtype.split(","):
        hf_dtype = args.hf_dtype or dtype
        s, h = best(rows, "stoker", dtype), best(rows, "transformers", hf_dtype)
        same = None
        if s and h:  # informative: transformers' padded batches may round differently
            same = sum(a == b for a, b in zip(s["outputs"], h["outputs"]))
        summary.append(
            {
                "dtype": dtype,
                "hf_dtype": hf_dtype,
                "stoker": s and _strip(s),
                "transformers": h and _strip(h),
                "output_ratio": s["output_tok_s"] / h["output_tok_s"] if s and h else None,
                "total_ratio": s["total_tok_s"] / h["total_tok_s"] if s and h else None,
                "same_tokens": same,
            }
        )

        def fmt(r: dict[str, Any] | None) -> str:
            return f"{r['output_tok_s']:.1f} ({r['batch_size']})" if r else "-"

        ratio = summary[-1]["output_ratio"]
        table.add_row(
            f"{dtype} / {hf_dtype}",
            fmt(s),
            fmt(h),
            f"{ratio:.2f}x" if ratio else "-",
            f"{summary[-1]['total_ratio']:.2f}x" if ratio else "-",
            f"{same}/{len(prompts)}" if same is not None else "-",
        )
    console.print(table)
    profile = None
    if args.profile and not why_not and not args.skip_stoker:
        profile = profile_stoker(
            args.model,
            args.dtype.split(",")[0],
            max(stoker_sizes),
            prompts,
            args.output_len,
            args.profile_steps,
            args.quantization,
        )
        print(profile)  # plain: rich would re-wrap the profiler's wide tables
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "offline.json"), "w") as f:
            json.dump(
                {"command": " ".join(sys.argv), "runs": [_strip(r) for r in rows], "summary": summary}, f, indent=1
            )
        with open(os.path.join(args.out, "offline.md"), "w") as f:
            f.write(
                f"```\n{' '.join(sys.argv)}\n```\n\n| engine | dtype | batch | s | out tok/s | total tok/s |\n|---|---|---|---|---|---|\n"
            )
            f.writelines(
                f"| {r['engine']} | {r['dtype']} | {r['batch_size']} | {r['time_s']:.1f} | "
                f"{r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} |\n"
                for r in rows
            )
            if profile:
                f.write(f"\n## Profile\n\n```\n{profile}\n```\n")
    return 0


def _strip(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k != "outputs"}


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['engine']:>12} {r['dtype']:>8} batch {r['batch_size']:>3}: {r['time_s']:6.1f}s  "
        f"{r['output_tok_s']:7.1f} out tok/s  {r['total_tok_s']:8.1f} total tok/s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stoker.bench.offline",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
