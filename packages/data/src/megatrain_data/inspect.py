"""What training reads, shown: `megatrain data` prints the first rows (or DPO pairs) a run trains on, as JSON lines
of ids and labels in the Hugging Face convention, or decoded with each trained span between ⟦ and ⟧."""

import json

from .prompts import given_completions, rows_of


def hf_labels(batch, row: int) -> list[int]:
    """Labels of a row in the Hugging Face convention: labels[t] = input_ids[t] where token t is trained
    (the engine's labels are shifted: its label at t - 1 is the target token t)."""
    ids, shifted = batch.input_ids[row].tolist(), batch.labels[row].tolist()
    return [-100] + [ids[t] if shifted[t - 1] != -100 else -100 for t in range(1, len(ids))]


def marked_text(tokenizer, ids: list[int], labels: list[int]) -> str:
    """The decoded row with each trained span between ⟦ and ⟧."""
    pieces, run, trained = [], [], None
    for token, label in zip(ids, labels):
        if (label != -100) != trained and run:
            pieces.append(("⟦{}⟧" if trained else "{}").format(tokenizer.decode(run, skip_special_tokens=False)))
            run = []
        trained = label != -100
        run.append(token)
    if run:
        pieces.append(("⟦{}⟧" if trained else "{}").format(tokenizer.decode(run, skip_special_tokens=False)))
    return "".join(pieces)


def marked_media_text(tokenizer, ids: list[int], labels: list[int], placeholders: dict[int, str]) -> str:
    """`marked_text` with each run of N image (video) placeholder tokens shown as <image x N> (<video x N>)."""
    pieces, start = [], 0
    while start < len(ids):
        end = start
        if ids[start] in placeholders:
            while end < len(ids) and ids[end] == ids[start]:
                end += 1
            pieces.append(f"<{placeholders[ids[start]]} x {end - start}>")
        else:
            while end < len(ids) and ids[end] not in placeholders:
                end += 1
            pieces.append(marked_text(tokenizer, ids[start:end], labels[start:end]))
        start = end
    return "".join(pieces)


def pair_record(batch, pair: int) -> dict:
    """Pair `pair` of a batch of pairs (rows 2 * pair, 2 * pair + 1) as TRL tokenizes one: the prompt's ids, then
    each sequence's ids and labels in the Hugging Face convention (see `hf_labels`), padding left out."""
    record = {}
    for name, row in (("chosen", 2 * pair), ("rejected", 2 * pair + 1)):
        length = int(batch.valid[row].sum())
        record[f"{name}_input_ids"] = batch.input_ids[row, :length].tolist()
        record[f"{name}_labels"] = hf_labels(batch, row)[:length]
    labels = record["chosen_labels"]
    prompt_length = next((t for t, label in enumerate(labels) if label != -100), len(labels))
    return {"prompt": record["chosen_input_ids"][:prompt_length], **record}


def dump_pairs(windows, count: int, tokenizer) -> None:
    """The first `count` pairs training draws: JSON lines (`pair_record`), or with a tokenizer, decoded text."""
    shown, step = 0, 0
    while shown < count:
        batch = windows.batch(step)
        for pair in range(min(len(batch.input_ids) // 2, count - shown)):
            record = pair_record(batch, pair)
            if tokenizer is None:
                print(json.dumps(record))
            else:
                print(f"--- pair {shown} (step {step}, pair {pair}); trained spans in ⟦ ⟧")
                for name in ("chosen", "rejected"):
                    ids, labels = record[f"{name}_input_ids"], record[f"{name}_labels"]
                    print(f"{name}:\n{marked_text(tokenizer, ids, labels)}")
            shown += 1
        step += 1


def dump_rows(windows, count: int, tokenizer, placeholders: dict[int, str]) -> None:
    """The first `count` rows training draws from `windows`: JSON lines of ids and labels (and position ids where
    documents are packed), or with a tokenizer, decoded text (`marked_media_text`)."""
    shown, step = 0, 0
    while shown < count:
        batch = windows.batch(step)
        for row in range(len(batch.input_ids)):
            if shown == count:
                break
            ids, labels = batch.input_ids[row].tolist(), hf_labels(batch, row)
            if tokenizer is not None:
                length = len(ids) if batch.valid is None else int(batch.valid[row].sum())  # (padding left out)
                padding = f", then {len(ids) - length} padding tokens" if length < len(ids) else ""
                print(f"--- sequence {shown} (step {step}, row {row}{padding}); trained spans in ⟦ ⟧")
                print(marked_media_text(tokenizer, ids[:length], labels[:length], placeholders))
            else:
                record = {"input_ids": ids, "labels": labels}
                if batch.position_ids is not None:
                    record["position_ids"] = batch.position_ids[row].tolist()
                print(json.dumps(record))
            shown += 1
        step += 1


class _OneBatch:
    """One batch's rows as `dump_rows` draws them."""

    def __init__(self, batch):
        self.rows = batch

    def batch(self, step: int):
        return self.rows


def dump_given(path, num_generations: int, template, tokenizer, count: int, seq_len: int, pad_id: int, text: bool):
    """The first `count` rows of a rollouts file (train.grpo.rollouts) as GRPO trains them: the prompt rendered, then
    the completion's tokens, the trained span (`dump_rows`; decoded where `text`)."""
    _, prompts, completions = given_completions(path, num_generations, template, tokenizer)
    batch = rows_of(prompts[:count], completions[:count], seq_len, pad_id)
    dump_rows(_OneBatch(batch), min(count, len(prompts)), tokenizer if text else None, {})


def dump_prompts(prompts, count: int, tokenizer) -> None:
    """The first `count` of GRPO's prompts (`prompts.Prompts`) as the model sees them (rendered, tokenized), with
    their reward columns: JSON lines of ids, or with a tokenizer, decoded text."""
    for index in range(min(count, len(prompts.ids))):
        columns = {name: values[index] for name, values in prompts.columns.items()}
        if tokenizer is None:
            print(json.dumps({"input_ids": prompts.ids[index], **columns}))
        else:
            text = tokenizer.decode(prompts.ids[index], skip_special_tokens=False)
            print(f"--- prompt {index} {json.dumps(columns)}\n{text}")
