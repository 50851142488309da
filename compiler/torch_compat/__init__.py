"""Every private or version-dependent torch API Kiln touches, in one package, split by what it wraps.

If a torch release moves one of these, this package is the only place to change. Each helper says
which torch versions it was checked against: `versions.py` (the torch Kiln needs), `dynamo.py`
(TorchDynamo), `fx_graphs.py` (captured FX graphs), `inductor.py` (Inductor), `cuda_graph_trees.py`
(torch's CUDA graph trees), `module_calls.py` (routing and observing nn.Module calls), `cuda_timing.py`
(a spin kernel for timing the GPU's own work) and `sdpa_backends.py` (SDPA's backends called one by one).
"""
