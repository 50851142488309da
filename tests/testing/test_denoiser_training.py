"""testing/denoiser_training.py keeps each trained denoiser in the user's cache: a process that finds
another one training waits for that one's model instead of training its own (two pytest workers, two
benches)."""
import threading

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from kiln.testing import denoiser_training


@pytest.mark.skipif(denoiser_training.fcntl is None, reason="the training lock is an flock")
def test_a_second_process_waits_for_the_first_s_training_and_loads_its_model(tmp_path):
    path = tmp_path / "tiny-v1.pt"
    trained = torch.nn.Linear(3, 3)
    trainings, loaded = [], []

    def train(progress):
        trainings.append(1)
        return trained, denoiser_training.TrainReport(1, 0.0, 1.0)

    def load():
        loaded.append(denoiser_training.load_or_train(path, lambda: torch.nn.Linear(3, 3), train, "tiny"))

    with denoiser_training.training_lock(path):   # "the first process" is training
        waiter = threading.Thread(target=load)
        waiter.start()
        waiter.join(timeout=2)
        assert waiter.is_alive() and not loaded     # the second waits on the lock
        torch.save(trained.state_dict(), path)      # the first's model lands
    waiter.join(timeout=60)
    assert len(loaded) == 1 and not trainings       # loaded, never trained twice
    assert torch.equal(loaded[0].weight, trained.weight)


def test_a_missing_model_is_trained_once_and_stored_with_its_report(tmp_path):
    path = tmp_path / "tiny-v1.pt"
    trained = torch.nn.Linear(3, 3)
    model = denoiser_training.load_or_train(path, lambda: torch.nn.Linear(3, 3),
                                            lambda progress: (trained, denoiser_training.TrainReport(5, 1.5, 0.25)), "tiny")
    assert model is trained and path.exists() and '"steps": 5' in path.with_suffix(".json").read_text()
    again = denoiser_training.load_or_train(path, lambda: torch.nn.Linear(3, 3), lambda progress: 1 / 0, "tiny")
    assert torch.equal(again.weight, trained.weight) and not again.training



def test_with_ema_decay_the_returned_weights_are_the_moving_average_of_every_step_s():
    after_each_step = []
    hook = register_optimizer_step_post_hook(
        lambda opt, args, kwargs: after_each_step.append([p.detach().clone() for p in opt.param_groups[0]["params"]]))

    def batch(n):
        x = torch.randn(n, 2)
        return (x,), x.sum(1, keepdim=True)

    try:
        model, _ = denoiser_training.train(lambda: torch.nn.Linear(2, 1), batch, steps=5, batch_size=4, ema_decay=0.5)
    finally:
        hook.remove()
    average = after_each_step[0]
    for weights in after_each_step[1:]:
        average = [a + 0.5 * (w - a) for a, w in zip(average, weights)]
    assert len(after_each_step) == 5 and not torch.equal(average[0], after_each_step[-1][0])
    for got, expected in zip(model.parameters(), average):
        torch.testing.assert_close(got, expected)
