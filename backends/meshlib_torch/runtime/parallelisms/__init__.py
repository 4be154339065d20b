"""One file per parallelism, each a step of `runtime.parallelize`: data, zero, tensor, pipeline."""
