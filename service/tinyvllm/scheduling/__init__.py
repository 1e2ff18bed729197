"""Torch-free scheduling: requests, the token-budget scheduler, the KV block bookkeeping and the
speculation policy. It produces each step's `SchedulerOutput` as plain data for the workers and
never imports `engine/` or `worker/`."""
