"""Sticky keys: what makes two requests "the same" for sticky routing (pure, no tokenizer).

``session_key``: the value of a header the client sets per conversation (e.g.
``X-Session-Id``), looked up case-insensitively, stripped, capped at 256 characters.

``prefix_key``: the start of the prompt, so requests sharing a system prompt or a
conversation's history land where that prefix is cached. The router has no tokenizer, so
the prefix is measured in characters, not tokens (about 4 characters a token in English):

- chat ``messages``: each message rendered as ``role + "\\n" + content + "\\n"``, where a
  content that is a list of OpenAI content parts contributes the ``text`` of its
  ``{"type": "text"}`` parts; the rendering's first ``prefix_chars`` characters;
- completions ``prompt``: a string's first ``prefix_chars`` characters; a list of token ids,
  the first ``prefix_chars`` ids joined with ","; a list of strings, the first one's prefix.

Either returns None when there is nothing usable.

>>> prefix_key({"messages": [{"role": "system", "content": "Fix grammar."},
...                          {"role": "user", "content": [{"type": "text", "text": "he go"}]}]}, 22)
'system\\nFix grammar.\\nus'
>>> prefix_key({"prompt": [101, 7, 42, 9]}, 3), prefix_key({"prompt": ["abcdef", "x"]}, 4)
('101,7,42', 'abcd')
>>> session_key({"x-session-id": " s-42 "}, "X-Session-Id"), session_key({"X-Session-Id": ""}, "x-session-id")
('s-42', None)
"""

from __future__ import annotations

from collections.abc import Mapping

MAX_KEY_CHARS = 256


def session_key(headers: Mapping[str, str], header: str) -> str | None:
    """The header's value (any case of its name), stripped and capped at 256 characters; None if absent or empty."""
    value = headers.get(header)
    if value is None:
        wanted = header.lower()
        value = next((v for name, v in headers.items() if name.lower() == wanted), None)
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value[:MAX_KEY_CHARS] or None


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part["text"] for part in content
                       if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str))
    return ""


def _chat_prefix(messages: list, prefix_chars: int) -> str:
    rendered: list[str] = []
    length = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        text = f"{role if isinstance(role, str) else ''}\n{_content_text(message.get('content'))}\n"
        rendered.append(text)
        length += len(text)
        if length >= prefix_chars:  # a long conversation is rendered only as far as the prefix goes
            break
    return "".join(rendered)[:prefix_chars]


def prefix_key(payload: dict, prefix_chars: int) -> str | None:
    """The first ``prefix_chars`` characters of the prompt (see the module docstring), or None."""
    if prefix_chars < 1:
        raise ValueError(f"prefix_chars must be ≥ 1, got {prefix_chars}")
    if not isinstance(payload, dict):
        return None
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        return _chat_prefix(messages, prefix_chars) or None
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt[:prefix_chars] or None
    if isinstance(prompt, list) and prompt:
        head = prompt[:prefix_chars]
        if all(isinstance(token, int) and not isinstance(token, bool) for token in head):
            return ",".join(map(str, head))
        if isinstance(prompt[0], str):
            return prompt[0][:prefix_chars] or None
    return None
