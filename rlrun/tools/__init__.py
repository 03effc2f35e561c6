"""The tools beside a run: the benchmarks (`python -m rlrun.bench`: bench.py, with bench_trl.py and
bench_plan.py) and the comparison of runs (`rlrun-report`: report.py). They print and draw through rlrun.render."""
