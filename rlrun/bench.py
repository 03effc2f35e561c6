"""`python -m rlrun.bench ...`: the benchmarks keep this command; they live in rlrun/tools/bench.py."""

from .tools.bench import main

if __name__ == "__main__":
    main()
