"""The backend: what TorchDynamo hands a captured graph to, and how a rewritten graph is lowered.

`dynamo_backend.py` (KilnBackend: passes, lowering, records, the call guard's eager fallback) and
`lowering.py` (one Lowering per mode: FX as captured, Inductor, Inductor with max-autotune).
"""
