"""The measuring and teaching instruments: timing, memory, timelines, reports, plots, the models
the scenarios run, the benchmark, the checked command-line values and the notebook runner."""
