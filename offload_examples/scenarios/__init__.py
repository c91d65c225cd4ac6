"""Runnable scenarios, one module each; ``python -m offload_examples <name>`` runs one."""

SCENARIOS = {
    "basic": "offload_examples.scenarios.basic",
    "pipeline": "offload_examples.scenarios.pipeline",
    "pipeline-dist": "offload_examples.scenarios.pipeline_dist",
    "cuda-graphs": "offload_examples.scenarios.cuda_graphs",
    "weight-streaming": "offload_examples.scenarios.weight_streaming",
    "optimizer-offload": "offload_examples.scenarios.optimizer_offload",
    "fsdp": "offload_examples.scenarios.fsdp",
    "long-context": "offload_examples.scenarios.long_context",
}
