"""benchmarks/first_image_server.py without a server: the prompts each variant queues, the table and the
argument checks (tests/comfyui/test_comfy_workflows.py runs it against real servers)."""
import json
import subprocess

import pytest

from kiln.benchmarks import first_image_server as bench
from kiln.testing.comfy_server import make_base_dir

BASE = json.loads(bench.WORKFLOW.read_text())


def test_each_variant_s_prompt_compiles_the_unet_its_way_at_the_asked_size_seed_and_steps():
    for variant in bench.VARIANTS:
        out = bench.prompt(variant, steps=3, size=192, seed=7)
        sampler = out[bench.SAMPLER]["inputs"]
        assert (sampler["seed"], sampler["steps"]) == (7, 3)
        assert out[bench.LATENT]["inputs"] == {"width": 192, "height": 192, "batch_size": 1}
        assert out[bench.CHECKPOINT]["inputs"]["ckpt_name"] == bench.CHECKPOINT_NAME
        assert out[bench.SAVE]["inputs"]["filename_prefix"] == f"kiln/first_image_{variant}"
    eager = bench.prompt("eager", 3, 192, 7)
    assert bench.COMPILE not in eager and eager[bench.SAMPLER]["inputs"]["model"] == [bench.CHECKPOINT, 0]
    compiled = {v: bench.prompt(v, 3, 192, 7)[bench.COMPILE] for v in ("kiln", "kiln-all-regions", "kiln-whole", "kiln-background",
                                                                 "core")}
    assert compiled["kiln"]["class_type"] == "KilnCompileUNet" and compiled["kiln"]["inputs"]["advanced"] == ""
    assert compiled["kiln-all-regions"]["inputs"]["advanced"] == "measure_regions: false"
    assert compiled["kiln-whole"]["inputs"]["advanced"] == "compile_unit: whole"
    assert compiled["kiln-background"]["inputs"]["advanced"] == "background: true"
    assert all(c["inputs"]["mode"] == "balanced" for v, c in compiled.items() if v != "core")
    assert compiled["core"] == {"class_type": "TorchCompileModel", "inputs": {"model": [bench.CHECKPOINT, 0],
                                                                               "backend": "inductor"}}
    assert BASE[bench.COMPILE]["class_type"] == "KilnCompileUNet"  # the workflow is as the bench reads it


def test_the_advanced_texts_are_options_compile_unet_takes():
    from kiln.compiler.options.compile_options import CompileOptions, parse_expert_options

    for variant in ("kiln-all-regions", "kiln-whole", "kiln-background"):
        text = bench.prompt(variant, 1, 64, 1)[bench.COMPILE]["inputs"]["advanced"]
        CompileOptions(**parse_expert_options(text))


def test_the_table_gives_each_first_image_against_eager_s():
    result = {"rows": [
        {"variant": "eager", "first_image_s": 20.0, "next_image_s": 10.0, "images": []},
        {"variant": "kiln", "first_image_s": 50.0, "next_image_s": 8.0, "images": [], "psnr_db": [48.5, 47.25]},
        {"variant": "core", "skipped": "no TorchCompileModel"},
    ]}
    table = bench.format_table(result).splitlines()
    assert table[1].split() == ["eager", "20.0", "1.00x", "10.0", "the", "reference"]
    assert table[2].split() == ["kiln", "50.0", "2.50x", "8.0", "47.2", "dB"]
    assert table[3] == "core: skipped (no TorchCompileModel)"


def test_the_base_directory_links_kiln_and_the_model_files(tmp_path):
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"weights")
    make_base_dir(tmp_path / "base", {"checkpoints": {"bench.safetensors": checkpoint}})
    assert (tmp_path / "base" / "models" / "checkpoints" / "bench.safetensors").read_bytes() == b"weights"
    assert (tmp_path / "base" / "custom_nodes" / "comfyui-kiln" / "nodes").is_dir()


def test_the_base_directory_can_link_an_earlier_kiln_tree(tmp_path):
    earlier = tmp_path / "earlier-kiln"
    (earlier / "nodes").mkdir(parents=True)
    make_base_dir(tmp_path / "base", {}, pack=earlier)
    assert (tmp_path / "base" / "custom_nodes" / "comfyui-kiln").resolve() == earlier.resolve()


def test_the_earlier_kiln_s_row_is_named_by_its_commit_or_its_folder(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    assert bench.earlier_name(plain) == "kiln@plain"
    subprocess.run(["git", "init", "-q", str(plain)], check=True)
    subprocess.run(["git", "-C", str(plain), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)
    commit = subprocess.run(["git", "-C", str(plain), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    assert bench.earlier_name(plain) == f"kiln@{commit}"


def test_the_earlier_kiln_runs_the_kiln_variant_last_from_its_own_tree(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(bench, "run_variant", lambda variant, *args, pack=bench.REPO, name="", **kw: ran.append(
        (variant, pack, name)) or {"variant": name or variant, "skipped": "not run"})
    monkeypatch.setattr(bench, "earlier_name", lambda tree: "kiln@abc1234")
    result = bench.run(tmp_path, tmp_path / "c.safetensors", "python", ["eager", "kiln"], folder=tmp_path,
                       earlier=tmp_path / "old")
    assert ran == [("eager", bench.REPO, ""), ("kiln", bench.REPO, ""), ("kiln", tmp_path / "old", "kiln@abc1234")]
    assert [row["variant"] for row in result["rows"]] == ["eager", "kiln", "kiln@abc1234"]


@pytest.mark.parametrize("argv, said", [
    (["--variants", "eager,magic"], "unknown magic"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--size", "100"], "a multiple of 8"),
    (["--earlier", "/nonexistent/kiln"], "no Kiln tree there"),
])
def test_bad_arguments_are_refused_by_name(tmp_path, capsys, argv, said):
    (tmp_path / "main.py").write_text("")
    checkpoint = tmp_path / "c.safetensors"
    checkpoint.write_bytes(b"")
    with pytest.raises(SystemExit):
        bench.main(["--comfyui", str(tmp_path), "--checkpoint", str(checkpoint), *argv])
    assert said in capsys.readouterr().err


def test_a_missing_tree_or_checkpoint_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--comfyui", str(tmp_path), "--checkpoint", str(tmp_path / "none")])
    assert "no ComfyUI tree there" in capsys.readouterr().err
