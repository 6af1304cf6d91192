"""One process, no network: folders mirror the lightning_deepcee package."""
