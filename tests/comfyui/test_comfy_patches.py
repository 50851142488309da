"""Patches users stack on a model, with Kiln › Compile UNet in the chain: each case runs several prompts
through core's own nodes on a ModelPatcher, once without Kiln and once with it (same seeds), and checks
that the images match (PSNR >= 40 dB, fp32 on the CPU) and that the compiles stop growing after the
second prompt, except where a patch really changes the graph: then Kiln recompiles once and its stats
say why (TorchDynamo's guard failure). Runs when COMFYUI_PATH points at a ComfyUI tree; skips otherwise.

Run with -s to see one line per case: PSNR per prompt, compiles after each prompt, recompile reasons."""
import os

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")  # conftest.py put COMFYUI_PATH on the path and set ComfyUI's args

import comfy.model_management  # noqa: E402
import comfy.sample  # noqa: E402
import comfy.samplers  # noqa: E402
import folder_paths  # noqa: E402
import nodes  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from comfy.ldm.modules.attention import optimized_attention  # noqa: E402
from comfy_extras import nodes_freelunch, nodes_model_advanced, nodes_perpneg, nodes_sag  # noqa: E402

from kiln.compiler import model_for  # noqa: E402
from kiln.nodes.compile_controlnet import KilnCompileControlNet  # noqa: E402
from comfy_testing import TINY_SD15, compile_unet, make_tiny_controlnet, make_tiny_sd15_patcher  # noqa: E402
from testing_utils import psnr, rel_err  # noqa: E402

# num_res_blocks per level, as ComfyUI's model detection writes it: its LoRA key map needs the list
TINY = dict(TINY_SD15, num_res_blocks=[1, 1])
CONTEXT = TINY["context_dim"]
# the tiny UNet's cross-attention blocks: (block, number, channels)
ATTN2_BLOCKS = [("input", 1, 32), ("input", 3, 64), ("middle", 0, 64), ("output", 0, 64), ("output", 1, 64),
                ("output", 2, 32), ("output", 3, 32)]
MIN_PSNR = 40.0
UNIT = {"compile_unit": "whole"}  # set per run of the module by the `unit` fixture
ROWS = []  # one line per case, printed at the end of the module (pytest -s)


@pytest.fixture(autouse=True)
def inference_mode():
    """ComfyUI runs every node under inference mode: tensors made outside it are another dispatch key set,
    which TorchDynamo guards on."""
    with torch.inference_mode():
        yield


@pytest.fixture(scope="module", autouse=True)
def report_rows():
    yield
    print("\ncase | PSNR per prompt (dB) | compiles after each prompt | recompile reasons")
    print("\n".join(ROWS))


def conditioning(seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, 7, CONTEXT, generator=gen), {}]], [[torch.randn(1, 7, CONTEXT, generator=gen), {}]]


def sample(model, positive, negative, seed=3, size=16, batch=1, steps=2):
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch, 4, size, size, generator=gen)
    return comfy.sample.sample(model, noise, steps, 7.0, "euler", "normal", positive, negative,
                               torch.zeros(batch, 4, size, size), disable_pbar=True, seed=seed)


@pytest.fixture(scope="module", params=["whole", "blocks"], autouse=True)
def unit(request):
    """Every case runs twice: compiling the whole UNet (where the graph counts below are exact) and by
    blocks (where graphs are compiled per block region: compiles grow after no prompt the whole UNet
    compiles nothing for; a block graph often serves what the whole one recompiles for)."""
    UNIT["compile_unit"] = request.param
    yield request.param


def kiln(model):
    """Kiln › Compile UNet, as a user's graph chains it."""
    return compile_unet(model, mode="fast", advanced=f"compile_unit: {UNIT['compile_unit']}")[0]


def eager(model):
    return model


def stats_of(base):
    """The stats of the one KilnModel every Kiln chain on `base` runs (one plan: Compile UNet, fast)."""
    compiled = kiln(base)
    wrapper = compiled.get_wrappers("apply_model", "kiln.compile")[0]
    return model_for(base.get_model_object("diffusion_model"), wrapper.plan).stats


class Case:
    """Prompts of one case: each is `prompt(compile) -> image`, where `compile` is `kiln` or `eager` and
    is placed in the chain where a user would put Kiln's node."""

    def __init__(self, name, base, prompts):
        self.name, self.base, self.prompts = name, base, prompts
        self.psnrs, self.compiles, self.eager_images = [], [], []

    def run(self):
        stats = stats_of(self.base)
        self.start = start = len(stats.compiles)
        for prompt in self.prompts:
            want = prompt(eager)
            got = prompt(kiln)
            self.eager_images.append(want)
            self.psnrs.append(psnr(got, want))
            self.compiles.append(len(stats.compiles))
        self.stats, self.new = stats, stats.compiles[start:]
        reasons = sorted({c.reason.splitlines()[0][:160] for c in self.new if c.reason.startswith("recompile")})
        ROWS.append(f"{self.name} | {', '.join(f'{p:.1f}' for p in self.psnrs)} | "
                    f"{', '.join(str(n - start) for n in self.compiles)} | {' / '.join(reasons) or '-'}")
        assert min(self.psnrs) >= MIN_PSNR, (self.name, self.psnrs)
        assert stats.fallback is None and stats.eager_calls == 0, stats.summary()
        return self

    def assert_compiles(self, *expected):
        """Graphs compiled in this case after each prompt (counted from the case's start), as the whole
        UNet compiles them; by blocks, they grow after no prompt where the whole UNet's do not."""
        got = tuple(n - self.start for n in self.compiles)
        if UNIT["compile_unit"] == "whole":
            assert got == expected, self.stats.summary()
            return
        grew = [b > a for a, b in zip((0,) + got, got)]
        whole_grew = [b > a for a, b in zip((0,) + expected, expected)]
        assert all(w or not g for g, w in zip(grew, whole_grew)), (got, expected, self.stats.summary())

    def recompile_reasons(self):
        return [c.reason for c in self.new if c.reason.startswith("recompile")]

    def assert_recompiled_for(self, what: str):
        """Compiling whole: the first recompile names `what` (TorchDynamo's guard). By blocks the reasons
        are the block graphs' own (a position of a block with attention patches, a batch of 1 in one
        block), and the whole graph's may need no recompile at all (ControlNet's residuals enter between
        blocks): what holds there is checked by run() and assert_compiles()."""
        if UNIT["compile_unit"] == "whole":
            reasons = self.recompile_reasons()
            assert reasons and what in reasons[0], reasons


def changes_the_image(a, b):
    """The patch does something: 100x above fp32 rounding (Kiln's images here match eager ones to 1e-6).
    Two sampling steps from pure noise leave latents of large magnitude, so PSNR says little here."""
    return rel_err(a, b) > 1e-4


# ---- 1. LoRA before and after the Kiln node: strength changes, another LoRA ----------------------

@pytest.fixture(scope="module")
def plain(unit):
    """One model shared by the patches that leave the UNet's graph as it is, compiled here by a plain
    prompt: its one graph serves them all (each case below compiles nothing)."""
    with torch.inference_mode():  # ComfyUI's loaders run inside its executor's inference mode
        model = make_tiny_sd15_patcher(seed=0, unet_config=TINY)
        sample(kiln(model), *conditioning())
    info = stats_of(model)
    assert info.compile_count == (1 if unit == "whole" else len(info.regions)), info.summary()
    return model


@pytest.fixture(scope="module")
def loras(plain, tmp_path_factory):
    """Two LoRA files (lora_up / lora_down / alpha on every attention projection and proj_in), where
    LoraLoaderModelOnly finds them."""
    folder = tmp_path_factory.mktemp("loras")
    for name, seed in (("style_a.safetensors", 1), ("style_b.safetensors", 2)):
        gen = torch.Generator().manual_seed(seed)
        lora = {}
        for key, weight in plain.model.state_dict().items():
            if key.startswith("diffusion_model.") and key.endswith(("to_q.weight", "to_k.weight", "to_v.weight",
                                                                    "proj_in.weight")):
                stem = "lora_unet_" + key[len("diffusion_model."):-len(".weight")].replace(".", "_")
                rank, extra = 4, weight.shape[2:]
                lora[stem + ".lora_up.weight"] = torch.randn(weight.shape[0], rank, *extra, generator=gen) * 0.3
                lora[stem + ".lora_down.weight"] = torch.randn(rank, weight.shape[1], *extra, generator=gen) * 0.3
                lora[stem + ".alpha"] = torch.tensor(float(rank))
        safetensors.torch.save_file(lora, str(folder / name))
    folders = folder_paths.folder_names_and_paths["loras"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(folder_paths.folder_names_and_paths, "loras", ([str(folder), *folders[0]], folders[1]))
        yield ("style_a.safetensors", "style_b.safetensors")


def lora(model, name, strength):
    return nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, strength)[0]


LORA_PROMPTS = [(0, 1.0), (0, 0.5), (1, 0.5), (1, 0.8)]  # (which LoRA, strength): a strength change, a swap


def test_lora_before_the_kiln_node(plain, loras):
    pos, neg = conditioning()
    case = Case("LoRA before Kiln (strength 1 -> 0.5, swap, 0.8)", plain, [
        lambda compile, i=i, s=s: sample(compile(lora(plain, loras[i], s)), pos, neg) for i, s in LORA_PROMPTS]).run()
    case.assert_compiles(0, 0, 0, 0)
    assert changes_the_image(case.eager_images[0], sample(plain, pos, neg))  # the LoRA does something
    assert changes_the_image(case.eager_images[1], case.eager_images[2])     # and so does the swap


def test_lora_after_the_kiln_node(plain, loras):
    pos, neg = conditioning()
    case = Case("LoRA after Kiln (strength 1 -> 0.5, swap, 0.8)", plain, [
        lambda compile, i=i, s=s: sample(lora(compile(plain), loras[i], s), pos, neg) for i, s in LORA_PROMPTS]).run()
    case.assert_compiles(0, 0, 0, 0)


# ---- 3. Model sampling patches that stay outside the diffusion model ----------------------------

def test_model_sampling_discrete(plain):
    pos, neg = conditioning()
    patch = nodes_model_advanced.ModelSamplingDiscrete().patch
    kinds = [("eps", False), ("v_prediction", False), ("lcm", False), ("v_prediction", True)]
    case = Case("ModelSamplingDiscrete eps, v_prediction, lcm, v_prediction+zsnr", plain, [
        lambda compile, k=k, z=z: sample(compile(patch(plain, k, z)[0]), pos, neg) for k, z in kinds]).run()
    case.assert_compiles(0, 0, 0, 0)
    assert changes_the_image(case.eager_images[0], case.eager_images[1])


def test_perp_neg_guider(plain):
    """PerpNegGuider batches positive, negative and empty conditioning in one model call."""
    pos, neg = conditioning()
    empty, _ = conditioning(seed=9)

    def prompt(compile, neg_scale, seed=3):
        guider = nodes_perpneg.PerpNegGuider.execute(compile(plain), pos, neg, empty, 7.0, neg_scale)[0]
        noise = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(seed))
        sigmas = comfy.samplers.calculate_sigmas(plain.get_model_object("model_sampling"), "normal", 2)
        return guider.sample(noise, torch.zeros(1, 4, 16, 16), comfy.samplers.sampler_object("euler"), sigmas,
                             seed=seed, disable_pbar=True)

    case = Case("PerpNegGuider neg_scale 1, 0.5, 1.5", plain, [
        lambda compile, s=s: prompt(compile, s) for s in (1.0, 0.5, 1.5)]).run()
    case.assert_compiles(0, 0, 0)


# ---- 5. Area conditioning: the model runs on latent crops of other sizes -----------------------

def test_area_conditioning(plain):
    pos, neg = conditioning()
    other, _ = conditioning(seed=5)

    def prompt(compile, width, x):
        area = nodes.ConditioningSetArea().append(other, width, 64, x, 0, 1.0)[0]
        right_half = nodes.ConditioningSetAreaPercentage().append(pos, 0.5, 1.0, 0.5, 0.0, 0.8)[0]
        combined = nodes.ConditioningCombine().combine(nodes.ConditioningCombine().combine(pos, area)[0], right_half)[0]
        return sample(compile(plain), combined, neg)

    case = Case("ConditioningSetArea(+Percentage) + Combine, areas moved", plain, [
        lambda compile, w=w, x=x: prompt(compile, w, x) for w, x in [(64, 0), (64, 64), (96, 32), (64, 0)]]).run()
    case.assert_compiles(0, 0, 0, 0)
    if UNIT["compile_unit"] == "whole":  # the shape manager's records are the whole graph's
        crops = {v.signature.split(", context")[0] for v in case.stats.variants if "latent 16x16" not in v.signature}
        assert {"batch 2, latent 8x8 (64x64 px)", "batch 2, latent 16x8 (64x128 px)", "batch 2, latent 8x12 (96x64 px)"} <= crops


# ---- 2. ControlNet: strength changes, 0 included, other sizes ---------------------------------

@pytest.mark.parametrize("compile_controlnet", [False, True], ids=["eager controlnet", "Kiln Compile ControlNet"])
def test_controlnet_strengths(compile_controlnet):
    """Strength 0 is ControlNetApplyAdvanced's no-op (no control reaches the UNet): the UNet compiles one
    graph without the residuals, once. Other strengths, batches and resolutions reuse the graphs."""
    base = make_tiny_sd15_patcher(seed=0, unet_config=TINY)
    control_net = make_tiny_controlnet(TINY)
    kiln_control = KilnCompileControlNet().compile(control_net, mode="fast")[0] if compile_controlnet else control_net
    pos, neg = conditioning()

    control_compiles = []

    def prompt(compile, strength, size, batch):
        hint = torch.rand(batch, size * 8, size * 8, 3, generator=torch.Generator().manual_seed(1))
        net = kiln_control if compile is kiln else control_net
        cpos, cneg = nodes.ControlNetApplyAdvanced().apply_controlnet(pos, neg, net, hint, strength, 0.0, 1.0)
        image = sample(compile(base), cpos, cneg, size=size, batch=batch)
        if compile is kiln and compile_controlnet:
            control_compiles.append(kiln_control.control_model.kiln_model.stats.compile_count)
        return image

    runs = [(1.0, 16, 1), (0.0, 16, 1), (0.5, 24, 1), (0.8, 16, 2), (0.0, 20, 1), (1.0, 16, 1)]
    case = Case(f"ControlNet 1, 0, 0.5, 0.8 (other sizes), 0, 1 ({'Kiln' if compile_controlnet else 'eager'} "
                "ControlNet)", base, [lambda compile, r=r: prompt(compile, *r) for r in runs]).run()
    case.assert_compiles(1, 2, 2, 2, 2, 2)
    case.assert_recompiled_for("kwargs['control']")
    assert changes_the_image(case.eager_images[0], case.eager_images[1])
    if compile_controlnet:
        # the ControlNet's own graphs: one hint serves a batch of 1 and is repeated for larger ones
        # (TorchDynamo specialises a size of 1): one more graph at the first larger batch, none after
        control_stats = kiln_control.control_model.kiln_model.stats
        ROWS.append(f"  Kiln ControlNet's own compiles after each prompt: {', '.join(map(str, control_compiles))} | "
                    + " / ".join(c.reason.splitlines()[0][:160] for c in control_stats.recompiles))
        assert control_stats.fallback is None and control_stats.eager_calls == 0, control_stats.summary()
        assert control_compiles[3] == control_compiles[-1] and control_compiles[2] == control_compiles[0], control_compiles
        assert "kwargs['hint']" in control_stats.recompiles[-1].reason, control_stats.summary()


# ---- 3. FreeU, Self-Attention Guidance, PerpNeg -----------------------------------------------

def test_freeu_and_freeu_v2():
    """FreeU's scales are Python floats in its patch's closure: TorchDynamo specialises a float on the
    first compile and makes it an input once it changes (one recompile, its guard the reason); FreeU_V2
    is other code (one more graph). Later values reuse the graphs."""
    base = make_tiny_sd15_patcher(seed=0, unet_config=TINY)
    pos, neg = conditioning()
    # b2/s2 scale the tiny UNet's 64-channel blocks (b1/s1 would scale 128-channel ones it does not have)
    runs = [(nodes_freelunch.FreeU, 1.2), (nodes_freelunch.FreeU, 1.4), (nodes_freelunch.FreeU, 1.3),
            (nodes_freelunch.FreeU_V2, 1.4), (nodes_freelunch.FreeU_V2, 1.2), (nodes_freelunch.FreeU_V2, 1.3)]
    case = Case("FreeU b2 1.2, 1.4, 1.3 then FreeU_V2 b2 1.4, 1.2, 1.3", base, [
        lambda compile, node=node, b2=b2: sample(node.execute(compile(base), 1.1, b2, 0.9, 0.2)[0], pos, neg)
        for node, b2 in runs]).run()
    case.assert_compiles(1, 2, 2, 3, 3, 3)
    reasons = case.recompile_reasons()
    assert all("output_block_patch" in r for r in reasons), reasons
    assert changes_the_image(case.eager_images[0], sample(base, pos, neg))
    assert changes_the_image(case.eager_images[0], case.eager_images[1])


def test_self_attention_guidance():
    """SAG replaces the middle block's self-attention (recording its scores) and runs the model again on
    the uncond half alone: a batch of 1, which is a graph of its own."""
    base = make_tiny_sd15_patcher(seed=0, unet_config=TINY)
    pos, neg = conditioning()
    case = Case("SelfAttentionGuidance scale 0.5, 0.7, 0.3", base, [
        lambda compile, s=s: sample(nodes_sag.SelfAttentionGuidance.execute(compile(base), s, 2.0)[0], pos, neg)
        for s in (0.5, 0.7, 0.3)]).run()
    case.assert_compiles(2, 2, 2)
    case.assert_recompiled_for("cond_or_uncond")
    assert changes_the_image(case.eager_images[0], sample(base, pos, neg))


def test_perp_neg_node():
    """PerpNeg's cfg function runs the model on the empty conditioning alone: a batch of 1, a graph of its own."""
    base = make_tiny_sd15_patcher(seed=0, unet_config=TINY)
    pos, neg = conditioning()
    empty, _ = conditioning(seed=9)
    case = Case("PerpNeg neg_scale 1, 0.5, 1.5", base, [
        lambda compile, s=s: sample(nodes_perpneg.PerpNeg.execute(compile(base), empty, s)[0], pos, neg)
        for s in (1.0, 0.5, 1.5)]).run()
    case.assert_compiles(2, 2, 2)
    case.assert_recompiled_for("size()[0]")  # TorchDynamo's 0/1 specialisation of the batch


# ---- 4. An attention-patching node in the style of IPAdapter -----------------------------------

class ImageTokens(torch.nn.Module):
    """The patch's own weights: keys and values for image tokens, one pair per attention block."""

    def __init__(self, channels, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.to_k = torch.nn.Linear(CONTEXT, channels, bias=False)
        self.to_v = torch.nn.Linear(CONTEXT, channels, bias=False)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=gen) * 0.2


class ImagePromptAttention:
    """An attn2 replace patch as IPAdapter installs one: holds its tensors (image embeddings for cond and
    uncond, its layer), adds `weight` x attention over the image tokens to the text attention."""

    def __init__(self, tokens: ImageTokens, cond, uncond, weight):
        self.tokens, self.cond, self.uncond, self.weight = tokens, cond, uncond, weight

    def __call__(self, q, k, v, extra_options):
        heads = extra_options["n_heads"]
        out = optimized_attention(q, k, v, heads)
        if not self.active(extra_options):
            return out
        per_chunk = q.shape[0] // len(extra_options["cond_or_uncond"])
        image = torch.cat([(self.cond, self.uncond)[i].repeat(per_chunk, 1, 1) for i in extra_options["cond_or_uncond"]])
        return out + optimized_attention(q, self.tokens.to_k(image), self.tokens.to_v(image), heads) * self.weight

    def active(self, extra_options):
        return True


class SigmaGatedImagePromptAttention(ImagePromptAttention):
    """As IPAdapter's own: active between two sigmas, read with `.item()` (TorchDynamo breaks the graph there)."""

    def __init__(self, *args, sigma_start, sigma_end):
        super().__init__(*args)
        self.sigma_start, self.sigma_end = sigma_start, sigma_end

    def active(self, extra_options):
        sigma = extra_options["sigmas"].detach().cpu()[0].item()
        return self.sigma_end <= sigma <= self.sigma_start


class OutputGain:
    """An attn2 output patch with a float of its own."""

    def __init__(self, gain):
        self.gain = gain

    def __call__(self, n, extra_options):
        return n * self.gain


def image_prompt(model, weight, seed=1, gated=False):
    """What an IPAdapter node does to a MODEL: a clone with an attn2 replace on every cross-attention block
    (and here an attn2 output patch), each patch holding its own tensors."""
    patched = model.clone()
    gen = torch.Generator().manual_seed(seed)
    cond, uncond = torch.randn(1, 4, CONTEXT, generator=gen), torch.zeros(1, 4, CONTEXT)
    sampling = patched.get_model_object("model_sampling")
    for i, (block, number, channels) in enumerate(ATTN2_BLOCKS):
        args = (ImageTokens(channels, 100 * seed + i), cond, uncond, weight)
        patch = (SigmaGatedImagePromptAttention(*args, sigma_start=sampling.percent_to_sigma(0.0),
                                                sigma_end=sampling.percent_to_sigma(1.0))
                 if gated else ImagePromptAttention(*args))
        patched.set_model_attn2_replace(patch, block, number)
    patched.set_model_attn2_output_patch(OutputGain(1.0 + weight / 10))
    return patched


def test_attention_patches_in_the_style_of_ipadapter():
    """One graph: the patches' tensors and weights are its inputs. The weight (a float) changes at prompt
    2: TorchDynamo makes it an input (one recompile, the guard on `.weight` the reason); new embeddings,
    new weights, another size and batch reuse that graph."""
    base = make_tiny_sd15_patcher(seed=0, unet_config=TINY)
    pos, neg = conditioning()
    runs = [(1.0, 1, 16, 1), (0.6, 1, 16, 1), (0.3, 2, 16, 1), (0.8, 3, 24, 2)]  # weight, image seed, size, batch
    case = Case("IPAdapter-style attn2 replace + output patch, weight 1, 0.6, 0.3, 0.8 (new image, size)", base, [
        lambda compile, w=w, s=s, size=size, b=b: sample(image_prompt(compile(base), w, seed=s), pos, neg, size=size,
                                                         batch=b) for w, s, size, b in runs]).run()
    case.assert_compiles(1, 2, 2, 2)
    case.assert_recompiled_for(".weight")
    assert not case.stats.graph_breaks
    assert changes_the_image(case.eager_images[0], sample(base, pos, neg))
    assert changes_the_image(case.eager_images[0], case.eager_images[1])


def test_sigma_gated_attention_patches_run_in_pieces_and_say_where(caplog):
    """IPAdapter's own patch reads the sigma with `.item()`: TorchDynamo cannot trace that, so the model
    runs as several compiled graphs with the patch's gate in Python between them. Kiln says where, in
    the log and in its stats; the images match and later prompts compile nothing."""
    base = make_tiny_sd15_patcher(seed=0, unet_config=TINY)
    pos, neg = conditioning()
    runs = [(1.0, 1), (0.6, 1), (0.3, 2), (0.8, 3)]
    case = Case("IPAdapter-style, sigma-gated with .item() (graph breaks)", base, [
        lambda compile, w=w, s=s: sample(image_prompt(compile(base), w, seed=s, gated=True), pos, neg)
        for w, s in runs]).run()
    assert case.compiles[1] == case.compiles[2] == case.compiles[3], case.stats.summary()
    (where, graphs), = case.stats.graph_breaks.items()
    assert "test_comfy_patches.py" in where and "in active: Unsupported Tensor.item()" in where and graphs > 1
    assert "TorchDynamo breaks the graph at" in caplog.text and "in active" in caplog.text
    assert "graph break at" in case.stats.summary()


# ---- 6. ComfyUI's low-VRAM partial loading ------------------------------------------------------

@pytest.fixture
def low_vram(monkeypatch):
    """On a GPU short of memory, load_models_gpu hands LoadedModel.model_load a memory budget smaller than
    the model: ModelPatcher.load then loads part of the weights and lets the other modules cast theirs in
    forward (comfy_cast_weights, LoRA applied there by LowVramPatch). A CPU load device always loads
    fully, so this hands model_load what that GPU would: a third of the model (the budget less what is
    already loaded, as load_models_gpu computes it). Returns the list of models seen loaded partially."""
    original = comfy.model_management.LoadedModel.model_load
    partial = []

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        budget = self.model.model_size() // 3
        out = original(self, max(budget - self.model_loaded_memory(), 0.1), force_patch_weights)
        if self.model.model.model_lowvram:
            partial.append(self.model)
        return out

    monkeypatch.setattr(comfy.model_management.LoadedModel, "model_load", model_load)
    yield partial
    comfy.model_management.unload_all_models()


def _cast_in_forward(model) -> int:
    return sum(bool(getattr(m, "comfy_cast_weights", False)) for m in model.model.modules())


def test_low_vram_partial_loading(low_vram):
    base = make_tiny_sd15_patcher(seed=0, unet_config=TINY)
    pos, neg = conditioning()
    case = Case("low VRAM (a third of the weights loaded)", base, [
        lambda compile, seed=seed: sample(compile(base), pos, neg, seed=seed) for seed in (3, 4, 5)]).run()
    assert low_vram and _cast_in_forward(base) > 0
    case.assert_compiles(1, 1, 1)


def test_low_vram_partial_loading_with_lora(low_vram, loras):
    """Partially loaded, a LoRA is applied in forward (LowVramPatch), inside the compiled graph: its
    strength is a float there, made an input once it changes (one recompile, its guard the reason)."""
    base = make_tiny_sd15_patcher(seed=0, unet_config=TINY)
    pos, neg = conditioning()
    case = Case("low VRAM + LoRA after Kiln (strength 1 -> 0.5, swap, 0.8)", base, [
        lambda compile, i=i, s=s: sample(lora(compile(base), loras[i], s), pos, neg) for i, s in LORA_PROMPTS]).run()
    assert low_vram and _cast_in_forward(base) > 0
    case.assert_compiles(1, 2, 2, 2)
    case.assert_recompiled_for("weight_function")
    assert changes_the_image(case.eager_images[1], case.eager_images[2])
