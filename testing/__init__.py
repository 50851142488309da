"""What Kiln is tested and measured with, shipped so a user can run it too: the model zoo the tests
and benchmarks build (models.py: small diffusers architectures with random weights) and the load run,
a soak test of a running ComfyUI with Kiln's nodes (load_run.py)."""
