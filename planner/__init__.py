"""The memory planner beside the model: per-chip bytes of a slice, without devices.

* `planner.plan` — weights, KV pages and activations per chip (``dsv4 plan``);
* `planner.compiled_step` — XLA's memory of the sharded paged step, compiled deviceless.

It imports `dsv4`; only the CLI's ``dsv4 plan`` command imports it from the serving side.
"""
