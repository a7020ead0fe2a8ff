"""Requests, scheduler, model runner, engine, `LLM.generate()` and the `dsv4` command line.

The offline API is vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))`` returns
`RequestOutput`s. The engine underneath (`Engine`) runs the one `Scheduler` over the host
allocator and the `ModelRunner` over the paged step.

The names below are imported on first use, so that the host-only parts (the scheduler, the
allocator commands of the CLI) start without importing JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "serving.llm",
    "CompletionOutput": "serving.outputs",
    "Engine": "serving.engine",
    "EngineConfig": "serving.config",
    "Logprob": "serving.outputs",
    "ModelRunner": "serving.runner",
    "Request": "serving.request",
    "RequestMetrics": "serving.outputs",
    "RequestStatus": "serving.request",
    "RequestOutput": "serving.outputs",
    "SamplingParams": "serving.sampling_params",
    "Scheduler": "serving.scheduler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'serving' has no attribute {name!r}")
