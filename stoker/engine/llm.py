"""Offline inference: LLM.generate() and LLM.chat() over an in-process EngineCore."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, cast

from tqdm import tqdm

from stoker.config import EngineConfig
from stoker.engine.core import EngineCore
from stoker.engine.params import (
    CompletionOutput,
    EngineCoreRequest,
    LoraCommand,
    LoraInfo,
    RequestOutput,
    SamplingParams,
)

Prompt = str | list[int]


class LLM:
    """`LLM()` loads the default model; keyword arguments are EngineConfig fields."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = EngineCore(EngineConfig(model=model, **engine_args))
        self.engine.measure_row_costs()
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_name: str | None = None,
    ) -> list[RequestOutput]:
        """Prompts are strings or lists of token ids. Outputs come back in prompt order.
        lora_name: a LoRA adapter registered with add_lora, applied to every prompt of the call."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts")
        requests = []
        for prompt, params in zip(prompts, params_list):
            if isinstance(prompt, str):
                text, token_ids = prompt, self.tokenizer.encode(prompt)
            else:
                text, token_ids = None, list(prompt)
            requests.append((text, token_ids, params))
        # Validate everything before queueing anything, so a bad prompt loses nothing.
        results: dict[str, RequestOutput] = {}
        order = []
        try:
            for text, token_ids, params in requests:
                request_id = f"offline-{next(self._ids)}"
                request = EngineCoreRequest(request_id, token_ids, params, time.time(), lora_name=lora_name)
                self.engine.add_request(request)
                order.append(request_id)
                results[request_id] = RequestOutput(
                    request_id, text, token_ids, [CompletionOutput(i) for i in range(params.n)]
                )
        except ValueError:
            self.engine.abort_requests(order)
            raise
        self._run(results, use_tqdm if use_tqdm is not None else len(order) > 8)
        return [results[r] for r in order]

    def _run(self, results: dict[str, RequestOutput], show_progress: bool) -> None:
        remaining = len(results)
        bar = tqdm(total=remaining, desc="generating", unit="req", disable=not show_progress)
        try:
            while remaining:
                deltas = self.engine.step()
                for request_id, message in self.engine.take_rejections():
                    if request_id in results:  # a grammar that failed to compile, as add_request would
                        raise ValueError(message)
                for delta in deltas:
                    out = results.get(delta.request_id)
                    if out is None:
                        continue
                    was_finished = out.finished
                    out.apply(delta)
                    if out.finished and not was_finished:
                        remaining -= 1
                        bar.update(1)
        except BaseException:
            self.engine.abort_requests(list(results))
            raise
        finally:
            bar.close()

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_name: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations.

        The template options are vLLM's LLM.chat ones: continue_final_message
        leaves the last message open (with add_generation_prompt=False), and
        chat_template_kwargs are variables for the model's template."""
        conversations: list[list[dict[str, Any]]] = (
            [cast(list[dict[str, Any]], messages)]
            if messages and isinstance(messages[0], dict)
            else list(cast(Sequence[list[dict[str, Any]]], messages))
        )
        prompts = [
            self.tokenizer.apply_chat_template(
                c,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                continue_final_message=continue_final_message,
                variables=chat_template_kwargs,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_name)

    def add_lora(self, name: str, path: str) -> LoraInfo:
        """Load, validate and register a LoRA adapter (a PEFT folder or a GGUF LoRA file) under name,
        for generate(..., lora_name=name). ValueError naming the adapter and the reason if refused."""
        ticket = next(self._ids)
        self.engine.lora_command(LoraCommand(ticket, "add", name, path))
        while True:
            for answer in self.engine.take_lora_answers():
                if answer.ticket != ticket:
                    continue
                if answer.error is not None or answer.info is None:
                    raise ValueError(answer.error or f"LoRA adapter {name!r} was refused")
                return answer.info
            self.engine.loras.wait(0.05)

    def remove_lora(self, name: str) -> None:
        """Forget an adapter (nothing runs between calls here, so no request still names it)."""
        self.engine.lora_command(LoraCommand(next(self._ids), "remove", name))
        self.engine.take_lora_answers()
