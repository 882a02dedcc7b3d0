"""The prompts of a completion request: one text or token-id list, or a list of them (OpenAI's batch
form), each tokenized (off the event loop when long) with the text ``echo`` puts before its choices."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request

from kvhive.core.tokenizer import Tokenizer
from kvhive.server.errors import bad_request
from kvhive.server.generation import OFF_LOOP_CHARS, GenerationService
from kvhive.server.protocol import CompletionRequest
from kvhive.server.sampling_fields import truncated_prompt

# Prompts one request may carry (OpenAI's batch form), and choices in all (prompts x n): each choice
# is an engine request of its own.
MAX_PROMPTS = 64
MAX_BATCH_CHOICES = 64


def request_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts, each a text or token ids: one, or a list of them (OpenAI's batch
    form); 400 for an empty list of prompts or more than MAX_PROMPTS."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        return [[]]                                   # no ids: "The prompt is empty" below
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"At most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
    return list(prompt)


def prompt_token_ids(service: GenerationService, prompt: str | list[int] | list[str] | list[list[int]],
                     add_special_tokens: bool = True) -> list[int]:
    """One prompt as token ids (tokenized on the calling thread): a text with the BOS/EOS the model's
    tokenizer asks for unless ``add_special_tokens`` is false, token ids as given; a list holding
    one prompt is unwrapped."""
    prompts = request_prompts(prompt)
    if len(prompts) != 1:
        raise bad_request(f"Expected one prompt, got {len(prompts)}", param="prompt")
    (prompt,) = prompts
    if isinstance(prompt, str):
        token_ids = service.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        token_ids = list(prompt)
        service.check_token_ids(token_ids, "prompt")
    if not token_ids:
        raise bad_request("The prompt is empty", param="prompt")
    return token_ids


async def prompt_token_ids_off_loop(service: GenerationService, prompt: str | list[int],
                                    add_special_tokens: bool = True) -> list[int]:
    """``prompt_token_ids``, on a worker thread for a text (or token-id list) of OFF_LOOP_CHARS
    characters (ids) or more: the event loop goes on serving meanwhile."""
    if len(prompt) >= OFF_LOOP_CHARS:
        return await asyncio.to_thread(prompt_token_ids, service, prompt, add_special_tokens)
    return prompt_token_ids(service, prompt, add_special_tokens)


def text_start(tokenizer: Tokenizer, text: str, token_ids: list[int]) -> int:
    """How many leading ids of ``text``'s encoding with special tokens (``token_ids``) the tokenizer
    added before the text itself (its BOS): the ids of the text alone follow them."""
    plain = tokenizer.encode(text)
    for start in range(len(token_ids) - len(plain) + 1):
        if token_ids[start:start + len(plain)] == plain:
            return start
    return 0


async def echo_text_start(service: GenerationService, body: CompletionRequest, prompt: str | list[int],
                          token_ids: list[int]) -> int:
    """``text_start`` of a text prompt encoded with special tokens (0 for token ids, or without
    them): the echoed text begins at the token after the ones added (off the loop when long)."""
    if not isinstance(prompt, str) or not body.add_special_tokens:
        return 0
    if len(prompt) >= OFF_LOOP_CHARS:
        return await asyncio.to_thread(text_start, service.tokenizer, prompt, token_ids)
    return text_start(service.tokenizer, prompt, token_ids)


def echoed_prompt(service: GenerationService, prompt: str | list[int]) -> str:
    """The prompt text ``echo`` puts before the completion: as sent, or token ids decoded (special
    tokens included: they are part of what was sent)."""
    return prompt if isinstance(prompt, str) else service.tokenizer.decode(prompt, skip_special_tokens=False)


def check_batch(body: CompletionRequest, num_prompts: int, raw_request: Request,
                new_session_ttl: int | None) -> None:
    """400 for several prompts in a session (one session holds one continuation) or for more
    choices in all (prompts x n) than MAX_BATCH_CHOICES."""
    if num_prompts == 1:
        return
    if raw_request.headers.get("x-session-id") or new_session_ttl is not None:
        raise bad_request(f"A request in a session (x-session-id or POST /v1/context) takes one prompt, "
                          f"got {num_prompts}", param="prompt")
    if num_prompts * body.n > MAX_BATCH_CHOICES:
        raise bad_request(f"{num_prompts} prompts x n={body.n} is {num_prompts * body.n} choices; at most "
                          f"{MAX_BATCH_CHOICES} per request", param="prompt")


@dataclass(frozen=True)
class PromptInput:
    """One prompt of the request as the engine and the answer see it."""

    token_ids: list[int]
    echo: str                                    # the prompt text before each choice; "" without echo
    text_start: int = 0                          # leading prompt ids added before the text (a BOS)


async def prompt_input(service: GenerationService, body: CompletionRequest, prompt: str | list[int],
                       needs_text_start: bool) -> PromptInput:
    """One prompt tokenized (off the loop when long), with its echo and where its text starts."""
    token_ids = truncated_prompt(await prompt_token_ids_off_loop(service, prompt, body.add_special_tokens),
                                 body.truncate_prompt_tokens, service.max_model_len)
    echo = echoed_prompt(service, prompt) if body.echo else ""
    start = await echo_text_start(service, body, prompt, token_ids) if needs_text_start else 0
    return PromptInput(token_ids, echo, start)
