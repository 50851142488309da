"""testing/pytest_workers.py: the suite runs in pytest-xdist workers unless the command line chose."""
import pytest

from kiln.testing import pytest_workers


@pytest.mark.parametrize("args", [["-n", "0"], ["-n0"], ["--numprocesses=3"], ["--numprocesses", "2"], ["-p", "no:xdist"],
                                  ["-pno:xdist"], ["--dist", "load"], ["--dist=each"]])
def test_a_worker_count_or_distribution_on_the_command_line_is_kept(args):
    assert pytest_workers.worker_args(["tests/x.py", *args]) == []


def test_otherwise_a_worker_a_core_up_to_the_bound_a_file_to_each(monkeypatch):
    pytest.importorskip("xdist")
    for cores, expected in [(1, []), (2, ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]),
                            (64, ["-n", str(pytest_workers.MAX_WORKERS), "--dist", "loadfile", "--no-loadscope-reorder"])]:
        monkeypatch.setattr(pytest_workers, "usable_cores", lambda: cores)
        assert pytest_workers.worker_args(["-m", "not slow", "tests/options"]) == expected


def test_without_pytest_xdist_the_suite_runs_in_one_process_and_the_header_says_why(monkeypatch):
    monkeypatch.setattr(pytest_workers.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(pytest_workers, "usable_cores", lambda: 8)
    assert pytest_workers.worker_args(["tests"]) == []

    class Config:
        _kiln_workers: list = []

    assert "pytest-xdist is not installed" in pytest_workers.pytest_report_header(Config())


def test_the_training_file_first_then_the_heaviest_files_and_the_other_trained_denoiser_files_last():
    from kiln.testing.pytest_workers import SLOW_TEST_WEIGHT, FileWork, work_order

    files = [FileWork("many_quick", SLOW_TEST_WEIGHT + 10, 0, False), FileWork("quality", 4, 4, True),
             FileWork("two_slow", 3, 2, False), FileWork("one_slow", 1, 1, False), FileWork("bench", 1, 1, True),
             FileWork("few_quick", 3, 0, False)]
    assert work_order(files) == ["quality", "two_slow", "many_quick", "one_slow", "few_quick", "bench"]
