"""Anchors for chat requests: the end of the system message, and of every `cache_control` block.

In the API server process the plugin wraps three vLLM methods (installed once, for hybrid SWA
models with the plugin on):

  * `OpenAIServingChat.render_chat_request`: after vLLM renders a chat request, each anchor
    point is turned into a token position by rendering the conversation cut at that point with
    the same chat template and taking the longest common prefix with the full prompt's tokens;
  * `ChatCompletionRequest.to_sampling_params`: the positions go into
    `SamplingParams.extra_args["mimo"]`, under `system_prompt` and `cache_control` (the anchors'
    kinds, as the metrics count them), where the KV manager reads them;
  * `AnthropicServingMessages.create_messages`: `/v1/messages` drops `cache_control` while
    converting to a chat request, so the marked prefixes are read from the raw body and
    converted with vLLM's own converter.

Anchor points: the end of the leading system (or developer) messages, unless
`system_prompt_anchor` is off; the end of every content part (or whole message) carrying
`"cache_control": {"type": "ephemeral"}`, the prompt-caching convention of Anthropic's Messages
API. Positions of repeated prefixes (a shared system prompt) are cached. A `cache_control`
that is not such an object fails the request with HTTP 400 naming it (`check_cache_control`).
"""

from __future__ import annotations

import contextvars
import json
from collections import OrderedDict
from typing import Any

from vllm_mimo.kv_cache.anchor_policy import AnchorHintError, declared_anchors, mimo_hints
from vllm_mimo.log import logger

# An anchor point: the hint key its position goes under (`anchor_policy.HINT_KINDS`: the anchor's
# kind) and the conversation cut there.
SYSTEM, CACHE_CONTROL = "system_prompt", "cache_control"
_prefixes: contextvars.ContextVar[list[tuple[str, list[dict]]] | None] = contextvars.ContextVar(
    "vllm_mimo_anthropic_prefixes", default=None
)
_anchors: contextvars.ContextVar[dict[str, list[int]] | None] = contextvars.ContextVar(
    "vllm_mimo_chat_anchors", default=None
)
_position_cache: OrderedDict[str, int] = OrderedDict()
_CACHE_SIZE = 1024
_installed = False
_system_anchor = True


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _as_dict(message: Any) -> dict:
    return message if isinstance(message, dict) else dict(message)


class CacheControlError(ValueError):
    """A `cache_control` marker the plugin does not understand (the request gets HTTP 400 whose
    `param` is where it is, e.g. `messages[0].content[1].cache_control`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


_CACHE_CONTROL_TTLS = ("5m", "1h")


def check_cache_control(value: Any, where: str) -> None:
    """`cache_control` must be Anthropic's `{"type": "ephemeral"}`, optionally with a "ttl" of
    "5m" or "1h" (which the plugin's anchors do not distinguish)."""
    ok = (
        isinstance(value, dict)
        and value.get("type") == "ephemeral"
        and set(value) <= {"type", "ttl"}
        and value.get("ttl", "5m") in _CACHE_CONTROL_TTLS
    )
    if not ok:
        raise CacheControlError(
            f'{where}: cache_control must be {{"type": "ephemeral"}}, optionally with "ttl" one of '
            f"{list(_CACHE_CONTROL_TTLS)}, got {value!r}",
            param=f"{where}.cache_control",
        )


def anchor_prefixes(messages: list[Any], system_anchor: bool) -> list[tuple[str, list[dict]]]:
    """The conversations, cut at each anchor point, whose rendered length is an anchor, each
    with its hint key (`SYSTEM` or `CACHE_CONTROL`)."""
    messages = [_as_dict(m) for m in messages]
    prefixes: list[tuple[str, list[dict]]] = []
    leading = 0
    while leading < len(messages) and messages[leading].get("role") in ("system", "developer"):
        leading += 1
    if system_anchor and leading:
        prefixes.append((SYSTEM, messages[:leading]))
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("cache_control") is not None:
                    check_cache_control(part["cache_control"], f"messages[{i}].content[{j}]")
                    prefixes.append((CACHE_CONTROL, messages[:i] + [{**message, "content": content[: j + 1]}]))
        if message.get("cache_control") is not None:
            check_cache_control(message["cache_control"], f"messages[{i}]")
            prefixes.append((CACHE_CONTROL, messages[: i + 1]))
    return prefixes


async def _position(serving: Any, request: Any, prefix: list[dict], full_ids: list[int]) -> int | None:
    tools = [t.model_dump() for t in request.tools] if request.tools else None
    key = json.dumps(
        [prefix, tools, request.chat_template, request.chat_template_kwargs, request.add_special_tokens],
        sort_keys=True,
        default=str,
    )
    if key in _position_cache:
        _position_cache.move_to_end(key)
        return _position_cache[key]
    cut = request.model_copy(
        update={"messages": prefix, "add_generation_prompt": False, "continue_final_message": False}
    )
    result = await serving.online_renderer.render_chat(cut)
    if not isinstance(result, tuple):
        logger.warning("vllm-mimo: could not render a chat prefix for an anchor: %s", result)
        return None
    ids = serving._extract_prompt_components(result[1][0]).token_ids
    position = common_prefix_len(ids, full_ids)
    _position_cache[key] = position
    if len(_position_cache) > _CACHE_SIZE:
        _position_cache.popitem(last=False)
    return position


def install(system_anchor: bool) -> None:
    """Wrap vLLM's chat entry points (once per process)."""
    global _installed, _system_anchor
    _system_anchor = system_anchor
    if _installed:
        return
    from vllm_mimo.compat import AnthropicServingMessages, ChatCompletionRequest, OpenAIServingChat

    render = OpenAIServingChat.render_chat_request

    async def render_chat_request(self, request):
        result = await render(self, request)
        if not isinstance(result, tuple):
            return result
        full_ids = self._extract_prompt_components(result[1][0]).token_ids
        try:
            prefixes = anchor_prefixes(request.messages, _system_anchor) + (_prefixes.get() or [])
        except CacheControlError as e:
            return self.create_error_response(str(e), param=e.param)
        _anchors.set(await _anchor_positions(self, request, prefixes, list(full_ids)))
        _prefixes.set(None)
        return result

    to_sampling_params = ChatCompletionRequest.to_sampling_params

    def to_sampling_params_with_anchors(self, *args, **kwargs):
        params = to_sampling_params(self, *args, **kwargs)
        anchors = _anchors.get()
        _anchors.set(None)
        if anchors:
            _add_hints(params, anchors)
        return params

    create_messages = AnthropicServingMessages.create_messages

    async def create_messages_with_cache_control(self, request, raw_request=None):
        if raw_request is not None:
            try:
                _prefixes.set(await _anthropic_prefixes(self, request, raw_request))
            except CacheControlError as e:
                return self.create_error_response(str(e), param=e.param)
        return await create_messages(self, request, raw_request)

    OpenAIServingChat.render_chat_request = render_chat_request
    ChatCompletionRequest.to_sampling_params = to_sampling_params_with_anchors
    AnthropicServingMessages.create_messages = create_messages_with_cache_control
    _installed = True


async def _anchor_positions(
    serving: Any, request: Any, prefixes: list[tuple[str, list[dict]]], full_ids: list[int]
) -> dict[str, list[int]] | None:
    """The prompt positions where each prefix's rendering ends, by hint key (None: none found);
    a prefix that fails to render is skipped with a warning."""
    positions: dict[str, set[int]] = {}
    for key, prefix in prefixes:
        try:
            position = await _position(serving, request, prefix, full_ids)
        except Exception as e:  # an anchor is an optimisation: never fail the request for it
            logger.warning("vllm-mimo: skipping a chat anchor, its prefix did not render: %s", e)
            continue
        if position:
            positions.setdefault(key, set()).add(position)
    return {key: sorted(found) for key, found in positions.items()} or None


def _add_hints(params: Any, anchors: dict[str, list[int]]) -> None:
    """Merge the chat anchors' positions into the request's own hints (`extra_args["mimo"]`),
    unless those are malformed: the plugin's validation of parameters rejects them then, with
    its message."""
    try:
        declared_anchors(params.extra_args)
    except AnchorHintError:
        return
    hints = dict(mimo_hints(params.extra_args) or {})
    for key, positions in anchors.items():
        hints[key] = sorted(set(hints.get(key, [])) | set(positions))
    params.extra_args = {**(params.extra_args or {}), "mimo": hints}


async def _anthropic_prefixes(serving: Any, request: Any, raw_request: Any) -> list[tuple[str, list[dict]]]:
    """Chat-format conversations cut after each `cache_control` block of a /v1/messages body."""
    try:
        body = await raw_request.json()
    except (ValueError, RuntimeError):
        return []
    cuts = []
    system = body.get("system")
    if isinstance(system, list):
        for k, block in enumerate(system):
            if isinstance(block, dict) and block.get("cache_control") is not None:
                check_cache_control(block["cache_control"], f"system[{k}]")
                cuts.append({"system": request.system[: k + 1], "messages": []})
    for i, message in enumerate(body.get("messages") or []):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, block in enumerate(content):
            if isinstance(block, dict) and block.get("cache_control") is not None:
                check_cache_control(block["cache_control"], f"messages[{i}].content[{j}]")
                cut_message = request.messages[i].model_copy(update={"content": request.messages[i].content[: j + 1]})
                cuts.append({"messages": request.messages[:i] + [cut_message]})
    prefixes = []
    for update in cuts:
        cut = request.model_copy(update=update)
        chat = serving.to_chat_completion_request(cut, merge_inline_system=serving._merge_inline_system)
        prefixes.append((CACHE_CONTROL, [_as_dict(m) for m in chat.messages]))
    return prefixes
