"""Plumbing a learner can skip: several processes (dist), a run's checkpoint and logs (run_state), loading models and
the built-in model's cache (models), the Hugging Face hub (hub) and argument checks (checks). A script calls each by its
module's name (`dist.shard(...)`, `run_state.Checkpoint(...)`), so that plumbing reads as plumbing at the call site."""
