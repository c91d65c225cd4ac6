"""The long-context scenario's instruments: the LoRA-tuned Llama and its chunked loss
(:mod:`~offload_examples.instruments.long_context.model`), a step's device memory on a GPU and on a CPU
(:mod:`~offload_examples.instruments.long_context.memory`), the search for the longest sequence
(:mod:`~offload_examples.instruments.long_context.search`) and the strategies it compares
(:mod:`~offload_examples.instruments.long_context.strategies`)."""
