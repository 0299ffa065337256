"""`pin_prompts_file`: prompts the engine prefills once at startup and keeps pinned.

The file is JSON Lines, one prompt per line, either `{"prompt": "text"}` or
`{"messages": [{"role": "system", "content": "..."}, ...]}` (rendered with the model's chat
template, without a generation prompt, so it is the prefix that chat requests share). The
front end validates the file at startup; the engine's scheduler then adds one internal request
per prompt (`max_tokens=1`, a pinned anchor at the prompt's end), so the first user request
already hits. Their outputs are internal and go nowhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_mimo.config import MimoConfigError

REQUEST_ID_PREFIX = "vllm-mimo-pin-"


@dataclass(frozen=True)
class PinnedPrompt:
    line: int
    prompt: str | None = None
    messages: list[dict] | None = None


def read_pin_file(path: str) -> list[PinnedPrompt]:
    """Parse and validate the file; errors name the file and line."""
    file = Path(path)
    if not file.is_file():
        raise MimoConfigError(f"pin_prompts_file={path!r} does not exist or is not a file")
    prompts = []
    for lineno, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"pin_prompts_file {path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise MimoConfigError(f"{where}: not JSON ({e})") from None
        if not isinstance(record, dict) or len(record.keys() & {"prompt", "messages"}) != 1 or len(record) != 1:
            raise MimoConfigError(f'{where}: expected {{"prompt": "..."}} or {{"messages": [...]}}, got {line.strip()[:80]}')
        if "prompt" in record:
            if not isinstance(record["prompt"], str) or not record["prompt"]:
                raise MimoConfigError(f"{where}: prompt must be a non-empty string")
            prompts.append(PinnedPrompt(lineno, prompt=record["prompt"]))
        else:
            messages = record["messages"]
            if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages
            ):
                raise MimoConfigError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
            prompts.append(PinnedPrompt(lineno, messages=messages))
    if not prompts:
        raise MimoConfigError(f"pin_prompts_file={path!r} has no prompts")
    return prompts


def pinned_token_ids(prompts: list[PinnedPrompt], tokenizer: Any) -> list[list[int]]:
    """Token ids of each prompt as the model sees it."""
    out = []
    for p in prompts:
        if p.prompt is not None:
            out.append(list(tokenizer.encode(p.prompt)))
        else:
            # As vLLM renders chat requests: template to text, then tokens without specials.
            text = tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=False)
            out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


def pin_requests(vllm_config: Any, path: str, hash_block_size: int) -> list[Any]:
    """Internal vLLM requests that prefill each pinned prompt and anchor its end.

    Build them only once the engine has set up block hashing (its first step): their block
    hashes must chain from the same seed as every user request's.
    """
    from vllm_mimo.compat import (
        Request,
        SamplingParams,
        cached_tokenizer_from_config,
        get_hash_fn_by_name,
        get_request_block_hasher,
    )

    tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    hasher = get_request_block_hasher(hash_block_size, hash_fn)
    requests = []
    for i, ids in enumerate(pinned_token_ids(read_pin_file(path), tokenizer)):
        params = SamplingParams(max_tokens=1, extra_args={"mimo": {"pinned_prompt": [len(ids)]}})
        requests.append(Request(f"{REQUEST_ID_PREFIX}{i}", list(ids), params, None, block_hasher=hasher))
    return requests
