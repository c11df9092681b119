"""Data: the built-in toy corpus, tokenizers and tf.data pipelines."""
