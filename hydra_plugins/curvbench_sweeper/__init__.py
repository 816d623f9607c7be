"""curvbench's Hydra sweeper (`tuning_sweeper.TuningSweeper`), in the
package Hydra scans for plugins: an adapter over `curvbench.planning`. Its
config node, `hydra/sweeper: tuning`, is `curvbench.config.SweeperSettings`.
"""
