"""Tensor parallelism: which part of each layer a rank holds (``shard``), and the process
group its all-reduces and all-gathers run on (``group``)."""
