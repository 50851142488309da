"""testing/digits_unet.py trains the tiny denoiser the step-cache tests and benches use, once, into the
user's cache: a few steps of it must run whatever autograd mode the caller is in (the ComfyUI bench
test calls it under inference mode, where it failed in backward when the cache was empty)."""
import pytest
import torch

pytest.importorskip("sklearn", reason="the digits come from scikit-learn")
pytest.importorskip("diffusers", reason="the digits denoiser is a diffusers UNet")

from kiln.testing import digits_unet  # noqa: E402


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_training_runs_under_the_caller_s_inference_mode_or_no_grad(mode):
    with mode():
        model, report = digits_unet.train(steps=2, batch=4)
    assert report.steps == 2 and report.final_loss > 0 and not any(p.requires_grad for p in model.parameters())


@pytest.mark.skipif(digits_unet.fcntl is None, reason="the training lock is an flock")
def test_a_second_process_waits_for_the_first_s_training_and_loads_its_model(tmp_path, monkeypatch):
    import threading

    trained = digits_unet.DigitsDenoiser().eval()
    trainings = []
    monkeypatch.setattr(digits_unet, "train", lambda progress=None: trainings.append(1) or (trained, digits_unet.TrainReport(1, 0.0, 1.0)))
    path = digits_unet.cache_path(tmp_path)
    loaded = []
    with digits_unet._training_lock(path):          # "the first process" is training
        waiter = threading.Thread(target=lambda: loaded.append(digits_unet.load_or_train(tmp_path)))
        waiter.start()
        waiter.join(timeout=2)
        assert waiter.is_alive() and not loaded      # the second waits on the lock
        torch.save(trained.state_dict(), path)       # the first's model lands
    waiter.join(timeout=60)
    assert len(loaded) == 1 and not trainings        # loaded, never trained twice
    assert torch.equal(loaded[0].embed.weight, trained.embed.weight)
