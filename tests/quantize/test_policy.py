"""The layer policy: family defaults, size threshold, fp8's Linear-only rule and the YAML override."""
import pytest
import torch

from kiln.testing.models import MODELS
from kiln.compiler.quantize import SCHEMES, LayerPolicy, QuantizeError, detect_family, parse_policy


@pytest.fixture(scope="module")
def unet():
    return MODELS["sd15"].build("tiny")


def _decide(module, policy, scheme="int8_weight"):
    family = detect_family(module)
    return {name: policy.decide(name, m, SCHEMES[scheme], family) for name, m in module.named_modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}


@pytest.mark.parametrize("name,family", [("sd15", "diffusers_unet"), ("sd3", "mmdit"), ("flux", "flux")])
def test_family_is_found_from_layer_names(name, family):
    assert detect_family(MODELS[name].build("tiny")) == family


def test_unet_defaults_keep_first_last_and_embeddings(unet):
    reasons = _decide(unet, LayerPolicy(min_params=0))
    assert reasons["conv_in"] == "first layer" and reasons["conv_out"] == "last layer"
    assert reasons["time_embedding.linear_1"] == "time embedding"
    assert reasons["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"] is None
    assert reasons["down_blocks.0.resnets.0.conv1"] is None


def test_size_threshold(unet):
    reasons = _decide(unet, LayerPolicy(min_params=4096))
    small = [n for n, m in unet.named_modules() if isinstance(m, torch.nn.Linear) and m.weight.numel() < 4096]
    assert small and all(reasons[n] in ("small (< 4096 weights)", "time embedding") for n in small)


@pytest.mark.parametrize("scheme, file_format", [("fp8_e4m3", "float8_e4m3fn"), ("int8_tensorwise", "int8_tensorwise")])
def test_comfyui_formats_keep_convolutions(unet, scheme, file_format):
    """ComfyUI's formats hold Linear layers only, so a Kiln file in one loads whole in stock ComfyUI."""
    reasons = _decide(unet, LayerPolicy(min_params=0, quantize=("*",)), scheme=scheme)
    assert reasons["down_blocks.0.resnets.0.conv1"] == f"convolution (ComfyUI's {file_format} format has Linear layers only)"
    assert reasons["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"] is None  # Linear layers still go in


def test_yaml_override_keep_and_force():
    policy = parse_policy("keep: ['*.attn2.*']\nquantize: [time_embedding.*]\nmin_params: 0\nconvs: false\n")
    assert policy == LayerPolicy(keep=("*.attn2.*",), quantize=("time_embedding.*",), min_params=0, convs=False)
    unet = MODELS["sd15"].build("tiny")
    reasons = _decide(unet, policy)
    assert reasons["down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k"] == "policy keep pattern"
    assert reasons["time_embedding.linear_1"] is None
    assert reasons["down_blocks.0.resnets.0.conv1"] == "convolution (policy convs: false)"


@pytest.mark.parametrize("text,message", [
    ("keep: 3", "keep must be a list"), ("min_param: 3", r"layer policy: unknown key\(s\) 'min_param'"),
    ("- a", "must be a mapping"), ("convs: maybe", "convs must be true or false"), ("family: sdxx", "family 'sdxx'"),
    ("min_params: -1", "min_params must be >= 0"), ("keep: [", "neither JSON nor YAML")])
def test_bad_policy_says_what_is_wrong(text, message):
    with pytest.raises(QuantizeError, match=message):
        parse_policy(text)


def test_empty_policy_is_the_default():
    assert parse_policy("  ") == LayerPolicy()


@pytest.mark.parametrize("text, message", [
    ("keep: 5", r"^layer policy keep must be a list of name patterns \(text\), got 5$"),
    ("keep: {a: 1}", r"^layer policy keep must be a list .* got \{'a': 1\}$"),
    ("quantize: [1]", r"^layer policy quantize must be a list .* got \[1\]$"),
    ('{"min_params": 1e999}', r"^layer policy min_params must be >= 0, a whole number of weights; got inf$"),
    ("min_params: 1e999", r"^layer policy min_params must be >= 0.* got '1e999'$"),  # YAML 1.1: a string
    ("min_params: 1.5", r"^layer policy min_params .* got 1\.5$"),
    ("min_params: true", r"^layer policy min_params .* got True$"),
    ("convs: 1", r"^layer policy convs must be true or false, got 1$"),
    ("family: [1]", r"^layer policy family \[1\] is unknown; use auto or one of sd_unet"),
    ("family: {a: 1}", r"^layer policy family \{'a': 1\} is unknown"),
])
def test_every_mistyped_policy_key_is_a_quantize_error_naming_it(text, message):
    """`family: [1]` raised TypeError (unhashable) and `keep: [[...]]` printed the whole value; now the key,
    the value shortened and what is allowed."""
    with pytest.raises(QuantizeError, match=message):
        parse_policy(text)


def test_policy_reads_json_and_a_single_pattern():
    assert parse_policy('{"keep": "*.attn2.*", "min_params": 0}') == LayerPolicy(keep=("*.attn2.*",), min_params=0)
    assert LayerPolicy(quantize=["a", "b"]).quantize == ("a", "b")  # a list from Python is kept as a tuple
