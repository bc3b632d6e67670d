"""`/tokenize` and `/detokenize` in vLLM's shapes, with the served model's tokenizer and chat
template (the same ones the generation routes use, so a count here is the count there).

    POST /tokenize   {"prompt": "text", "add_special_tokens": true}
                  or {"messages": [...], "add_generation_prompt": true}
                  -> {"count": N, "max_model_len": L, "tokens": [ids], "token_strs": null}
    POST /detokenize {"tokens": [ids]} -> {"prompt": "text"}

As vLLM: special tokens are added to a prompt by default but not to rendered messages (the
template writes its own), and a prompt longer than the context is counted, not refused.
These run on the API server's prompt threads, never on its event loop.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from orbit.http.errors import BadRequest
from orbit.http.openai_types import (
    _TOKEN_IDS_SCHEMA,
    MAX_MESSAGES,
    ChatMessage,
    ModelName,
    PromptLimits,
    _check_message,
    _require,
    parse_request,
)


class TokenizeRequest(BaseModel):
    """Either `prompt` or `messages`."""

    model_config = ConfigDict(extra="ignore")
    model: ModelName | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(
        None, json_schema_extra={"minItems": 1, "maxItems": MAX_MESSAGES}
    )
    # Default: true for a prompt, false for messages (their template writes its own markers).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True  # messages only: end with the assistant's turn opening
    continue_final_message: bool = False  # messages only: leave the last message open
    return_token_strs: bool = False  # also list each token's string


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: ModelName | None = None
    tokens: Annotated[list[int], WithJsonSchema({**_TOKEN_IDS_SCHEMA, "minItems": 0})]


def tokenize(raw: bytes, tokenizer, limits: PromptLimits, check_model) -> dict:
    """The body of a /tokenize response; `check_model` raises for a model not served here."""
    req = parse_request(raw, TokenizeRequest, limits)
    check_model(req.model)
    has_prompt, has_messages = req.prompt is not None, req.messages is not None
    msg = "give exactly one of prompt and messages."
    _require(has_prompt != has_messages, msg, "messages" if has_messages else "prompt")
    if has_prompt:
        text, add_special = req.prompt, req.add_special_tokens is not False
    else:
        text, add_special = _render(req, tokenizer), bool(req.add_special_tokens)
    ids = tokenizer(text, add_special_tokens=add_special).input_ids
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": limits.max_seq_len,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize(raw: bytes, tokenizer, limits: PromptLimits, check_model) -> dict:
    """The body of a /detokenize response: the ids decoded as they are, special tokens kept."""
    req = parse_request(raw, DetokenizeRequest, limits)
    check_model(req.model)
    vocab = limits.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    _require(bad is None, f"tokens must be in [0, {vocab}), got {bad}.", "tokens")
    return {"prompt": tokenizer.decode(req.tokens)}


def _render(req: TokenizeRequest, tokenizer) -> str:
    _require(bool(req.messages), "messages must not be empty.", "messages")
    for i, message in enumerate(req.messages):
        _check_message(i, message)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    _require(has_template, "this model has no chat template; tokenize a prompt.", "messages")
    msg = "add_generation_prompt and continue_final_message cannot both be true."
    both = req.add_generation_prompt and req.continue_final_message
    _require(not both, msg, "continue_final_message")
    roles = {"developer": "system"}
    messages = [{"role": roles.get(m.role, m.role), "content": m.text()} for m in req.messages]
    try:
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tokenize=False,
        )
    except Exception as exc:  # noqa: BLE001 - jinja errors, and the template's raise_exception()
        raise BadRequest(f"the chat template rejected the messages: {exc}", "messages") from None
