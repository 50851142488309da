"""Options: what a user or a workflow may ask of the compiler, each validated where it is declared.

`compile_options.py` (CompileOptions, the expert string), `shape_policy.py` (the `shapes` option:
pins, buckets, variant bounds), `inductor_settings.py` (the Inductor tuning settings a workflow may
change) and `option_text.py` (the one bounded reader of a workflow's JSON or YAML text).
"""
