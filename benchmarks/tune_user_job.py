"""The held-out tune grid's job: the e2e user model as a LightningCLI script (``benchmarks/tune.py --grid user``).

The model of ``e2e_user_job.py`` (three 100,000 x 32 tables, a dense over-arch, Adam for the
dense part, eager), on an in-memory random data set of a fixed size (so a larger batch means
fewer steps per epoch, and the DataLoader's workers start again each epoch), sharded by
``ETTStrategy`` and checkpointed by ``AsyncCheckpoint`` every ``checkpoint.every_n_train_steps``
steps into ``./ckpt``. Every knob a user would turn is a LightningCLI option::

    lightning run --devices 2 benchmarks/tune_user_job.py fit --config benchmarks/tune_user.yaml \\
        --data.batch_size 1024 --trainer.strategy.init_args.sharding_type row_wise \\
        --trainer.strategy.init_args.sharding_group_size 1 --data.num_workers 2 \\
        --checkpoint.every_n_train_steps 10

AsyncCheckpoint is added with ``add_lightning_class_args`` (Lightning's documented way to make
a callback's arguments options of their own), so its cadence is one option, not a list entry.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # e2e_user_job (which puts the repository on the path)

from e2e_user_job import UserModel, random_dataset
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch.utils.data import DataLoader

from lightning_ett import AsyncCheckpoint


class UserData(LightningDataModule):
    """``num_samples`` random samples in memory (all ranks together; Lightning's sampler splits them)."""

    def __init__(self, batch_size: int = 256, num_workers: int = 0, num_samples: int = 65_536) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        return DataLoader(random_dataset(hp.num_samples), batch_size=hp.batch_size, shuffle=True,
                          num_workers=hp.num_workers)


class UserCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(AsyncCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.dirpath": "ckpt", "checkpoint.every_n_train_steps": 20,
                             "checkpoint.keep_last_n": 1})


def main() -> None:
    os.environ.setdefault("WANDB_MODE", "offline")
    UserCLI(UserModel, UserData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
