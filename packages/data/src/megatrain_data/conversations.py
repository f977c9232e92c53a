"""A record of a dataset as the conversation it holds: its fields read by the source's format (alpaca, sharegpt,
messages; LLaMA-Factory's columns and role tags, TRL's prompt-completion), its turns as role/content dicts with what
a template reads beside (tool calls), checked for roles out of order and empty answers before a template renders it.
"""

import json
from dataclasses import replace

from .chat import _content_text
from .errors import DataError
from .section import fix_for_record
from .sources import Source


def record_where(source: Source, index: int) -> str:
    """Where a record is, as messages say it: its dataset and its number from 1 (a JSON Lines file's line)."""
    return f"dataset {source.name!r}: record {index + 1}"


def record_field(record: dict, key, index: int, source: Source, what: str):
    value = record.get(key) if key is not None else None
    if value is None:
        present = sorted(name for name, field in record.items() if field is not None)
        # (a dataset gives a record the columns of every record: None where it has no such field)
        fix = "other records have it: fill it in or drop this record" if key in record else fix_for_record(record, what)
        raise DataError(f"{record_where(source, index)} has no {what} field {key!r} (its fields: {present}); {fix}")
    return value


def _messages_format_turns(record: dict, source: Source, index: int) -> list:
    """`messages` records: a `messages` list of role/content turns, also accepted as `conversations`
    of from/value turns (so both common layouts read without a registry)."""
    for key in (source.column("messages"), "conversations"):
        if isinstance(record.get(key), list):
            return record[key]
    if "prompt" in record and "completion" in record:
        return _prompt_completion_turns(record["prompt"], record["completion"], record_where(source, index))
    return record_field(record, source.column("messages"), index, source, "messages")


def _prompt_completion_turns(prompt, completion, where: str) -> list:
    """TRL's conversational prompt-completion record as its turns, where training every assistant turn (as megatrain
    trains a conversation) trains its completion alone, as TRL's completion_only_loss does: its prompt holds no answer.
    Not token for token: TRL also trains what the template writes after the end-of-turn token (ChatML's newline) and a
    tool result inside the completion."""
    if not (isinstance(prompt, list) and isinstance(completion, list)):
        raise DataError(
            f"{where} holds prompt and completion text (TRL's prompt-completion format); write it as messages, "
            '[{"role": "user", "content": PROMPT}, {"role": "assistant", "content": COMPLETION}], which trains the '
            "completion alone"
        )
    if any(isinstance(turn, dict) and turn.get("role") == "assistant" for turn in prompt):
        raise DataError(
            f"{where}: its prompt holds an assistant turn, which megatrain would train beside the completion (TRL "
            "trains the completion alone); write it as messages, or move the answer out of the prompt"
        )
    return prompt + completion


ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant", "observation": "tool", "ipython": "tool"}


def record_tools(record: dict, source: Source, where: str):
    """The record's tools (a list, or JSON text of one) or None; alpaca has no tools column."""
    tools = record.get(source.column("tools"))
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: its tools field is not valid JSON ({error})") from error
    return tools


def alpaca_prompt(record: dict, source: Source, index: int) -> list[dict]:
    """An alpaca record's turns before its response: system, history pairs, then instruction and input as the
    user's turn (joined with a newline)."""
    where = record_where(source, index)
    messages = []
    system = record.get(source.column("system"))
    if system:
        messages.append({"role": "system", "content": str(system)})
    history = record.get(source.column("history")) or []
    for turn in history if isinstance(history, (list, tuple)) else [history]:
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
            raise DataError(f"{where}: history must be a list of [prompt, response] pairs of text, got {turn!r}")
        messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    prompt = str(record_field(record, source.column("prompt"), index, source, "prompt"))
    query = record.get(source.column("query"))  # (joined as LLaMA-Factory joins them: an empty one left out)
    messages.append({"role": "user", "content": "\n".join(part for part in (prompt, str(query or "")) if part)})
    return messages


def _role_names(source: Source) -> dict:
    """The source's role names (its tags) -> the roles a conversation takes: user/assistant/system/tool."""
    return {
        source.tag("user_tag"): "user",
        source.tag("assistant_tag"): "assistant",
        source.tag("function_tag"): "assistant",
        source.tag("observation_tag"): "tool",
        source.tag("system_tag"): "system",
    }


def _unknown_role_fix(role, source: Source) -> str:
    """What reads a turn's `role` that the source's tags do not name. A file named in data.dataset has no tags (no
    data key sets them): data.format messages where that reads the role, else its roles renamed or a registry entry."""
    if source.registered:
        return "set the registry's tags to the dataset's role names"
    read_as_messages = set(_role_names(replace(source, formatting="messages"))) | set(ROLE_ALIASES)
    if source.formatting != "messages" and isinstance(role, str) and role in read_as_messages:
        return f"set data.format: messages, which reads {role!r}"
    return (
        "rename the file's roles to these, or name the file in a dataset_info.json entry whose tags map its role "
        "names (data.dataset_dir; the registry's tags are the only setting that renames roles)"
    )


def sharegpt_turn(turn, what: str, source: Source, where: str) -> dict:
    """One sharegpt or messages turn (`what` names it in errors: "turn 3") as a role/content dict, its role
    one of user/assistant/system/tool through the source's tags, with the turn's other keys a template reads
    (an assistant's tool_calls, a tool result's name or tool_call_id)."""
    role_of = _role_names(source)
    if not isinstance(turn, dict):
        raise DataError(f"{where}: {what} is not a mapping: {turn!r}")
    role_key, content_key = source.tag("role_tag"), source.tag("content_tag")
    if source.formatting == "messages" and role_key not in turn and "from" in turn:  # from/value turns
        role_key, content_key = "from", "value"
    if role_key not in turn:
        raise DataError(f"{where}: {what} has no {role_key!r} key (its keys: {sorted(turn)}); give every turn one")
    role = turn.get(role_key)
    role = role_of.get(role, ROLE_ALIASES.get(role) if source.formatting == "messages" else None)
    if role is None:
        raise DataError(
            f"{where}: {what} has role {turn.get(role_key)!r} under {role_key!r}, not one of "
            f"{sorted(r for r in role_of if r)}; {_unknown_role_fix(turn.get(role_key), source)}"
        )
    content = turn.get(content_key)
    if turn.get(role_key) == source.tag("function_tag"):  # LLaMA-Factory's function_call turn: the assistant's calls
        return {"role": "assistant", "content": "", "tool_calls": _tool_calls_of(content, f"{where}: {what}")}
    # (tool_calls, name; not those a record's keys set to None: Arrow gives every turn each key some turn has)
    others = {key: value for key, value in turn.items() if key not in (role_key, content_key) and value is not None}
    return {**others, "role": role, "content": "" if content is None else content}


def _tool_calls_of(value, where: str) -> list[dict]:
    """A function_call turn's value (JSON text of a call {"name", "arguments"} or a list of them, as LLaMA-Factory's
    FunctionFormatter reads it) as an assistant turn's tool_calls, which the model's own template writes in the form it
    was trained to call tools in (Qwen's <tool_call> tags, Llama 3's "parameters"), not as the bare JSON."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
        calls = calls if isinstance(calls, list) else [calls]
        return [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    except (ValueError, TypeError, KeyError):
        raise DataError(
            f'{where} is a function call whose value is not JSON of {{"name": ..., "arguments": ...}} (or a list of '
            f"them): {str(value)[:80]!r}; fix the record, or tag the turn as the assistant's answer"
        ) from None


def to_conversation(record: dict, source: Source, index: int) -> tuple[list[dict], object]:
    """(messages as role/content dicts with roles user/assistant/system/tool, tools or None)."""
    where = record_where(source, index)
    if source.formatting == "alpaca":
        messages = alpaca_prompt(record, source, index)
        response = record_field(record, source.column("response"), index, source, "response")
        if not isinstance(response, str):
            raise DataError(f"{where}: the response must be text, got {type(response).__name__}")
        messages.append({"role": "assistant", "content": response})
        check_role_order(messages, where)
        return messages, None
    tools = record_tools(record, source, where)
    turns = (
        _messages_format_turns(record, source, index)
        if source.formatting == "messages"
        else record_field(record, source.column("messages"), index, source, "messages")
    )
    messages = [sharegpt_turn(turn, f"turn {turn_index}", source, where) for turn_index, turn in enumerate(turns)]
    check_role_order(messages, where)
    system = record.get(source.column("system"))
    if system and not (messages and messages[0]["role"] == "system"):  # (a system turn of its own overrides it)
        messages.insert(0, {"role": "system", "content": str(system)})
    return messages, tools


# the roles a turn may follow (None: the conversation's start), as LLaMA-Factory's converters check them, but that a
# tool turn may follow another (OpenAI-style parallel calls' results) and a user turn another (messages in a row)
FOLLOWS = {
    "system": {None},
    "user": {None, "system", "assistant", "tool", "user"},
    "assistant": {"user", "tool"},
    "tool": {"assistant", "tool"},
}


def _a(role: str) -> str:
    return f"an {role}" if role == "assistant" else f"a {role}"  # (the roles: system, user, assistant, tool)


def check_role_order(messages: list[dict], where: str) -> None:
    """Refuse, naming the turn, a conversation whose roles are out of order (a system turn after the first, an answer
    with no prompt before it or right after another answer: both trained, a tool result after no call) or that has
    an empty answer (only its end of turn trained)."""
    previous = None
    for turn, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant" and not (_content_text(message.get("content")).strip() or message.get("tool_calls")):
            raise DataError(
                f"{where}: turn {turn} is an assistant turn with no content, nothing to learn; fix or remove it"
            )
        if previous not in FOLLOWS.get(role, {previous}):  # (another role: refused where its reader names it)
            after = "at the start" if previous is None else f"after {_a(previous)} turn"
            raise DataError(f"{where}: turn {turn} is {_a(role)} turn {after}; fix the record's roles, or remove it")
        previous = role
