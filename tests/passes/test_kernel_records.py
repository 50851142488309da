"""A kernel pass fires by default on a GPU only where an in-place record there shows its kernel beating
Inductor's code (compiler/passes/kernel_records.py). The records here are injected."""
import dataclasses
import json
import logging

import pytest

from kiln.compiler.passes import PASSES, PassContext, PassResult, kernel_records
from kiln.compiler.passes.base import kernel_gate
from kiln.compiler.passes.kernel_records import (DEFAULT_WITHOUT_RECORD, KERNEL_MIN_GAIN, GpuClass, KernelRecord,
                                                 decide, load_records, merged, records_text)

H200, H100 = GpuClass("NVIDIA H200", "sm_90"), GpuClass("NVIDIA H100 80GB HBM3", "sm_90")


def record(with_ms: float, without_ms: float, gpu: GpuClass = H200, case: str = "sdxl-1024-cfg",
           kernel_pass: str = "fuse_geglu") -> KernelRecord:
    return KernelRecord(kernel_pass, gpu.name, gpu.capability, case, with_ms, without_ms, with_ms + 1,
                        without_ms + 1, "2026-12-02", "2.13.0", "benchmarks/results/x-kernel-passes.json")


def test_a_kernel_that_won_in_place_on_a_gpu_fires_there():
    decision = decide("fuse_geglu", H200, [record(30.0, 31.0), record(7.0, 7.2, case="sd15-512-cfg")])
    assert decision.on and len(decision.records) == 2
    assert decision.why.startswith("its kernel beat Inductor's code in place on NVIDIA H200 (sm_90) (sdxl-1024-cfg")


def test_a_kernel_that_lost_at_one_case_does_not_fire():
    decision = decide("fuse_geglu", H200, [record(30.0, 31.0), record(7.3, 7.2, case="sd15-512-cfg")])
    assert not decision.on
    assert "lost to Inductor's code in place on NVIDIA H200 (sm_90) (sd15-512-cfg" in decision.why


def test_a_gain_under_the_minimum_is_not_a_win():
    assert not decide("fuse_geglu", H200, [record(10.0 * (1 - KERNEL_MIN_GAIN / 2), 10.0)]).on
    assert decide("fuse_geglu", H200, [record(10.0 * (1 - KERNEL_MIN_GAIN), 10.0)]).on


def test_without_a_record_on_that_gpu_the_kernel_is_off_and_says_so():
    assert DEFAULT_WITHOUT_RECORD is False
    decision = decide("fuse_geglu", H200, [record(1.0, 2.0, gpu=H100), record(1.0, 2.0, kernel_pass="x")])
    assert not decision.on and not decision.records  # an H100's record says nothing of an H200
    assert decision.why == ("no in-place measurement of fuse_geglu on NVIDIA H200 (sm_90) shows its kernel beating "
                            "Inductor's code, so it is off there by default")


def _gate(monkeypatch, records, **ctx):
    monkeypatch.setattr(kernel_records, "shipped_records", lambda: tuple(records))
    result = PassResult("fuse_geglu")
    fields = dict(switch="auto", device_type="cuda", triton=True, inductor=True, gpu=H200)
    fields.update(ctx)
    return kernel_gate(PassContext(**fields), result, "GEGLU"), result.skipped


def test_the_gate_asks_the_record_on_cuda_with_inductor(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="kiln"):
        fires, skipped = _gate(monkeypatch, [record(30.0, 31.0)])
    assert fires and not skipped
    assert "kernel pass fuse_geglu is on on NVIDIA H200 (sm_90) by default" in caplog.text
    fires, skipped = _gate(monkeypatch, [record(32.0, 31.0)])
    assert not fires and skipped[0].startswith("GEGLU: its kernel lost to Inductor's code in place on NVIDIA H200")
    assert skipped[0].endswith("(force with passes: on)")
    fires, skipped = _gate(monkeypatch, [])
    assert not fires and "no in-place measurement of fuse_geglu on NVIDIA H200" in skipped[0]


def test_the_gate_is_unchanged_where_no_record_applies(monkeypatch):
    assert _gate(monkeypatch, [], switch="on")[0]  # forced
    assert _gate(monkeypatch, [], inductor=False)[0]  # mode fast: against eager, which no record measures
    fires, skipped = _gate(monkeypatch, [record(1.0, 2.0)], device_type="cpu", gpu=None)  # the CPU, as before
    assert not fires and "cpu has no Triton kernel here" in skipped[0]


def test_the_shipped_records_load_and_name_kernel_passes_only():
    kernel_passes = {p.name for p in PASSES if p.kernel_op}
    assert all(r.kernel_pass in kernel_passes for r in load_records())


def test_a_record_is_read_as_untrusted_data(tmp_path):
    path = tmp_path / "records.json"
    good = dataclasses.asdict(record(1.0, 2.0))
    for bad, message in [({**good, "busy_with_ms": -1}, "busy_with_ms=-1 is not a positive time"),
                         ({**good, "busy_with_ms": True}, "busy_with_ms=True is not a positive time"),
                         ({**good, "gpu": "x" * 500}, "gpu="),
                         ({**good, "capability": "90"}, "capability='90' is not of the form sm_90"),
                         ({**good, "extra": 1}, "expected an object with exactly the fields")]:
        path.write_text(json.dumps({"format": 1, "records": [bad]}))
        with pytest.raises(ValueError, match="records.json record 0: " + message.replace("(", r"\(")):
            load_records(path)
    path.write_text(json.dumps({"format": 1, "records": [good, good]}))
    with pytest.raises(ValueError, match="recorded twice"):
        load_records(path)
    path.write_text(json.dumps({"format": 2, "records": []}))
    with pytest.raises(ValueError, match='expected {"format": 1'):
        load_records(path)
    path.write_text(" " * (kernel_records.MAX_RECORDS_BYTES + 1))
    with pytest.raises(ValueError, match="bytes, more than"):
        load_records(path)


def test_new_records_replace_the_old_of_the_same_pass_gpu_and_case(tmp_path):
    old = [record(1.0, 2.0), record(1.0, 2.0, case="sd15-512-cfg")]
    both = merged(old, [record(3.0, 2.0)])
    path = tmp_path / "records.json"
    path.write_text(records_text(both))
    assert sorted((r.case, r.busy_with_ms) for r in load_records(path)) == [("sd15-512-cfg", 1.0),
                                                                           ("sdxl-1024-cfg", 3.0)]
