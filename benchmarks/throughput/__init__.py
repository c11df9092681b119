"""The shared pieces of the training-throughput benchmarks.

`batches` (synthetic padded batches and their model FLOPs), `timing` (dense
matmul peaks of TensorFlow, JAX and torch),
`memory` (resident-memory sampling) and `peers` (the systems compared, each
behind the same small interface). `benchmarks.train_throughput` is the
driver.
"""
