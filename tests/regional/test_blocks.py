"""compiler/regional/blocks.py: which modules are blocks, and which blocks share a region."""
import pytest
import torch

from kiln.compiler.regional.blocks import find_blocks, has_repeated_blocks, is_block, is_layer, regions_of, signature


class Block(torch.nn.Module):
    def __init__(self, dim: int, scale: float = 0.5):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim)
        self.scale = scale

    def forward(self, x):
        return x + self.scale * self.fc(self.norm(x))


class Stack(torch.nn.Module):
    """A block that holds a list of blocks (a SpatialTransformer of depth n)."""

    def __init__(self, dim: int, depth: int):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return x


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList([Block(16) for _ in range(4)] + [Block(16, scale=2.0)])
        self.stages = torch.nn.Sequential(Stack(16, 1), Stack(16, 3))
        self.head = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 8))


class MyLinear(torch.nn.Linear):  # a subclass of a torch layer, as ComfyUI's ops are
    pass


def test_torch_layers_and_their_subclasses_are_layers_not_blocks():
    assert is_layer(torch.nn.Linear(2, 2)) and is_layer(MyLinear(2, 2)) and not is_block(MyLinear(2, 2))
    assert is_block(Block(4)) and not is_layer(Block(4))
    assert not is_block(torch.nn.Sequential(torch.nn.ReLU()))  # no parameters


def test_blocks_are_list_elements_split_only_where_their_parts_repeat():
    paths = [path for path, _ in find_blocks(Model())]
    assert paths == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4",
                     "stages.0",                                      # depth 1: stays one block, glue included
                     "stages.1.blocks.0", "stages.1.blocks.1", "stages.1.blocks.2"]  # depth 3: split
    # the layers of `head` (a Sequential of torch layers) and `embed` are not blocks: they run as they are


def test_identical_blocks_share_a_region_and_an_attribute_or_shape_tells_them_apart():
    model = Model()
    regions = regions_of(model)
    by_name = {region.name: region.members for region, _ in regions}
    assert by_name["Block#1"] == ("blocks.0", "blocks.1", "blocks.2", "blocks.3", "stages.1.blocks.0",
                                  "stages.1.blocks.1", "stages.1.blocks.2")
    assert by_name["Block#2"] == ("blocks.4",)  # scale 2.0: its code reads another constant
    assert by_name["Stack#1"] == ("stages.0",)
    assert has_repeated_blocks(regions)
    assert signature(Block(16)) != signature(Block(32))
    assert signature(Block(16)) != signature(Block(16).half())


def test_a_model_without_block_lists_has_no_regions():
    assert regions_of(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())) == []
    single = torch.nn.ModuleList([Block(4), Block(8)])
    holder = torch.nn.Module()
    holder.blocks = single
    assert not has_repeated_blocks(regions_of(holder))


@pytest.mark.parametrize("name, classes", [
    ("sd15", {"ResnetBlock2D", "Transformer2DModel", "Downsample2D", "Upsample2D"}),
    ("sdxl", {"ResnetBlock2D", "BasicTransformerBlock", "Downsample2D", "Upsample2D"}),
    ("flux", {"FluxTransformerBlock", "FluxSingleTransformerBlock"}),
])
def test_real_architectures_are_cut_at_their_repeated_blocks(name, classes):
    from kiln.testing.models import MODELS

    with torch.device("meta"):
        model = MODELS[name].build("full", device="meta")
    regions = regions_of(model)
    assert {type(blocks[0]).__name__ for _, blocks in regions} == classes
    members = sum(len(region.members) for region, _ in regions)
    assert len(regions) < members / 2, [r.line() for r, _ in regions]  # far fewer graphs than blocks
    if name == "flux":  # 19 double and 38 single blocks: two regions
        assert len(regions) == 2 and members == 57
