"""The training example grew into ``fullshard train`` (its worker is `fullshard.cli.train`);
this name keeps ``torchrun -m fullshard.examples.train_lm`` working."""

from fullshard.cli.train import exit_without_teardown, main

if __name__ == "__main__":
    exit_without_teardown(main())
