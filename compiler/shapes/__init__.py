"""Shapes: one compiled graph serving many input shapes, and how many CUDA graphs those shapes record.

`inputs.py` (what is marked dynamic before a call, the call's inputs made dense, shape signatures),
`shape_manager.py` (a graph's variants per shape signature: compiled, reused, specialised) and
`cuda_graph_budget.py` (`shapes.max_cuda_graphs`: which input shapes may record). The policy that
says which shapes specialise is an option: compiler/options/shape_policy.py.
"""
