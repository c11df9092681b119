"""Train the tiny preset on the built-in toy corpus with model.fit, then translate with beam search.

python examples/fit_and_translate.py --epochs 5
"""

import argparse

import keras

import keras_transformer as kt
from keras_transformer.data.toy import WordVocabulary, encode_pairs, generate_toy_corpus
from keras_transformer.decoding import beam_search

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--num-train", type=int, default=10000)
args = parser.parse_args()

keras.utils.set_random_seed(0)
corpus = generate_toy_corpus(num_train=args.num_train, num_valid=200, num_test=10, max_words=8)
vocabulary = WordVocabulary.from_corpus(corpus)
config = kt.TransformerConfig.from_preset("tiny")
x_train, y_train = encode_pairs(corpus.train, vocabulary, config.max_length)
x_valid, y_valid = encode_pairs(corpus.valid, vocabulary, config.max_length)

model = kt.build_transformer(config)
model.compile(
    optimizer=kt.transformer_optimizer(config.hidden_dim, warmup_steps=1000),
    loss=kt.LabelSmoothedCrossEntropy(0.1),
    metrics=[kt.MaskedAccuracy()],
)
model.fit(x_train, y_train, validation_data=(x_valid, y_valid), batch_size=64, epochs=args.epochs)

sources = [vocabulary.encode(s) + [vocabulary.eos_id] for s, _ in corpus.test]
tokens, scores = beam_search(model, sources, beam_size=4)
for (source, reference), ids, score in zip(corpus.test, tokens, scores, strict=True):
    print(f"{source}\n  -> {vocabulary.decode(ids)}  (score {score:.3f}; reference: {reference})")
