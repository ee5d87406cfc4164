"""Process tests: real processes and signals: Hydra runs killed and resumed, flwr run, SuperLink and SuperNodes."""
