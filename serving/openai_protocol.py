"""The request bodies of the OpenAI-compatible server (`serving.server`), as pydantic models.

Field names and defaults are OpenAI's, plus vLLM's extra sampling fields (``top_k``, ``min_p``,
``min_tokens``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``return_token_ids``). Unknown fields are ignored, as OpenAI's peers
ignore them. Only the types are checked here; the values are checked once, by `SamplingParams`
and `Engine.check_request`, whose ValueErrors the server turns into 400s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from serving.outputs import Logprob

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "StreamOptions",
    "TokenizeRequest",
    "chat_logprobs",
    "completion_logprobs",
    "error_body",
    "messages_as_dicts",
    "usage",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The sampling fields both endpoints take (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    best_of: int | None = None  # vLLM's; refused (400) unless None or n
    # OpenAI's fields this server cannot honour: refused (400) when set (`unsupported`)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a text, a list of texts, token ids or a list of
    lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # refused when set (`unsupported`)


class ChatMessage(_Body):
    role: str
    content: str | None = ""


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # refused when set (`unsupported`)


class TokenizeRequest(_Body):
    """``POST /tokenize``: a text (BOS prepended as for a completion's prompt) or messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# OpenAI's request fields this server cannot honour, and what to do instead: a request that sets
# one gets a 400 rather than an answer that silently ignores it.
UNSUPPORTED = {
    "logit_bias": "no per-token bias here; stop_token_ids ends an output at the tokens given",
    "suffix": "no insertion after the completion here (vLLM refuses it too)",
    "response_format": "no structured outputs here; only {'type': 'text'}",
    "tools": "no tool calling here; describe the tools in the messages",
}


def unsupported(body: _Body) -> tuple[str, Any] | None:
    """The first field of `UNSUPPORTED` that ``body`` sets, with its value (an empty bias or
    tool list and a text response format are the defaults, and allowed)."""
    for name in UNSUPPORTED:
        value = getattr(body, name, None)
        if value in (None, {}, [], {"type": "text"}):
            continue
        return name, value
    return None


def messages_as_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them (``{"role", "content"}``)."""
    return [{"role": m.role, "content": m.content or ""} for m in messages]


# -- responses ---------------------------------------------------------------------------------


def token_text(token_id: int, entry: Mapping[int, Logprob] | None, decode) -> str:
    """A token as text: its decoded text, or ``token_id:N`` without a tokenizer (vLLM)."""
    text = entry[token_id].decoded_token if entry and token_id in entry else None
    if text is None:
        text = decode(token_id)
    return f"token_id:{token_id}" if text is None else text


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Mapping[int, Logprob] | None],
    decode,
    text_offset: int = 0,
) -> dict[str, list]:
    """OpenAI's legacy ``logprobs`` object of ``/v1/completions``: per token its text, logprob
    (None where nothing predicts it: the prompt's first token), its position's top logprobs
    (text -> logprob) and its offset in the choice's text."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = token_text(token_id, entry, decode)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry[token_id].logprob)
        top = {token_text(t, entry, decode): lp.logprob for t, lp in entry.items()}
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[Mapping[int, Logprob]], top_n: int, decode
) -> dict[str, list]:
    """OpenAI's chat ``logprobs`` object: per token its text, logprob and UTF-8 bytes, and the
    ``top_n`` most likely tokens of its position (by rank)."""

    def item(token_id: int, lp: Logprob, entry) -> dict[str, Any]:
        text = token_text(token_id, entry, decode)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        ranked = sorted(
            ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n),
            key=lambda x: x[1].rank,
        )
        content.append(
            {
                **item(token_id, entry[token_id], entry),
                "top_logprobs": [item(t, lp, entry) for t, lp in ranked],
            }
        )
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``."""
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        503: "service_unavailable_error",
    }
    kind = kinds.get(status, "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
