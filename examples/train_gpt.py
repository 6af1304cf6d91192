"""Train the demo character-level GPT on Shakespeare with DeepCEEStrategy via LightningCLI.

    python examples/train_gpt.py fit --config configs/quickstart.yaml

Every option of the model, the data and the strategy can be changed in the YAML file or on the
command line (e.g. ``--trainer.strategy.init_args.schedule=zb-h1``). The same script trains with
any other Lightning strategy (``--trainer.strategy=ddp``) for comparison.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_deepcee  # noqa: F401  (registers strategy="deepcee")
from lightning_deepcee.demo import GPT, ShakespeareDataModule


def main() -> None:
    LightningCLI(GPT, ShakespeareDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
