"""The training-step benchmark; the code is `fullshard.cli.bench` (also ``fullshard bench``).

python benchmarks/step.py --config comm --json out.json --plot out.png
"""

import sys

from fullshard.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
