"""Training beside the model: it imports `dsv4`, and nothing on the inference path imports it.

* `training.data` — the training text (the standard library's source) and its BPE;
* `training.train` — the backbone's training (next-token and indexer losses, AdamW);
* `training.dspark` — the DSpark drafter's training over a frozen backbone.
"""
