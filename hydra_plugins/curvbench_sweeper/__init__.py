"""curvbench's Hydra sweeper: Hydra finds plugins in `hydra_plugins`."""
