"""The special token ids and the rule that turns generated ids into visible ones.

Training, the Keras decoder, the ONNX export and this runtime all use these
ids; this is their one definition (pure Python, so the TensorFlow side and
the TensorFlow-free runtime both import it).
"""

from __future__ import annotations

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
# The pieces of the special ids, in id order (the first lines of a `vocab.txt`).
SPECIAL_PIECES = ("<pad>", "<s>", "</s>", "<unk>")


def visible_ids(ids) -> list[int]:
    """The ids to detokenize: stop at the first EOS, skip padding and BOS.

    >>> visible_ids([1, 7, 0, 8, 2, 9])
    [7, 8]
    """
    kept = []
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            break
        if i not in (PAD_ID, BOS_ID):
            kept.append(i)
    return kept
