"""quickstart-robust: Flower's quickstart-pytorch with fedrobust's RobustStrategy."""
