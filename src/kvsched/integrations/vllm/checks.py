"""``RequestCheck``: vLLM's front end refuses what the kvsched adapter cannot serve.

    vllm serve MODEL --scheduler-cls kvsched.integrations.vllm.Scheduler \\
        --logits-processors kvsched.integrations.vllm:RequestCheck
    LLM(model, scheduler_cls=..., logits_processors=[RequestCheck])

vLLM asks every custom logits processor to validate each request's ``SamplingParams`` in
its front end, before the request reaches the engine core; a refusal there is a
``VLLMValidationError``: HTTP 400 with the reason for the OpenAI server, the exception itself
for ``LLM.generate``. The scheduler runs in the engine core and can only finish a request
it refuses with ``FinishReason.ERROR``, which the server reports as a 500 without the reason.
The processor itself leaves logits untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import LogitsProcessor

from kvsched.integrations.vllm.requests import params_refusal

FQCN = "kvsched.integrations.vllm:RequestCheck"  # for --logits-processors


class RequestCheck(LogitsProcessor):  # type: ignore[misc]  # (vLLM is untyped here)
    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        reason = params_refusal(sampling_params)
        if reason is not None:
            raise VLLMValidationError(reason)

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Any) -> None:
        return None
