"""CTranslate2 loaded with a keras-transformer run's own weights (the deployment peer).

`ctranslate2_model(run_dir, out_dir, quantization)` builds a CTranslate2
`TransformerSpec` from the Keras layers: post-norm (or pre-norm) layers, ReLU
feed-forward, fused QKV and KV projections, the shared embedding also as the
output projection, the model's own sinusoid table as position encodings, and
the SentencePiece pieces as both vocabularies. CTranslate2 stores linear
weights `[out, in]`; Keras stores them `[in, out]`.

Needs `ctranslate2` (the `bench` extra), never a runtime dependency.
"""

from __future__ import annotations

import os

import numpy as np

# Rows of the position table given to CTranslate2: as many source or output
# positions as it can encode (ours compute any position).
POSITIONS = 1024


def _array(variable):
    import keras

    return np.asarray(keras.ops.convert_to_numpy(variable), np.float32)


def _linear(spec, kernel, bias):
    """Sets a CTranslate2 LinearSpec from a Keras `[in, out]` kernel."""
    spec.weight = np.ascontiguousarray(kernel.T)
    spec.bias = np.ascontiguousarray(bias)


def _norm(spec, layer):
    spec.gamma = _array(layer.gamma)
    spec.beta = _array(layer.beta)


def _projection(dense, d):
    return _array(dense.kernel).reshape(d, -1), _array(dense.bias).reshape(-1)


def _self_attention(spec, mha, norm, d):
    q, k, v = (_projection(x, d) for x in (mha.query_dense, mha.key_dense, mha.value_dense))
    _linear(
        spec.linear[0], np.concatenate([q[0], k[0], v[0]], 1), np.concatenate([q[1], k[1], v[1]])
    )
    _linear(spec.linear[1], *_output(mha, d))
    _norm(spec.layer_norm, norm)


def _cross_attention(spec, mha, norm, d):
    q, k, v = (_projection(x, d) for x in (mha.query_dense, mha.key_dense, mha.value_dense))
    _linear(spec.linear[0], *q)
    _linear(spec.linear[1], np.concatenate([k[0], v[0]], 1), np.concatenate([k[1], v[1]]))
    _linear(spec.linear[2], *_output(mha, d))
    _norm(spec.layer_norm, norm)


def _output(mha, d):
    return _array(mha.output_dense.kernel).reshape(d, d), _array(mha.output_dense.bias)


def _feed_forward(spec, ff, norm):
    _linear(spec.linear_0, _array(ff.intermediate_dense.kernel), _array(ff.intermediate_dense.bias))
    _linear(spec.linear_1, _array(ff.output_dense.kernel), _array(ff.output_dense.bias))
    _norm(spec.layer_norm, norm)


def ctranslate2_spec(model, tokenizer):
    """A validated `ctranslate2.specs.TransformerSpec` holding `model`'s weights."""
    from ctranslate2.specs import common_spec, transformer_spec

    from keras_transformer.layers.positional_embedding import sinusoid_table
    from keras_transformer.model import transformer_parts

    parts = transformer_parts(model)
    c = parts.config
    if parts.output_projection is not None or not c.tie_embeddings:
        raise ValueError(
            "Only models with one embedding for source, target and output are converted "
            "here; convert a model with separate vocabularies from its marian-hf export "
            "(--marian-hf: CTranslate2's TransformersConverter)."
        )
    for layer in parts.encoder_layers + parts.decoder_layers:
        if getattr(layer.feed_forward.activation, "__name__", "") != "relu":
            raise ValueError("Only the ReLU feed-forward of the paper is converted.")
    d = c.hidden_dim
    spec = transformer_spec.TransformerSpec.from_config(
        (c.num_encoder_layers, c.num_decoder_layers),
        c.num_heads,
        pre_norm=c.normalize_first,
        activation=common_spec.Activation.RELU,
    )
    spec.config.layer_norm_epsilon = c.layer_norm_epsilon
    embeddings = _array(parts.source_embedding.embeddings)
    table = sinusoid_table(max(POSITIONS, c.max_length), d)
    for side in (spec.encoder, spec.decoder):
        side.scale_embeddings = True
        side.position_encodings.encodings = table
    spec.encoder.embeddings[0].weight = embeddings
    spec.decoder.embeddings.weight = embeddings
    spec.decoder.projection.weight = embeddings
    spec.decoder.projection.bias = np.zeros(c.vocabulary_size, np.float32)
    if c.normalize_first:
        _norm(spec.encoder.layer_norm, parts.encoder_final_norm)
        _norm(spec.decoder.layer_norm, parts.decoder_final_norm)
    for layer_spec, layer in zip(spec.encoder.layer, parts.encoder_layers, strict=True):
        _self_attention(
            layer_spec.self_attention, layer.self_attention, layer.self_attention_norm, d
        )
        _feed_forward(layer_spec.ffn, layer.feed_forward, layer.feed_forward_norm)
    for layer_spec, layer in zip(spec.decoder.layer, parts.decoder_layers, strict=True):
        _self_attention(
            layer_spec.self_attention, layer.self_attention, layer.self_attention_norm, d
        )
        _cross_attention(layer_spec.attention, layer.cross_attention, layer.cross_attention_norm, d)
        _feed_forward(layer_spec.ffn, layer.feed_forward, layer.feed_forward_norm)
    pieces = [tokenizer.id_to_piece(i) for i in range(c.vocabulary_size)]
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = (
        pieces[3],
        pieces[1],
        pieces[2],
    )
    spec.validate()
    return spec


def ctranslate2_model(model, tokenizer, out_dir, quantization=None, vmap=None):
    """Writes a CTranslate2 model folder (`quantization`: None = float32, or "int8"),
    with the vocabulary map file `vmap` (`vmap_file`) where given."""
    spec = ctranslate2_spec(model, tokenizer)
    if vmap is not None:
        spec.register_vocabulary_mapping(vmap)
    spec.optimize(quantization=quantization)
    os.makedirs(out_dir, exist_ok=True)
    spec.save(out_dir)
    return out_dir


def vmap_file(shortlist, tokenizer, path):
    """Writes a `keras_transformer_runtime.shortlist.Shortlist` as CTranslate2's
    vocabulary map (`vmap`): per source piece, a line `piece<TAB>target pieces`,
    and the frequent pieces under the empty key (always candidates)."""
    piece = tokenizer.id_to_piece
    lines = ["\t" + " ".join(piece(int(t)) for t in shortlist.frequent)]
    for source, row in enumerate(shortlist.table):
        listed = [piece(int(t)) for t in row if t >= 0]
        if listed:
            lines.append(f"{piece(source)}\t{' '.join(listed)}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _translate_batches(translator, batches, options, parallel, full=False):
    """The first hypothesis' pieces of every sentence of `batches`, batch by batch.

    With `parallel` every batch is submitted at once (`asynchronous=True`)
    and CTranslate2's `inter_threads` workers translate them in parallel.
    With `full`, every hypothesis of a sentence instead, each as `(pieces,
    score, alignment)`: its score when `return_scores` is set and, with
    `return_attention`, the source position each token attends to most.
    """
    pending = [
        translator.translate_batch(
            batch,
            asynchronous=parallel,
            **{"max_decoding_length": max(len(s) for s in batch) + 50, **options},
        )
        for batch in batches
    ]
    found = []
    for results in pending:
        results = [result.result() if parallel else result for result in results]
        if not full:
            found.append([result.hypotheses[0] for result in results])
            continue
        found.append([_hypotheses(result, options) for result in results])
    return found


def _hypotheses(result, options):
    scores = result.scores if options.get("return_scores") else [None] * len(result.hypotheses)
    attention = result.attention if options.get("return_attention") else None
    return [
        (
            pieces,
            score,
            None if attention is None else np.argmax(attention[k], axis=-1).tolist(),
        )
        for k, (pieces, score) in enumerate(zip(result.hypotheses, scores, strict=True))
    ]


def _score_batches(translator, sources, targets):
    """Per batch, per sentence, the log-probability of each target piece (EOS last)."""
    return [
        [result.log_probs for result in translator.score_batch(source, target)]
        for source, target in zip(sources, targets, strict=True)
    ]


def _answer(translator, request):
    kind, *arguments = request
    if kind == "score":
        return _score_batches(translator, *arguments)
    return _translate_batches(translator, *arguments)


def _serve(connection, settings):
    """A process of its own that holds one CTranslate2 translator and answers requests."""
    import ctranslate2

    translator = ctranslate2.Translator(**settings)
    connection.send("ready")
    while (request := connection.recv()) is not None:
        connection.send(_answer(translator, request))


class CTranslate2Translator:
    """`translate(lines, beam_size)` with CTranslate2, on our tokenizer's pieces.

    `threads` are the intra-op threads of one batch, `parallel_batches` the
    batches translated at once (CTranslate2's `inter_threads`).

    `isolated=True` runs the translator in a process of its own, which a
    benchmark needs for every CTranslate2 system it holds: CTranslate2's
    OpenMP runtime (libgomp) cuts its spin-waiting short once a process holds
    more OpenMP threads than cores, so a second translator in the same process
    made the timed one several times slower, even after the other was deleted
    (on a 2-core AMD EPYC Zen 5: 225 against 32 greedy sentences/s at batch 1).
    Tokenizing and detokenizing stay in the caller's process either way.
    """

    def __init__(
        self,
        folder,
        tokenizer,
        compute_type="float32",
        threads=2,
        parallel_batches=1,
        isolated=False,
        use_vmap=False,
    ):
        self.tokenizer = tokenizer
        self.use_vmap = use_vmap  # the model's vocabulary map (`vmap_file`), in every search
        settings = dict(
            model_path=folder,
            device="cpu",
            compute_type=compute_type,
            intra_threads=threads,
            inter_threads=parallel_batches,
        )
        self._process = self._connection = self.translator = None
        if isolated:
            import multiprocessing

            context = multiprocessing.get_context("spawn")
            self._connection, child = context.Pipe()
            self._process = context.Process(target=_serve, args=(child, settings), daemon=True)
            self._process.start()
            child.close()
            if not self._connection.poll(300) or self._connection.recv() != "ready":
                raise RuntimeError(f"CTranslate2 did not load {folder} in its process")
        else:
            import ctranslate2

            self.translator = ctranslate2.Translator(**settings)

    def close(self):
        """Stops the translator's process, if it has one."""
        if self._process is not None:
            self._connection.send(None)
            self._process.join(30)
            self._process = None

    def translate(self, lines, beam_size=4, batch_size=32, parallel_batches=1, **decoding):
        """Batches of `batch_size` sorted by length, as `OnnxTranslator.translate` makes them;
        the batches and their length limits are the same at any `parallel_batches`.
        `decoding`: more of `translate_batch`'s arguments (`min_decoding_length`, ...)."""
        options = {"beam_size": beam_size, "length_penalty": 0.6 if beam_size > 1 else 0.0}
        options.update(decoding)
        if self.use_vmap:
            options["use_vmap"] = True
        chunks, hypotheses = self._translated(lines, options, batch_size, parallel_batches)
        outputs = [""] * len(lines)
        for chunk, pieces in zip(chunks, hypotheses, strict=True):
            for i, sentence in zip(chunk, pieces, strict=True):
                outputs[i] = self._text(sentence)
        return outputs

    def translate_hypotheses(
        self,
        lines,
        beam_size=4,
        batch_size=32,
        num_hypotheses=1,
        return_scores=False,
        return_attention=False,
        parallel_batches=1,
    ):
        """As `translate`, with CTranslate2's output options: per sentence a list of
        dicts, best first, with `text`, `score` (`return_scores`) and `alignment`
        (`return_attention`: per output token, the source position it attends
        to most, as `OnnxTranslator`'s alignment gives it)."""
        options = {
            "beam_size": beam_size,
            "length_penalty": 0.6 if beam_size > 1 else 0.0,
            "num_hypotheses": num_hypotheses,
            "return_scores": return_scores,
            "return_attention": return_attention,
        }
        chunks, found = self._translated(lines, options, batch_size, parallel_batches, True)
        outputs = [None] * len(lines)
        for chunk, sentences in zip(chunks, found, strict=True):
            for i, hypotheses in zip(chunk, sentences, strict=True):
                outputs[i] = [
                    {"text": self._text(pieces), "score": score, "alignment": alignment}
                    for pieces, score, alignment in hypotheses
                ]
        return outputs

    def score(self, sources, targets, batch_size=32):
        """Forced decoding with `score_batch`: per pair a dict of `log_prob` (summed,
        EOS included) and `token_scores`, in batches sorted by source length."""
        sources = self._sources(sources)
        targets = [self.tokenizer.pieces(self.tokenizer.encode_target(line)) for line in targets]
        chunks = self._chunks(sources, batch_size)
        request = (
            "score",
            [[sources[i] for i in chunk] for chunk in chunks],
            [[targets[i] for i in chunk] for chunk in chunks],
        )
        found = self._request(request)
        outputs = [None] * len(sources)
        for chunk, steps in zip(chunks, found, strict=True):
            for i, scores in zip(chunk, steps, strict=True):
                outputs[i] = {"log_prob": float(sum(scores)), "token_scores": list(scores)}
        return outputs

    def _sources(self, lines):
        eos = self.tokenizer.id_to_piece(2)
        return [self.tokenizer.pieces(self.tokenizer.encode(line)) + [eos] for line in lines]

    @staticmethod
    def _chunks(sources, batch_size):
        order = np.argsort([len(s) for s in sources], kind="stable")
        return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]

    def _translated(self, lines, options, batch_size, parallel_batches, full=False):
        sources = self._sources(lines)
        chunks = self._chunks(sources, batch_size)
        batches = [[sources[i] for i in chunk] for chunk in chunks]
        return chunks, self._request(("translate", batches, options, parallel_batches > 1, full))

    def _request(self, request):
        if self._process is not None:
            self._connection.send(request)
            return self._connection.recv()
        return _answer(self.translator, request)

    def _text(self, pieces):
        return self.tokenizer.decode([self.tokenizer.piece_to_id(piece) for piece in pieces])
