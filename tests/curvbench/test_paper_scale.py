"""The paper-size experiment: one setting sizes it, and both sizes
estimate in a sampled mode with matrix-free spectra."""

from curvbench import config


def test_one_setting_sizes_the_experiment():
  sizes = {}
  for size in ("accelerator", "cpu"):
    cfg = config.compose(
      "+experiment=paper_scale",
      f"paper_scale={size}",
      with_hydra=True,
      check=False,
    )
    sizes[size] = {str(part["problem"]) for part in cfg.hydra.sweeper.sweeps}
    assert cfg.curvature.mode == cfg.canonical.mode == "fisher_gradients"
    assert cfg.measure.spectra.method == "lanczos"
    if size == "cpu":  # the size's values win over the experiment's
      assert list(cfg.measure.spectra.references) == ["ggn"]
      assert cfg.measure.spectra.lanczos_iters == 20
  assert sizes["accelerator"] == {"resnet18", "gpt"}
  assert sizes["cpu"] == {"resnet18_tiny", "gpt", "resnet18_tiny,gpt"}
