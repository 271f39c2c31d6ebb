"""`lightning-ett tune`: a learned performance proxy that searches a LightningCLI script's knobs in a few real trials."""
