"""testing/load_run.py's pieces, without a server: the workflow it queues, the mix of prompts, the
eager twins queued in between, its PNG reader and PSNR (checked on PNGs written with every row filter), and
the summary: each check that fails is named."""
import argparse
import itertools
import json
import math
import struct
import zlib
from dataclasses import asdict

import pytest

from kiln.testing import load_run
from kiln.client.workflow import KILN_COMPILE_NODES, without_nodes
from kiln.events import CompileEvent

ARGS = argparse.Namespace(checkpoint="ckpt.safetensors", lora="lora.safetensors", controlnet="cn.pth", steps=3,
                          mode="fast")


def test_the_workflow_is_the_controlnet_example_with_a_lora_after_compile_unet():
    prompt = load_run.workflow(ARGS)
    by_class = {v["class_type"]: v for v in prompt.values()}
    lora = prompt[load_run.LORA_NODE]
    assert lora["class_type"] == "LoraLoaderModelOnly" and lora["inputs"]["lora_name"] == "lora.safetensors"
    assert prompt[lora["inputs"]["model"][0]]["class_type"] == "KilnCompileUNet"
    assert by_class["KSampler"]["inputs"]["model"] == [load_run.LORA_NODE, 0]
    assert by_class["KSampler"]["inputs"]["steps"] == 3
    assert by_class["CheckpointLoaderSimple"]["inputs"]["ckpt_name"] == "ckpt.safetensors"
    assert by_class["ControlNetLoader"]["inputs"]["control_net_name"] == "cn.pth"
    assert by_class["KilnCompileUNet"]["inputs"]["mode"] == by_class["KilnCompileControlNet"]["inputs"]["mode"] == "fast"
    eager = without_nodes(prompt, KILN_COMPILE_NODES)
    assert not {v["class_type"] for v in eager.values()} & set(KILN_COMPILE_NODES)
    assert eager[eager[load_run.LORA_NODE]["inputs"]["model"][0]]["class_type"] == "CheckpointLoaderSimple"


def test_fifty_prompts_cover_every_combination_each_with_its_own_seed():
    prompt = load_run.workflow(ARGS)
    jobs = load_run.mix(prompt, 50)
    ids = {v["class_type"]: k for k, v in prompt.items()}
    latent, sampler, control = ids["EmptyLatentImage"], ids["KSampler"], ids["ControlNetApplyAdvanced"]
    seen = set()
    for settings, job in jobs:
        size = (job[latent]["inputs"]["width"], job[latent]["inputs"]["height"])
        seen.add((size, job[latent]["inputs"]["batch_size"], job[load_run.LORA_NODE]["inputs"]["strength_model"],
                  job[control]["inputs"]["strength"]))
        assert settings[f"{sampler}.seed"] == job[sampler]["inputs"]["seed"]
    assert seen == set(itertools.product(load_run.SIZES, load_run.BATCHES, load_run.LORA_STRENGTHS,
                                         load_run.CONTROL_STRENGTHS))
    assert len({job[sampler]["inputs"]["seed"] for _, job in jobs}) == 50
    assert prompt == load_run.workflow(ARGS)  # each job is a copy


def png(width, height, channels, pixels: bytes, filters) -> bytes:
    """An 8-bit PNG whose rows use the given filter types (0 none, 1 sub, 2 up, 3 average, 4 Paeth)."""
    stride, raw, previous = width * channels, bytearray(), bytes(width * channels)
    for y, kind in zip(range(height), itertools.cycle(filters)):
        line = pixels[y * stride:(y + 1) * stride]
        encoded = bytearray()
        for i, value in enumerate(line):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            guess = left + up - corner
            paeth = min((abs(guess - left), 0, left), (abs(guess - up), 1, up), (abs(guess - corner), 2, corner))[2]
            predicted = (0, left, up, (left + up) // 2, paeth)[kind]
            encoded.append((value - predicted) & 255)
        raw += bytes([kind]) + encoded
        previous = line

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, {1: 0, 3: 2, 4: 6}[channels], 0, 0, 0)
    compressed = zlib.compress(bytes(raw))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", compressed[:7])
            + chunk(b"IDAT", compressed[7:]) + chunk(b"IEND", b""))


def test_read_png_undoes_every_row_filter():
    width, height = 7, 10
    for channels in (1, 3, 4):
        pixels = bytes((x * 37 + y * 91 + c * 53 + x * y) % 256 for y in range(height) for x in range(width)
                       for c in range(channels))
        for filters in ([0], [1], [2], [3], [4], [0, 1, 2, 3, 4]):
            assert load_run.read_png(png(width, height, channels, pixels, filters)) == (width, height, channels, pixels)


def test_psnr_of_equal_and_slightly_different_images():
    pixels = bytes(range(7 * 5 * 3))
    image = png(7, 5, 3, pixels, [4])
    assert load_run.psnr(image, png(7, 5, 3, pixels, [1])) == math.inf
    off_by_one = bytes(p ^ 1 for p in pixels)  # every value off by exactly 1: MSE 1
    assert math.isclose(load_run.psnr(image, png(7, 5, 3, off_by_one, [0])), 20 * math.log10(255))
    with pytest.raises(ValueError, match="images differ in size: 7x5x3 vs 5x7x3"):
        load_run.psnr(image, png(5, 7, 3, pixels, [0]))


def test_each_prompt_is_followed_by_its_eager_twin():
    jobs = load_run.mix(load_run.workflow(ARGS), 3)
    queued = load_run.paired(jobs)
    assert [settings["run"] for settings, _ in queued] == ["kiln", "eager"] * 3
    for (settings, job), (kiln_settings, kiln_job), (eager_settings, eager_job) in zip(jobs, queued[::2], queued[1::2]):
        assert kiln_settings == {"run": "kiln", **settings} and eager_settings == {"run": "eager", **settings}
        assert kiln_job == job and eager_job == without_nodes(job, KILN_COMPILE_NODES)


FIRST_COMPILE = CompileEvent(0, 1.5, "fx", True, "first compile")
RECOMPILE = CompileEvent(1, 1.5, "fx", True, "recompile: 0/0: tensor 'x' size mismatch at index 0")
EVENTS = {event.line(): event for event in (FIRST_COMPILE, RECOMPILE)}


def records(tmp_path, kiln_pixels, eager_pixels, kiln_lines=(), seconds=(2.0, 1.0)):
    """kiln queue's records of one prompt and its eager twin, their images written as PNGs."""
    made = []
    for name, pixels, lines, total in (("kiln", kiln_pixels, kiln_lines, seconds[0]),
                                       ("eager", eager_pixels, (), seconds[1])):
        images = []
        for i, image in enumerate(pixels):
            path = tmp_path / f"{name}_{len(list(tmp_path.iterdir()))}_{i}.png"
            path.write_bytes(png(4, 3, 3, image, [0]))
            images.append(str(path))
        node = "Kiln › Compile UNet (2)"
        shown = [line.removeprefix(f"{node}: ") for line in lines]
        compiles = [{"node": node, "event": asdict(EVENTS[line])} for line in shown if line in EVENTS]
        made.append({"settings": {"run": name, "10.width": 192}, "images": images, "kiln_lines": list(lines),
                     "kiln_compiles": compiles, "total_seconds": total,
                     "kiln_compile_seconds": 1.5 if lines else (0.0 if name == "kiln" else None)})
    return made


def summary_args(max_recompiles=1, settle=1):
    return argparse.Namespace(mode="fast", steps=2, max_recompiles=max_recompiles, settle=settle)


def test_summary_of_a_run_that_holds(tmp_path, capsys):
    image = bytes(range(36))
    compiled = ["Kiln › Compile UNet (2): Kiln compiled graph 0 in 1.5s (fx, dynamic shapes): first compile",
                "Kiln › Compile UNet (2): Kiln variant: graph 0 compiled for batch 2"]
    run = records(tmp_path, [image], [image], compiled) + records(tmp_path, [image] * 2, [image] * 2, seconds=(3.0, 2.0))
    assert load_run.summarize(run, summary_args(), tmp_path) == 0
    out = capsys.readouterr().out
    assert "lowest PSNR inf dB over 3 images" in out
    assert "Kiln compiles: 1 in all, 0 of them recompiles (at most 1 allowed), none after prompt 1 allowed" in out
    assert "  prompt 1: Kiln › Compile UNet (2): Kiln compiled graph 0 in 1.5s" in out
    assert "prompts that compiled nothing (1): Kiln's time / its eager twin's, median 1.50" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failures"] == [] and summary["prompts"] == 2 and summary["lowest_psnr_db"] == "inf"
    assert summary["kiln_over_eager_when_nothing_compiled"] == 1.5
    assert summary["seconds"]["kiln"] == {"median": 2.5, "mean": 2.5, "max": 3.0}


def test_summary_names_each_check_that_fails(tmp_path, capsys):
    image = bytes(range(36))
    noisy = bytes(p ^ 64 for p in image)  # far below 40 dB
    recompiled = [f"Kiln › Compile UNet (2): {RECOMPILE.line()}"] * 2
    run = records(tmp_path, [noisy], [image], recompiled) + records(tmp_path, [image], [image] * 2, recompiled[:1])
    assert load_run.summarize(run, summary_args(max_recompiles=2, settle=1), tmp_path) == 1
    failures = json.loads((tmp_path / "summary.json").read_text())["failures"]
    assert failures[0].startswith("prompt 1 {'10.width': 192}: PSNR ") and failures[0].endswith(" dB < 40")
    assert failures[1] == "prompt 2: 1 image(s) vs 2 eager"
    assert failures[2] == "3 recompiles > 2"
    assert failures[3] == "Kiln compiled after prompt 1: in prompt(s) 2"
    assert "load run: 4 check(s) failed" in capsys.readouterr().out


def _chunk(kind, body):
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def test_a_png_a_server_sends_cannot_unpack_into_gigabytes_or_claim_any_size(tmp_path, monkeypatch):
    bomb = zlib.compress(bytes(200 * 2**20), 9)  # 200 MiB of zeros in about 200 KiB
    header = struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0)
    png_bomb = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", bomb) + _chunk(b"IEND", b"")
    with pytest.raises(ValueError, match="8x8 PNG whose rows unpack to more than 200 bytes"):
        load_run.read_png(png_bomb)
    huge = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    with pytest.raises(ValueError, match="100000x100000 pixels"):
        load_run.read_png(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", huge) + _chunk(b"IDAT", zlib.compress(b"")))
    over = struct.pack(">IIBBBBB", 4097, 4096, 8, 6, 0, 0, 0)  # one column past the cap, RGBA
    with pytest.raises(ValueError, match="4097x4096 pixels: at most 16777216 are read"):
        load_run.read_png(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", over) + _chunk(b"IDAT", zlib.compress(b"")))
    with pytest.raises(ValueError, match="without its IHDR"):
        load_run.read_png(b"\x89PNG\r\n\x1a\n" + _chunk(b"IDAT", zlib.compress(b"")))
    short = png(2, 2, 3, bytes(12), [0])[:-40]  # cut inside the rows
    with pytest.raises(ValueError, match="2x2 PNG whose rows unpack to fewer than 14 bytes"):
        load_run.read_png(short)
    path = tmp_path / "big.png"
    path.write_bytes(png(2, 2, 3, bytes(12), [0]))
    assert load_run.read_png_file(path) == path.read_bytes()
    monkeypatch.setattr(load_run, "MAX_PNG_BYTES", 10)
    with pytest.raises(ValueError, match="more than an image file's 10"):
        load_run.read_png_file(path)
