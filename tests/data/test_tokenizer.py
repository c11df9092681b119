import gzip

import numpy as np
import pytest

from keras_transformer.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    SentencePieceTokenizer,
    train_sentencepiece,
)

TRAINING_TEXT = [
    "A dog runs across the green field.",
    "Ein Hund läuft über die grüne Wiese.",
    "Two children are playing with a red ball near the water.",
    "Zwei Kinder spielen mit einem roten Ball am Wasser.",
    "A man in a blue shirt is cooking dinner for his family.",
    "Ein Mann in einem blauen Hemd kocht das Abendessen für seine Familie.",
    "Une femme lit un livre à côté de la fenêtre.",
] * 40

VARIED_TEXT = [
    "Ein Hund läuft über die grüne Wiese.",
    "Crème brûlée, façade, naïve, Øresund, Łódź, ß.",
    "日本語のテキストと中文文本",  # CJK never seen in training: byte fallback
    "Emoji 🙂🐕‍🦺 and flags 🇩🇪 stay intact",
    "  leading, double  and trailing spaces  ",
    "tabs\tinside\tand \u00a0no-break\u2009thin spaces",
    "UPPER lower MiXeD 12345 3.14 -7%",
    "",
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_sentencepiece(TRAINING_TEXT, vocabulary_size=400)


def test_special_ids_are_fixed(tokenizer):
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (0, 1, 2, 3)
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert tokenizer.id_to_piece(BOS_ID) == "<s>" and tokenizer.id_to_piece(EOS_ID) == "</s>"
    assert 300 <= tokenizer.vocabulary_size <= 400


@pytest.mark.parametrize("text", VARIED_TEXT)
def test_round_trip_restores_the_text_exactly(tokenizer, text):
    ids = tokenizer.encode(text)
    assert UNK_ID not in ids  # unseen characters become bytes, not <unk>
    assert tokenizer.decode(ids) == text


def test_decode_skips_bos_and_padding_and_stops_at_eos(tokenizer):
    ids = tokenizer.encode("A dog runs.")
    other = tokenizer.encode("Wiese")
    assert tokenizer.decode([BOS_ID, *ids, EOS_ID, *other, PAD_ID]) == "A dog runs."


def test_tensorflow_text_ids_equal_sentencepiece_ids(tokenizer):
    import tensorflow as tf

    texts = VARIED_TEXT + TRAINING_TEXT[:7]
    ragged = tokenizer.tf_tokenizer().tokenize(tf.constant(texts))
    assert ragged.dtype == tf.int32
    assert ragged.to_list() == [tokenizer.encode(t) for t in texts]
    # And inside a tf.data map, as the pipeline uses it.
    tf_tok = tokenizer.tf_tokenizer()
    dataset = tf.data.Dataset.from_tensor_slices(texts).map(tf_tok.tokenize)
    assert [x.numpy().tolist() for x in dataset] == [tokenizer.encode(t) for t in texts]


def test_save_and_load_give_the_same_ids(tokenizer, tmp_path):
    path = str(tmp_path / "spm.model")
    tokenizer.save(path)
    loaded = SentencePieceTokenizer.load(path)
    for text in VARIED_TEXT:
        assert loaded.encode(text) == tokenizer.encode(text)


def test_joint_vocabulary_covers_both_languages(tokenizer):
    pieces = {tokenizer.id_to_piece(i) for i in range(tokenizer.vocabulary_size)}
    # German-only characters and English-only letter pairs share one model.
    assert {"ü", "ä", "th"} <= pieces


def test_training_is_deterministic():
    a = train_sentencepiece(TRAINING_TEXT, vocabulary_size=350, seed=3)
    b = train_sentencepiece(TRAINING_TEXT, vocabulary_size=350, seed=3)
    assert a.model_proto == b.model_proto


def test_bad_arguments_and_files(tmp_path):
    with pytest.raises(ValueError, match="vocabulary_size must be at least 300"):
        train_sentencepiece(TRAINING_TEXT, vocabulary_size=100)
    with pytest.raises(ValueError, match="model_type"):
        train_sentencepiece(TRAINING_TEXT, model_type="word-piece")
    with pytest.raises(ValueError, match="no non-empty sentences"):
        train_sentencepiece(["", "  "])
    with pytest.raises(FileNotFoundError, match="missing.model"):
        SentencePieceTokenizer.load(str(tmp_path / "missing.model"))
    corrupt = tmp_path / "corrupt.model"
    corrupt.write_bytes(gzip.compress(b"not a model"))
    with pytest.raises(ValueError, match="corrupt.model"):
        SentencePieceTokenizer.load(str(corrupt))


def test_vocabulary_size_is_an_upper_bound_on_small_text():
    tokenizer = train_sentencepiece(["ab ba", "ba ab"] * 10, vocabulary_size=2000)
    assert 260 < tokenizer.vocabulary_size < 2000  # specials + bytes + a few pieces
    assert tokenizer.decode(tokenizer.encode("ab ba ab")) == "ab ba ab"
    assert np.all(np.asarray(tokenizer.encode("ab ba")) < tokenizer.vocabulary_size)
