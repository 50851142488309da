"""PSNR and SSIM (testing/image_quality.py): what the step cache's tests and benches compare images by."""
import math

import pytest
import torch

from kiln.testing.image_quality import psnr, ssim, summary, summary_line


def test_psnr_is_infinite_for_equal_images_and_follows_the_mse():
    ref = torch.linspace(0, 1, 64).reshape(1, 1, 8, 8)
    assert psnr(ref, ref) == math.inf
    assert math.isclose(psnr(ref + 0.1, ref), 10 * math.log10(1 / 0.01), rel_tol=1e-5)


def test_ssim_is_one_for_equal_images_and_falls_with_noise():
    ref = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    assert math.isclose(ssim(ref, ref), 1.0, rel_tol=1e-6)
    a, b = ssim(ref + 0.1 * noise, ref), ssim(ref + 0.5 * noise, ref)
    assert 1 > a > b > 0


def test_ssim_of_flat_images_is_its_luminance_term():
    """Flat images: no variance, so SSIM = (2 mu_x mu_y + C1) / (mu_x^2 + mu_y^2 + C1), C1 = (0.01 * 1)^2."""
    out, ref = torch.full((1, 1, 8, 8), 0.5), torch.ones(1, 1, 8, 8)
    assert math.isclose(ssim(out, ref), (1.0 + 1e-4) / (1.25 + 1e-4), rel_tol=1e-5)


def test_ssim_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"shapes \(1, 8, 8\) and \(1, 8, 9\)"):
        ssim(torch.zeros(1, 8, 8), torch.zeros(1, 8, 9))


def test_a_summary_is_the_worst_and_the_mean_of_each_measure():
    row = summary([(30.0, 0.9), (40.0, 0.99), (35.0, 0.96)])
    assert row == pytest.approx({"psnr_min": 30.0, "psnr_mean": 35.0, "ssim_min": 0.9, "ssim_mean": 0.95})
    assert summary_line(row) == "PSNR  30.0 /  35.0 dB  SSIM 0.900 / 0.950"
