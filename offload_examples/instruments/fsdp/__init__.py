"""What the FSDP scenario (:mod:`offload_examples.scenarios.fsdp`) measures and reports, kept apart from
its training loop: its sizes and options (:mod:`~offload_examples.instruments.fsdp.config`), each rank's
runs (:mod:`~offload_examples.instruments.fsdp.measure`), one profiled step's streams
(:mod:`~offload_examples.instruments.fsdp.trace`), the report
(:mod:`~offload_examples.instruments.fsdp.report`) and the command line
(:mod:`~offload_examples.instruments.fsdp.cli`)."""
