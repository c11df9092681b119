"""The server's model: one translator per worker, the tokenizer, and the search of a batch."""

from __future__ import annotations

from keras_transformer_runtime.constraints import word_continuations
from keras_transformer_runtime.export_format import ExportFileError
from keras_transformer_runtime.onnx_translator import OnnxTranslator
from keras_transformer_runtime.options import SearchOptions
from keras_transformer_runtime.search import hypothesis_records
from keras_transformer_runtime.specials import EOS_ID
from keras_transformer_runtime.tag_placement import sentence_links
from keras_transformer_runtime.text_batches import text_source


class Engine:
    """The translators of the workers, and the tokenizer; `run_batch` searches one batch.

    Args:
        onnx_dir, precision, providers, shortlist: as for `OnnxTranslator`.
        workers: translators (each with its own sessions), one per worker.
        threads: intra-op threads of each.
    """

    def __init__(
        self, onnx_dir, workers, threads, precision="float32", providers=None, shortlist=None
    ):
        self.translators = [
            OnnxTranslator(
                onnx_dir,
                providers=providers,
                num_threads=threads,
                precision=precision,
                shortlist=shortlist,
            )
            for _ in range(workers)
        ]
        first = self.translators[0]
        if first.tokenizer is None:
            raise ExportFileError(f"The export in {onnx_dir} has no tokenizer file.")
        self.tokenizer = first.tokenizer
        self.max_length = first.max_length
        self.continuations = word_continuations(self.tokenizer)  # for constraints
        self.vocabulary_size = first.vocabulary_size
        self.provider = first.provider

    def documents(self, texts, input_format, language, max_input_length):
        """The `documents.Document`s of `texts` (`Translator.documents`)."""
        return self.translators[0].documents(texts, input_format, language, max_input_length)

    def encode(self, text, max_input_length=None):
        """Token ids of `text` with EOS (none for an empty or whitespace-only text), and
        whether they were cut to `max_input_length`."""
        ids, length = text_source(text, self.tokenizer.encode, max_input_length)
        return ids, length > len(ids)

    def run_batch(self, worker, options, sentences):
        """Searches `sentences` (`(source ids, prefix ids, index in its request,
        constraints, text)` each; `text` None, or the sentence's text when its
        inline tags need the word links of its translation) under `options` on
        worker `worker`'s translator: per sentence its hypothesis records
        (`search.hypothesis_records`), best first, the first with `"links"`
        (`tag_placement.sentence_links`) where a text was given."""
        translator = self.translators[worker]
        sources, prefixes, indices, constraints, texts = (
            list(column) for column in zip(*sentences, strict=True)
        )
        tagged = any(text is not None for text in texts)
        found, weights = translator.search_with_weights(
            sources,
            options,
            prefixes if any(prefixes) else None,
            indices,
            constraints if any(map(len, constraints)) else None,
            weights=tagged,  # the alignment weights of the search, where it returns them
        )
        decode = translator.tokenizer.decode
        records = [hypothesis_records(hypotheses, decode) for hypotheses in found]
        if tagged:
            links = sentence_links(
                translator,
                [text or "" for text in texts],
                [h[0].tokens for h in found],
                sources,
                [row[0] for row in weights],
            )
            for rows, text, row_links in zip(records, texts, links, strict=True):
                if text is not None:
                    rows[0]["links"] = row_links  # for the page's tags; never answered
        return records

    def empty_result(self, options):
        """What a search of an empty source gives (no model call)."""
        return hypothesis_records(
            self.translators[0].search([[]], options)[0], self.tokenizer.decode
        )

    def warm_up(self, batch_sentences):
        """Loads every search graph's session and the split search's copies before serving."""
        source = self.encode("a a a")[0] or [EOS_ID]
        sentences = [(source, [], i, [], None) for i in range(max(batch_sentences, 1))]
        for worker in range(len(self.translators)):
            for beam_size in (1, SearchOptions().beam_size):
                options = SearchOptions(beam_size=beam_size, max_length=2)
                self.run_batch(worker, options, sentences)
                self.run_batch(worker, options, sentences[:1])
