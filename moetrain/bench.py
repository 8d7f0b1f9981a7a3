"""`python -m moetrain.bench`: the MoE-layer benchmark, benchmarks/layer.py of the repository.

The benchmark lives with the others in benchmarks/, outside the importable package; this entry keeps
the command the README gives. It runs from a checkout (an editable install), where benchmarks/ sits
beside the package.
"""

import runpy
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "layer.py"


def main() -> None:
    if not BENCHMARK.is_file():
        print(f"moetrain.bench: {BENCHMARK} is missing: the benchmarks ship with the repository, not with an "
              "installed package; run it from a checkout (pip install -e .)", file=sys.stderr)
        sys.exit(2)
    sys.argv[0] = str(BENCHMARK)
    runpy.run_path(str(BENCHMARK), run_name="__main__")


if __name__ == "__main__":
    main()
