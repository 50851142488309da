"""The step cache: skipping the model calls of a sampling run that would change almost nothing.

`decision.py` (StepCache: the per-run skip decision, its options and report), `step_cached_model.py`
(a compiled or eager model behind that decision) and `first_block_probe.py` (method first_block's
observer of the model's first block). The decision is made outside any compiled graph.
"""
