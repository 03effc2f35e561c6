import subprocess
import sys

import pytest
import torch

from rlrun import meters
from rlrun.meters import MIB, PHASES, Meter


def test_phases_record_time_peak_and_growth():
    m = Meter(torch.device("cpu"))
    with m.phase("generate"):
        sum(range(1000))
    resident = meters._rss_bytes() / MIB
    with m.phase("train"):
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched, then freed inside the phase: only a peak sees it
        x += 1
        del x
    out = m.metrics()
    assert out["time/train_s"] > 0 and out["time/step_s"] == out["time/train_s"] + out["time/generate_s"]
    assert set(out) == {"time/step_s"} | {f"{k}/{p}_{s}" for p in ("generate", "train")
                                          for k, s in (("time", "s"), ("mem", "peak_mib"), ("mem", "growth_mib"))}
    # the peak (not the RSS at the phase's end) holds the 64 MiB on top of what was resident, in MiB (not bytes)
    assert resident + 60 < out["mem/train_peak_mib"] < resident + 1024
    assert 60 < out["mem/train_growth_mib"] < 1024
    m.new_step()
    assert m.metrics() == {"time/step_s": 0}
    if not m.peak_resets:
        pytest.skip("/proc/self/clear_refs not writable: per-phase peaks are not reset, growth not per phase")
    # the peak was reset at the phase's start: generate's growth does not include the earlier 64 MiB
    with m.phase("train"):
        x = torch.ones(64 * 2**20 // 4)
        x += 1
        del x
    with m.phase("generate"):
        sum(range(1000))
    out = m.metrics()
    assert out["mem/train_growth_mib"] > 60 > out["mem/generate_growth_mib"]
    assert out["mem/generate_peak_mib"] < out["mem/train_peak_mib"] - 50


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


def test_a_phase_the_run_does_not_have_is_not_metered():
    """offload=off: the offload phases move nothing, and no metric (so no chart) says they took time or memory."""
    m = Meter(torch.device("cpu"), skip=meters.OFFLOAD_PHASES)
    for phase in ("generate", "offload", "onload", "train"):
        with m.phase(phase):
            pass
    assert {k.split("/")[1].rsplit("_", 2)[0] for k in m.metrics() if k != "time/step_s"} == {"generate", "train"}
    with pytest.raises(ValueError, match="unknown phase"):  # still refuses a misspelled name
        with m.phase("offlaod"):
            pass
