"""What `megatrain data` shows of a batch: labels in the Hugging Face convention and the trained spans marked."""

import torch

from megatrain_data import Batch
from megatrain_data.inspect import hf_labels, marked_media_text, marked_text, pair_record


class Letters:
    """A tokenizer whose token t decodes to the t-th letter."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)


def test_labels_shift_back_to_the_hugging_face_convention_and_trained_spans_are_marked():
    ids = torch.tensor([[0, 1, 2, 3]])
    shifted = torch.tensor([[-100, 2, 3, -100]])  # the engine's: the label at t - 1 is token t's target
    labels = hf_labels(Batch(ids, shifted), 0)
    assert labels == [-100, -100, 2, 3]
    assert marked_text(Letters(), ids[0].tolist(), labels) == "ab⟦cd⟧"
    assert marked_media_text(Letters(), [0, 7, 7, 7, 1], [-100] * 4 + [1], {7: "image"}) == "a<image x 3>⟦b⟧"


def test_a_pair_is_shown_as_trl_tokenizes_it_without_its_padding():
    ids = torch.tensor([[0, 1, 2, 9], [0, 1, 3, 4]])
    shifted = torch.tensor([[-100, 2, -100, -100], [-100, 3, 4, -100]])
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    record = pair_record(Batch(ids, shifted, valid=valid), 0)
    assert record == {
        "prompt": [0, 1],
        "chosen_input_ids": [0, 1, 2],
        "chosen_labels": [-100, -100, 2],
        "rejected_input_ids": [0, 1, 3, 4],
        "rejected_labels": [-100, -100, 3, 4],
    }
