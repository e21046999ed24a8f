"""The measuring and preparing tools, beside the algorithms at the root: each runs from the repository's root as a
module, e.g. `python -m benchmarks.benchmark` (every script on the built-in tasks), `python -m benchmarks.memory_plan`
(memory before a GPU run) or `python -m benchmarks.prepare_smollm2` (the real chat model, offline)."""
