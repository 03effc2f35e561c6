import torch

from rlrun.meters import Meter


def test_phases_record_time_peak_and_growth():
    m = Meter(torch.device("cpu"))
    with m.phase("small"):
        sum(range(1000))
    with m.phase("big"):
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        x += 1
    out = m.metrics()
    assert out["time/big_s"] > 0 and out["time/step_s"] == out["time/big_s"] + out["time/small_s"]
    assert out["mem/big_peak_mib"] > 64
    if m.peak_resets:  # Linux with /proc/self/clear_refs writable: per-phase growth sees the 64 MiB
        assert out["mem/big_growth_mib"] > 60 > out["mem/small_growth_mib"]
    m.new_step()
    assert m.metrics() == {"time/step_s": 0}
