"""Conversations rendered with the model's own chat template, token for token as transformers'
`apply_chat_template`, and the tokens the loss trains on.

The template (jinja2 from `tokenizer_config.json` or `chat_template.jinja`) runs in the same
sandboxed environment transformers builds (trim_blocks, lstrip_blocks, loopcontrols, its
`tojson`, `raise_exception`, `strftime_now`), with the tokenizer's special tokens as
variables, and the rendered text is tokenized whole without added special tokens: the ids
are exactly those of `apply_chat_template(messages, tokenize=True)`. Trained tokens are each
assistant turn's content and the end-of-turn token after it (the `{% generation %}` blocks
instead, for templates that mark them); everything when `train_on_prompt` is on.
"""

import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from .errors import DataError
from .files import read_text_file

# The documented fallback for tokenizers without a chat template: each turn is
# "<|role|>\n" + content + "\n", an assistant turn's content followed by the EOS token.
SIMPLE_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ASSISTANT = "assistant"


def _environment(rendered: list[str], spans: list[tuple[int, int]]):
    """transformers' sandboxed jinja2 environment. While a template renders through
    `generate`, appending its chunks to `rendered`, each `{% generation %}` block appends its
    character range in the text to `spans` (everything before it has been yielded by then)."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationSpans(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_track", []), [], [], body).set_lineno(lineno)

        def _track(self, caller):
            text = caller()
            start = sum(len(chunk) for chunk in rendered)
            spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationSpans, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class ChatTemplate:
    """A chat template (jinja2 text), compiled in transformers' sandboxed environment as it is made (`DataError`
    where it does not parse), with the tokenizer's special tokens as its variables; `load_chat_template` finds it.
    `render` gives a conversation's text; `marks_generation`: whether it has `{% generation %}` blocks."""

    source: str  # where the template came from, for messages
    template: str
    special_tokens: dict  # bos_token, eos_token, ... -> text

    def __post_init__(self):
        import jinja2

        self._rendered: list[str] = []
        self._spans: list[tuple[int, int]] = []
        try:
            self._compiled = _environment(self._rendered, self._spans).from_string(self.template)
        except jinja2.TemplateSyntaxError as error:
            raise DataError(f"the chat template from {self.source} does not parse: {error}") from error
        self.marks_generation = re.search(r"\{%-?\s*generation\s*-?%\}", self.template) is not None

    def render(
        self, messages: list[dict], tools=None, add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation as text exactly as transformers renders it, character ranges of the
        template's `{% generation %}` blocks in it)."""
        self._rendered.clear()
        self._spans.clear()
        variables = dict(messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt)
        for chunk in self._compiled.generate(**variables, **self.special_tokens):
            self._rendered.append(chunk)
        return "".join(self._rendered), list(self._spans)


def load_chat_template(tokenizer_dir: Path | None, choice: str | None, eos_token: str) -> ChatTemplate | None:
    """The chat template to train with: `choice` ("simple" or a .jinja file) if set, else the
    tokenizer's own (chat_template.jinja, or tokenizer_config.json's chat_template); None when
    the tokenizer has none (the caller falls back to the simple template and says so)."""
    config = {}
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer_config.json").exists():
        try:
            config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
        except json.JSONDecodeError as error:
            raise DataError(f"{tokenizer_dir / 'tokenizer_config.json'} is not valid JSON: {error}") from error
    special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    special = {name: text for name, text in special.items() if text is not None}
    special.setdefault("eos_token", eos_token)
    if choice == "simple":
        return ChatTemplate("the simple template", SIMPLE_TEMPLATE, special)
    if choice is not None:
        path = Path(choice)
        if not path.exists():
            raise DataError(f"data.chat_template {choice!r} is neither 'simple' nor an existing .jinja file")
        return ChatTemplate(str(path), read_text_file(path, "data.chat_template"), special)
    if tokenizer_dir is None:
        return None
    jinja_file = tokenizer_dir / "chat_template.jinja"
    if jinja_file.exists():
        return ChatTemplate(str(jinja_file), jinja_file.read_text(), special)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    if not template:
        return None
    return ChatTemplate(str(tokenizer_dir / "tokenizer_config.json"), template, special)


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content blocks: the text ones, as templates join them
        return "".join(block.get("text", "") for block in content if isinstance(block, dict))
    return "" if content is None else str(content)


_TURN_MARK = "\x00megatrain: this turn's content\x00"  # stands for a turn's content to find where the template puts it


def _rendered_before(template: ChatTemplate, text: str, messages: list[dict], turn: int, tools) -> int:
    """Where assistant turn `turn`'s content can start in `text`: where the template puts it (the conversation up to
    it rendered with `_TURN_MARK` for its content: the turns before it and its header, whose markup holds short words
    such as "assistant" or "a"), or after the turns before it, wherever that rendering is a prefix of the whole
    (most templates); else 0 (templates that rewrite earlier turns, e.g. Qwen3's reasoning). So a short answer is
    never matched inside a system prompt, an earlier turn or the turn's own header."""
    marked = {**messages[turn], "content": _TURN_MARK}
    starts = [0]
    for conversation in (messages[:turn], [*messages[:turn], marked]):
        try:
            before = template.render(conversation, tools)[0].split(_TURN_MARK)[0]
        except Exception:  # a template may refuse a partial conversation; the in-order search still holds
            continue
        if text.startswith(before):
            starts.append(len(before))
    return max(starts)


def _assistant_spans(text: str, messages: list[dict], template: ChatTemplate, tools=None) -> list[tuple[int, int]]:
    """Character ranges of each assistant turn's content (and the tool calls it makes) in the rendered text, found in
    order. Raises ValueError naming the turn when the template does not render it verbatim."""
    spans, cursor = [], 0
    for turn, message in enumerate(messages):
        content = _content_text(message.get("content"))
        assistant = message.get("role") == ASSISTANT
        if assistant:
            cursor = max(cursor, _rendered_before(template, text, messages, turn, tools))
        span = _content_span(text, content, cursor)
        calls = (
            _tool_calls_span(template, text, messages, turn, tools) if assistant and message.get("tool_calls") else None
        )
        if calls is not None:  # (the calls a template writes after the content, or instead of it: Llama 3.1's)
            before_calls = span is not None and content.strip() and span[1] <= calls[1]  # (not in a later turn)
            span = (min(span[0], calls[0]), calls[1]) if before_calls else calls
        if span is None:
            if assistant:
                raise ValueError(
                    f"the chat template does not render assistant turn {turn}'s content verbatim, so its trained "
                    "tokens cannot be found; use a template that keeps it, one with {% generation %} blocks, "
                    "or data.chat_template: simple"
                )
            continue  # a template may rewrite a system or tool turn; the next turns are still found in order
        if assistant:
            spans.append(span)
        cursor = span[1]
    return spans


def _content_span(text: str, content: str, cursor: int) -> tuple[int, int] | None:
    """Where a turn's `content` is in `text`, from `cursor` on: verbatim at `cursor` (where the template writes it
    as it is, ChatML: its leading and trailing whitespace is the answer's too, a code answer's last newline), else
    its stripped text's first occurrence (templates that trim it, Llama 3's); None where it is not found."""
    stripped = content.strip()
    if stripped and text.startswith(content, cursor):
        return cursor, cursor + len(content)
    start = text.find(stripped, cursor) if stripped else cursor
    return (start, start + len(stripped)) if start >= 0 else None


def _tool_calls_span(template: ChatTemplate, text: str, messages: list[dict], turn: int, tools) -> tuple | None:
    """The characters of `text` that assistant turn `turn`'s tool calls render as: where the conversation up to it
    rendered with its calls differs from it rendered without them (the common ends cut off: the header before, the
    end-of-turn markup after); None where that rendering is no prefix of `text`."""
    without = {key: value for key, value in messages[turn].items() if key != "tool_calls"}
    try:
        rendered = template.render(messages[: turn + 1], tools)[0]
        bare = template.render([*messages[:turn], without], tools)[0]
    except Exception:  # (a template may refuse a partial conversation)
        return None
    if not text.startswith(rendered):
        return None
    # the common end first: the calls' markup may start as the turn's end does (Qwen's "<tool_call>", "<|im_end|>")
    after = len(os.path.commonprefix([rendered[::-1], bare[::-1]]))
    start = min(len(os.path.commonprefix([rendered, bare])), len(bare) - after)
    return (start, len(rendered) - after) if len(rendered) - after > start else None


def render_conversation(
    template: ChatTemplate, messages: list[dict], tools=None
) -> tuple[str, list[tuple[int, int]], bool]:
    """(text, character ranges to train, whether the end-of-turn token after each range is trained):
    the `{% generation %}` blocks when the template marks them, else each assistant turn's content.
    Raises ValueError (jinja's TemplateError included) when the conversation cannot be rendered."""
    text, spans = template.render(messages, tools)
    if template.marks_generation:
        return text, spans, False
    return text, _assistant_spans(text, messages, template, tools), True


def trained_tokens(
    text: str,
    spans: list[tuple[int, int]],
    end_of_turn: bool,
    ids: list[int],
    offsets,
    special_ids: set[int],
    unended: list[str] | None = None,
) -> list[bool]:
    """Per token: does it overlap a trained range, or is it the end-of-turn token after one (the first
    special token past whitespace-only tokens: <|im_end|>, <|eot_id|>, </s>)? Where a range has no special token
    after it, the text that follows it (`end_marker`) is appended to `unended`, when given."""
    trained = [False] * len(ids)
    token = 0
    for start, end in spans:
        while token < len(ids) and offsets[token][1] <= start:
            token += 1
        while token < len(ids) and offsets[token][0] < end:
            trained[token] = True
            token += 1
        if end_of_turn:
            while token < len(ids) and ids[token] not in special_ids and not text[slice(*offsets[token])].strip():
                token += 1
            if token < len(ids) and ids[token] in special_ids:
                trained[token] = True
                token += 1
            elif unended is not None:
                unended.append(end_marker(text, end))
    return trained


def end_marker(text: str, end: int) -> str:
    """What a template writes after a trained range ending at character `end`: its next word (an end-of-turn marker
    such as <|end|>), "" where the text ends there."""
    rest = text[end:].split(None, 1)
    return rest[0][:40] if rest else ""


def encode_conversation(
    template: ChatTemplate, tokenizer, messages: list[dict], tools=None, train_on_prompt: bool = False
) -> tuple[list[int], list[bool]]:
    """(token ids exactly as apply_chat_template makes them, trained flag per token) of one conversation."""
    text, spans, end_of_turn = render_conversation(template, messages, tools)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    if train_on_prompt:
        return encoding.ids, [True] * len(encoding.ids)
    special = special_token_ids(tokenizer)
    return encoding.ids, trained_tokens(text, spans, end_of_turn, encoding.ids, encoding.offsets, special)


def special_token_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special added tokens (end-of-turn candidates)."""
    return {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
