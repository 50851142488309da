from kiln.benchmarks import shapes_bench


def test_shape_sequence_reports_compiles_per_step_and_the_targets():
    result = shapes_bench.run_shapes_bench("sd15", "tiny", modes=["fast"], repeats=1, baselines=False, log=lambda m: None)
    (run,) = result["runs"]
    assert run["variant"] == "kiln fast" and run["error"] is None
    steps = run["steps"]
    assert [s["batch"] for s in steps] == [2, 4, 8, 4, 4, 2]
    assert steps[0]["new_graphs"] >= 1 and all(s["max_rel_err"] < 1e-4 for s in steps)  # one per block region
    assert [s["new_graphs"] for s in steps[1:]] == [0, 0, 0, 0, 0]  # new batches and resolutions: no compile
    verdict = result["targets"]["kiln fast"]
    assert verdict["new_batch_compiles_nothing"] and verdict["new_resolution_under_a_tenth"]
    table = shapes_bench.format_table(result)
    assert "kiln fast" in table and "new batch compiles nothing: yes" in table


def test_targets_flag_a_variant_that_recompiles_for_a_batch():
    def step(batch, latent, compile_s, graphs):
        return shapes_bench.Step(batch, latent, compile_s + 0.1, 100.0, compile_s, graphs, 0.0)

    run = shapes_bench.Run("torch.compile dynamic=None", [step(2, [8, 8], 50.0, 1), step(4, [8, 8], 40.0, 1),
                                                           step(4, [8, 12], 45.0, 1)])
    verdict = shapes_bench.targets([run])["torch.compile dynamic=None"]
    assert not verdict["new_batch_compiles_nothing"]
    assert verdict["worst_new_resolution_vs_first_compile"] == 0.9 and not verdict["new_resolution_under_a_tenth"]


def test_isolated_variant_runs_in_its_own_process_with_a_cold_cache():
    lines = []
    result = shapes_bench.run_shapes_bench("sd15", "tiny", modes=["fast"], repeats=1, baselines=False, isolate=True,
                                           log=lines.append)
    (run,) = result["runs"]
    assert run["error"] is None and run["steps"][0]["new_graphs"] >= 1
    assert [s["new_graphs"] for s in run["steps"][1:]] == [0, 0, 0, 0, 0]
    assert all(s["max_rel_err"] < 1e-4 for s in run["steps"])
    assert "own process with an empty Inductor cache" in result["method"]
    assert any("in a new process" in line for line in lines)
    assert sum("kiln fast: batch" in line for line in lines) == 6  # the child's progress, forwarded


def test_isolated_variant_that_fails_is_recorded_with_the_reason():
    result = shapes_bench.run_shapes_bench("sd15", "tiny", modes=["no-such-mode"], repeats=1, baselines=False,
                                           isolate=True, log=lambda m: None)
    (run,) = result["runs"]
    assert run["steps"] == [] and "no-such-mode" in run["error"]


def test_baselines_can_be_chosen_to_split_a_long_run(capsys):
    assert shapes_bench.variant_names(["balanced"], ["dynamic"]) == ["torch.compile dynamic=True", "kiln balanced"]
    assert shapes_bench.variant_names([], ["auto"]) == ["torch.compile dynamic=None"]
    assert shapes_bench.variant_names(["fast"], False) == ["kiln fast"]
    from kiln.cli import main

    assert main(["bench", "--shapes", "--baselines", "static", "--modes", ""]) == 2
    assert "unknown baseline(s) static; choose from auto, dynamic or none" in capsys.readouterr().err


def test_a_pinned_variant_pins_the_first_shape_of_the_sequence():
    options = shapes_bench._kiln_options("kiln balanced+pin", (2, 32, 40))
    assert options.mode == "balanced" and [str(p) for p in options.shapes.pin] == ["320x256:2"]
    assert shapes_bench._kiln_options("kiln max", (2, 32, 40)).shapes.pin == ()


def test_flux_takes_the_sequence_as_its_packed_latent_and_a_new_size_compiles_nothing():
    result = shapes_bench.run_shapes_bench("flux", "tiny", modes=["fast"], repeats=1, baselines=False, log=lambda m: None)
    assert result["sequence"] == [[2, 4, 4], [4, 4, 4], [8, 4, 4], [4, 4, 6], [4, 3, 4], [2, 4, 4]]
    (run,) = result["runs"]
    assert run["error"] is None and all(s["max_rel_err"] < 1e-4 for s in run["steps"])
    # Flux's blocks take their rotary embedding as a (cos, sin) tuple sized by the tokens: marked too
    assert run["steps"][0]["new_graphs"] >= 1 and [s["new_graphs"] for s in run["steps"][1:]] == [0, 0, 0, 0, 0]
