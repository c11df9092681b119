import numpy as np
import pytest

from keras_transformer.data.toy import WordVocabulary, encode_pairs, generate_toy_corpus


def test_corpus_is_deterministic_and_held_out_is_unseen():
    a = generate_toy_corpus(num_train=300, num_valid=50, num_test=50, seed=3)
    b = generate_toy_corpus(num_train=300, num_valid=50, num_test=50, seed=3)
    assert a.train == b.train and a.test == b.test
    assert a.train != generate_toy_corpus(num_train=300, num_valid=50, num_test=50, seed=4).train
    train_sources = {s for s, _ in a.train}
    assert not train_sources & {s for s, _ in a.test}
    assert not train_sources & {s for s, _ in a.valid}


def test_mapping_reorders_and_rewrites():
    corpus = generate_toy_corpus(num_train=200, num_valid=10, num_test=10, seed=0)
    one_to_two = [w for w, t in corpus.table.items() if len(t) == 2]
    assert one_to_two, "some words must translate into two words"
    source = " ".join(list(corpus.table)[:3])
    target = corpus.translate(source).split()
    last = corpus.table[source.split()[-1]]
    assert target[: len(last)] == last  # reversed order
    assert all(t == corpus.translate(s) for s, t in corpus.train)
    assert any(len(t.split()) > len(s.split()) for s, t in corpus.train)


def test_encode_pairs_shift_and_padding():
    corpus = generate_toy_corpus(num_train=20, num_valid=2, num_test=2, seed=0)
    vocab = WordVocabulary.from_corpus(corpus)
    x, labels = encode_pairs(corpus.train[:4], vocab, max_length=48)
    assert x["source_ids"].dtype == np.int32 and labels.dtype == np.int32
    for i, (source, target) in enumerate(corpus.train[:4]):
        n = len(target.split())
        assert x["target_ids"][i, 0] == vocab.bos_id
        np.testing.assert_array_equal(x["target_ids"][i, 1 : n + 1], labels[i, :n])
        assert labels[i, n] == vocab.eos_id and (labels[i, n + 1 :] == 0).all()
        assert vocab.decode(labels[i]) == target
        assert vocab.decode(x["source_ids"][i]) == source
    with pytest.raises(ValueError, match="max_length=3"):
        encode_pairs(corpus.train[:4], vocab, max_length=3)
