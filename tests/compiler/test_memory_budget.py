"""compiler/memory_budget.py: the memory verdict from injected sizes (no device, no host)."""
import pytest
import torch

from kiln.compiler import BlockWeights, DeviceMemory, MemoryVerdict, memory_verdict
from kiln.compiler.memory_budget import GIB

CAP = 16 * GIB
INFERENCE = int(0.8 * GIB)


def memory(model, resident, free, cap=CAP, inference=INFERENCE):
    return DeviceMemory(model_bytes=int(model), resident_bytes=int(resident), free_bytes=int(free), cap_bytes=int(cap),
                        inference_bytes=int(inference))


def test_a_model_loaded_whole_with_room_for_a_recording_holds_nothing_back():
    verdict = memory_verdict(memory(model=5 * GIB, resident=5 * GIB, free=10 * GIB))
    assert verdict == MemoryVerdict(fits=True) and not verdict.holds_back and verdict.why == ""


def test_a_model_loaded_whole_without_room_for_a_recording_compiles_but_records_no_cuda_graph():
    verdict = memory_verdict(memory(model=15 * GIB, resident=15 * GIB, free=int(0.5 * GIB)))
    assert verdict.fits and not verdict.cuda_graphs and verdict.eager_blocks == ()
    assert "0.50 GiB free of a 16.00 GiB cap" in verdict.why and "every block compiles" in verdict.why


def test_flux_under_a_16_gib_cap_keeps_its_streamed_blocks_eager_and_names_the_numbers():
    # Flux-dev bf16: 19 double blocks of ~0.63 GiB and 38 single blocks of ~0.27 GiB (about 22.2 GiB in blocks)
    doubles = [BlockWeights(f"double_blocks.{i}", int(0.63 * GIB), 0) for i in range(19)]
    singles = [BlockWeights(f"single_blocks.{i}", int(0.27 * GIB), int(0.27 * GIB) if i >= 10 else 0)
               for i in range(38)]
    resident = 23.8 * GIB - 28 * 0.27 * GIB
    verdict = memory_verdict(memory(model=23.8 * GIB, resident=resident, free=0.9 * GIB), doubles + singles)
    assert not verdict.fits and not verdict.cuda_graphs
    assert verdict.eager_blocks == tuple(f"single_blocks.{i}" for i in range(10, 38))
    assert "model 23.80 GiB" in verdict.why and "0.90 GiB free of a 16.00 GiB cap" in verdict.why
    assert "28 of 57 blocks" in verdict.why and "the 29 resident ones compile as usual" in verdict.why


def test_a_partly_loaded_model_whose_streamed_layers_lie_outside_blocks_keeps_every_block_compiled():
    blocks = [BlockWeights(f"blocks.{i}", GIB, 0) for i in range(4)]
    verdict = memory_verdict(memory(model=5 * GIB, resident=4 * GIB, free=GIB), blocks)
    assert not verdict.fits and verdict.eager_blocks == () and not verdict.cuda_graphs
    assert "0 of 4 blocks" in verdict.why


def test_a_predicted_partial_load_without_blocks_says_what_would_stream():
    verdict = memory_verdict(memory(model=24 * GIB, resident=14 * GIB, free=GIB))
    assert not verdict.fits and verdict.eager_blocks == () and not verdict.cuda_graphs
    assert "loads 10.00 GiB less than the model" in verdict.why


@pytest.mark.parametrize("field", ["model_bytes", "resident_bytes", "free_bytes", "cap_bytes", "inference_bytes"])
def test_negative_sizes_are_refused_naming_the_field(field):
    sizes = {**dict(model_bytes=1, resident_bytes=1, free_bytes=1, cap_bytes=1, inference_bytes=1), field: -1}
    with pytest.raises(ValueError, match=field):
        DeviceMemory(**sizes)


def test_a_block_streaming_more_than_it_holds_is_refused_naming_it():
    with pytest.raises(ValueError, match="block blocks.3"):
        BlockWeights("blocks.3", 10, 11)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x)) + x


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_kiln_model_runs_the_blocks_a_verdict_names_eagerly_and_the_others_compiled():
    from kiln.compiler import CompileOptions, compile, stats

    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(2, 8)
    want = model(x)
    compiled = compile(model, CompileOptions(mode="fast", measure_regions=False))
    assert [path for path, _ in compiled.blocks()] == ["blocks.0", "blocks.1", "blocks.2"]
    compiled.use_memory(MemoryVerdict(fits=False, eager_blocks=("blocks.1",), cuda_graphs=False, why="streamed: blocks.1"))
    entered = []
    hook = model.blocks[1].register_forward_pre_hook(lambda module, args: entered.append(module))
    assert torch.allclose(compiled(x), want, atol=1e-6)
    hook.remove()
    assert entered == [model.blocks[1]]   # its own forward ran (a routed block runs its region's code instead)
    info = stats(compiled)
    assert info.compile_count >= 1 and info.fallback is None
    assert info.memory.eager_blocks == ("blocks.1",) and "memory: streamed: blocks.1" in info.warnings
    assert "memory: streamed: blocks.1" in info.summary()


def test_a_model_compiled_whole_keeps_its_graph_under_a_partial_load_and_says_so():
    from kiln.compiler import CompileOptions, compile, stats
    from kiln.compiler.model import WHOLE_PARTLY_LOADED

    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(2, 8)
    compiled = compile(model, CompileOptions(mode="fast", compile_unit="whole"))
    compiled.use_memory(MemoryVerdict(fits=False, eager_blocks=("blocks.1",), cuda_graphs=False, why="streamed"))
    assert torch.allclose(compiled(x), model(x), atol=1e-6)
    info = stats(compiled)
    assert info.compile_count == 1 and WHOLE_PARTLY_LOADED in info.warnings
