"""The shapes option: which signatures get static variants, and how many are kept."""
import pytest
import yaml

from kiln.compiler import OptionsError, build_options
from kiln.compiler.options.option_text import MAX_TEXT_CHARS
from kiln.compiler.options.shape_policy import (LATENT_FACTOR, MAX_KEPT, MAX_SIZE, PinnedShape, ShapePolicy, ShapePolicyError,
                                        bucket_table, parse_pins)


def test_default_specialises_nothing_and_knows_the_common_resolutions():
    policy = build_options("balanced").compile.shapes
    assert policy.specialize == "none" and policy.max_variants == 8 and policy.max_cuda_graphs == 8
    assert build_options("fast", advanced="shapes: {max_cuda_graphs: 3}").compile.shapes.max_cuda_graphs == 3
    assert (1024, 1024) in policy.buckets and (512, 512) in policy.buckets and (832, 1216) in policy.buckets
    assert not policy.wants_specialised((128, 128), 2, 2)
    assert set(bucket_table()) == {"sd15", "sdxl", "flux"}


def test_buckets_match_latent_sizes():
    policy = build_options("max", advanced="shapes: {specialize: buckets, buckets: [sdxl]}").compile.shapes
    assert policy.wants_specialised((128, 128), 2, 2)        # 1024x1024
    assert policy.wants_specialised((152, 104), 2, 2)        # 832 wide x 1216 high
    assert not policy.wants_specialised((152, 104), 4, 2)    # at another batch: the dynamic graph
    assert not policy.wants_specialised((64, 64), 2, 2)      # 512x512 is not an SDXL bucket here
    assert not policy.wants_specialised((63, 64), 2, 2)      # 512x504: odd sizes run on the dynamic graph


def test_pins_parse_and_imply_pinned_specialisation():
    assert parse_pins("1024x1024, 832x1216:2") == (PinnedShape(1024, 1024, None), PinnedShape(832, 1216, 2))
    policy = build_options("balanced", advanced='shapes: {pin: ["512x768:4"]}').compile.shapes
    assert policy.specialize == "pinned"
    assert policy.wants_specialised((96, 64), 4, 2) and not policy.wants_specialised((96, 64), 2, 2)
    unbatched = ShapePolicy().with_pins("512x512")
    assert unbatched.wants_specialised((64, 64), 2, 2) and not unbatched.wants_specialised((64, 64), 4, 2)


@pytest.mark.parametrize("advanced, message", [
    ("shapes: {pin: 1024x1001}", "multiples of 8"),
    ("shapes: {pin: big}", "not a shape"),
    ("shapes: {specialize: always}", "use one of none, pinned, buckets"),
    ("shapes: {buckets: [sd9]}", "unknown bucket list 'sd9'"),
    ("shapes: {max_variants: 0}", "max_variants=0"),
    ("shapes: {max_cuda_graphs: -1}", "max_cuda_graphs=-1"),
    ("shapes: {specialise: buckets}", "unknown key(s) 'specialise'"),
])
def test_bad_shape_options_name_the_problem(advanced, message):
    with pytest.raises(OptionsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_options("balanced", advanced=advanced).compile


def test_fast_mode_refuses_specialisation():
    with pytest.raises(OptionsError, match="no effect in mode 'fast'"):
        build_options("fast", advanced="shapes: {specialize: buckets}").compile
    with pytest.raises(ShapePolicyError, match="not a shape"):
        ShapePolicy().with_pins("1024 by 1024")


@pytest.mark.parametrize("advanced, key", [
    ("shapes: 5", r"shapes=5: use a mapping with keys specialize, buckets"),
    ("shapes: [[specialize, buckets]]", r"shapes=\[\['specialize', 'buckets'\]\]: use a mapping"),
    ("shapes: {buckets: 5}", r"shapes\.buckets=5: use a list of bucket list names"),
    ("shapes: {buckets: {sdxl: 1}}", r"shapes\.buckets=\{'sdxl': 1\}: use a list"),
    ("shapes: {buckets: [[true, 8]]}", r"shapes\.buckets: \[True, 8\] is neither a bucket list name nor \[width, height\]"),
    ("shapes: {buckets: [[{}, 8]]}", r"shapes\.buckets: \[\{\}, 8\] is neither"),
    ("shapes: {pin: 5}", r"shapes\.pin=5: use WxH shapes"),
    ("shapes: {pin: [[1024, 1024]]}", r"shapes\.pin: \[1024, 1024\] is not a shape"),
    ("shapes: {pin: " + "9" * 5000 + "x8}", r"shapes\.pin: '9+\.\.\.9+x8' is not a shape"),
    ("shapes: {specialize: [1]}", r"shapes\.specialize=\[1\]: use one of none, pinned, buckets"),
    ("shapes: {specialize: 0}", r"shapes\.specialize=0: use one of"),
    ("shapes: {max_variants: 1.5}", r"shapes\.max_variants=1\.5: use a whole number from 1 to 64"),
    ("shapes: {max_cuda_graphs: [8]}", r"shapes\.max_cuda_graphs=\[8\]: use a whole number from 0 to 64"),
])
def test_mistyped_shape_options_name_their_dotted_key(advanced, key):
    """Each raised TypeError (not iterable, unhashable), ValueError (a 5000-digit int) or was accepted."""
    with pytest.raises(OptionsError, match="^" + key) as caught:
        build_options("balanced", advanced=advanced).compile
    assert len(str(caught.value)) < 400
    with pytest.raises(ShapePolicyError, match="^" + key):  # the same error from the policy itself
        ShapePolicy.from_mapping(yaml.safe_load(advanced)["shapes"])


def test_yaml_off_and_null_specialize_mean_none():
    assert ShapePolicy.from_mapping({"specialize": False}).specialize == "none"
    assert ShapePolicy.from_mapping({"specialize": None}).specialize == "none"


@pytest.mark.parametrize("advanced, key", [
    # bounded sizes: ComfyUI's largest resolution, a batch, and the pixels a pin's inputs are allocated for
    ("shapes: {pin: 65536x65536:64}", r"shapes\.pin: '65536x65536:64': width and height must be 8 to 16384 pixels"),
    ("shapes: {pin: 1024x1024:65}", r"shapes\.pin: '1024x1024:65': the batch must be 1 to 64"),
    ("shapes: {pin: 8192x8192:2}", r"shapes\.pin: '8192x8192:2': 8192x8192 at batch 2 is 134,217,728 pixels; the limit is 67,108,864"),
    ("shapes: {pin: 16384x16384}", r"shapes\.pin: '16384x16384': 16384x16384 at batch 1 is 268,435,456 pixels"),
    ("shapes: {specialize: buckets, buckets: [[16392, 8]]}", r"shapes\.buckets: \[16392, 8\]: width and height must be 8 to 16384"),
    ("shapes: {specialize: buckets, buckets: [[0, 8]]}", r"shapes\.buckets: \[0, 8\]: width and height must be 8 to 16384"),
    ("shapes: {buckets: [[" + str(8 * 10 ** 4000) + ", 8]]}", r"shapes\.buckets: \[<a 13291-bit integer>, 8\]: width and height must be 8 to"),
    ("shapes: {buckets: [[1" + ":59" * 3000 + ", 8]]}", r"shapes\.buckets: \[<a 17722-bit integer>, 8\]: width and height must be multiples"),
    ("shapes: {max_variants: 1000000000000}", r"shapes\.max_variants=1000000000000: use a whole number from 1 to 64"),
    ("shapes: {max_cuda_graphs: 65}", r"shapes\.max_cuda_graphs=65: use a whole number from 0 to 64"),
    # a bucket off the latent scale is refused as a pin of that size is, not rounded down to another size
    ("shapes: {specialize: buckets, buckets: [[1001, 1003]]}", r"shapes\.buckets: \[1001, 1003\]: width and height must be multiples of 8"),
    # pins that would never be specialised, or compiled ahead and evicted at once
    ("shapes: {specialize: none, pin: ['1024x1024']}", r"shapes\.pin with shapes\.specialize: none"),
    ("shapes: {specialize: off, pin: ['1024x1024']}", r"shapes\.pin with shapes\.specialize: none"),
    ("shapes: {max_variants: 2, pin: [512x512, 768x768, 1024x1024]}", r"shapes\.pin: 3 pinned shapes, more than shapes\.max_variants=2"),
])
def test_out_of_bounds_shape_options_name_their_field(advanced, key):
    with pytest.raises(OptionsError, match="^" + key) as caught:
        build_options("balanced", advanced=advanced).compile
    assert len(str(caught.value)) < 400


def test_bounds_admit_their_limits():
    edge = f"{MAX_SIZE}x{4096 // 4}, 4096x4096:4, 8x8:64, 1024x1024, 1024x1024"  # the duplicate counts once
    policy = ShapePolicy(max_variants=4).with_pins(edge)
    assert [str(p) for p in policy.pin] == ["16384x1024", "4096x4096:4", "8x8:64", "1024x1024"]
    assert ShapePolicy(max_variants=MAX_KEPT, max_cuda_graphs=MAX_KEPT).max_variants == MAX_KEPT
    buckets = ShapePolicy.from_mapping({"specialize": "buckets", "buckets": [[MAX_SIZE, LATENT_FACTOR]]}).buckets
    assert buckets == ((MAX_SIZE, LATENT_FACTOR),)
    assert all(w % LATENT_FACTOR == 0 and h % LATENT_FACTOR == 0 and max(w, h) <= MAX_SIZE
               for sizes in bucket_table().values() for w, h in sizes)  # Kiln's own lists keep the bounds too


def test_pin_shapes_widget_pins_count_against_max_variants_and_its_text_is_bounded():
    with pytest.raises(ShapePolicyError, match=r"^shapes\.pin: 3 pinned shapes, more than shapes\.max_variants=2"):
        build_options("balanced", advanced="shapes: {max_variants: 2}", pin_shapes="512x512, 768x768, 1024x1024")
    pins = "1024x1024," * (MAX_TEXT_CHARS // 10) + "1024x1024"  # one shape, written over 64 KB
    with pytest.raises(ShapePolicyError, match=rf"^shapes\.pin: the text is {len(pins):,} characters long; the limit is 65,536"):
        build_options("balanced", pin_shapes=pins)
    # explicit specialize none loses to the widget's pins, which ask for pinned specialisation
    assert build_options("balanced", advanced="shapes: {specialize: none}", pin_shapes="64x64").compile.shapes.specialize == "pinned"
