"""A byte-level Transformer LM with loopkit: FSDP + tensor parallelism, on a CPU or a TPU slice."""
