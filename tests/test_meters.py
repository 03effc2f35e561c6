import subprocess
import sys

import pytest
import torch

from rlrun.meters import PHASES, Meter


def test_phases_record_time_peak_and_growth():
    m = Meter(torch.device("cpu"))
    with m.phase("generate"):
        sum(range(1000))
    with m.phase("train"):
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        x += 1
    out = m.metrics()
    assert out["time/train_s"] > 0 and out["time/step_s"] == out["time/train_s"] + out["time/generate_s"]
    assert set(out) == {"time/step_s"} | {f"{k}/{p}_{s}" for p in ("generate", "train")
                                          for k, s in (("time", "s"), ("mem", "peak_mib"), ("mem", "growth_mib"))}
    assert out["mem/train_peak_mib"] >= out["mem/train_growth_mib"]
    if m.peak_resets:  # Linux with /proc/self/clear_refs writable: per-phase growth sees the 64 MiB
        assert out["mem/train_growth_mib"] > 60 > out["mem/generate_growth_mib"]
    m.new_step()
    assert m.metrics() == {"time/step_s": 0}


def test_a_phase_name_outside_phases_is_refused():
    m = Meter(torch.device("cpu"))
    with pytest.raises(ValueError, match="ref_logprob'.*ref_logprobs"):
        with m.phase("ref_logprob"):
            pass
    with Meter(torch.device("cpu"), phases=("call",)).phase("call"):  # a tool metering its own phase
        pass
    assert PHASES.index("sync") < PHASES.index("generate") < PHASES.index("train")  # the report's order


def test_phase_names_are_read_without_torch():
    code = "import sys, rlrun.meters; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
