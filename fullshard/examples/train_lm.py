"""The training example grew into ``fullshard train`` (its worker is `fullshard.train`);
this name keeps ``torchrun -m fullshard.examples.train_lm`` working."""

import sys

from fullshard.train import main

if __name__ == "__main__":
    sys.exit(main())
