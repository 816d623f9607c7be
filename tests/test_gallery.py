"""The gallery: every entry's claims judged from records built to hold and
not to hold, and every entry run at its tiny size, its verdicts computed
from the records the runs wrote."""

import itertools

import numpy as np
import pandas as pd
import pytest

from curvbench import config, gallery, runs, sweep
from curvbench.gallery import FAILS, HOLDS, UNSETTLED, Evidence
from curvbench.gallery import cohen2021_edge_of_stability as cohen
from curvbench.gallery import eschenhagen2023_kfac_reduce as eschenhagen
from curvbench.gallery import george2018_ekfac as george
from curvbench.gallery import martens2015_kfac as martens
from curvbench.gallery import ghorbani2019_batch_norm as ghorbani
from curvbench.gallery import gurari2018_tiny_subspace as gurari
from curvbench.gallery import morwani2025_shampoo2 as morwani
from curvbench.gallery import page
from curvbench.gallery import sagun2017_outliers as sagun
from hydra_plugins.curvbench_sweeper import tuning_sweeper

SEEDS = (0, 1, 2)


def evidence(done=None, **tables) -> Evidence:
  return Evidence(pd.DataFrame() if done is None else done, tables)


def verdict(entry, claim: int, found: Evidence) -> str:
  return entry.ENTRY.claims[claim].judge(found).outcome


# --- George et al. (EKFAC) ----------------------------------------------------


def quality(ekfac_over_kfac):
  """Per-block errors, EKFAC's `ekfac_over_kfac(seed, step, block)` times
  K-FAC's."""
  rows = []
  for seed, step, block in itertools.product(SEEDS, (0, 10), ("l1", "l2")):
    kfac = 0.5 + 0.1 * seed
    for name, value in (
      ("kfac", kfac),
      ("ekfac", kfac * ekfac_over_kfac(seed, step, block)),
    ):
      rows.append(
        dict(
          curvature=name,
          metric="relative_frobenius",
          level="layer",
          seed=seed,
          step=step,
          sample=0,
          reference="ggn",
          block=block,
          value=value,
        )
      )
  return pd.DataFrame(rows)


def test_ekfac_closer_holds_only_where_every_block_is():
  assert verdict(george, 0, evidence(quality=quality(lambda *_: 0.8))) == HOLDS
  assert (
    verdict(george, 0, evidence(quality=quality(lambda *_: 1.0))) == HOLDS
  )  # equal is at most
  found = george.ENTRY.claims[0].judge(
    evidence(
      quality=quality(
        lambda seed, step, block: 1.2 if (seed, block) == (1, "l2") else 0.8
      )
    )
  )
  assert found.outcome == FAILS
  assert "2 of 12" in found.evidence and "seed 1, step 10, l2" in (
    found.evidence
  )


def training(losses: dict[str, list[float]], budget=4.0):
  """Training rows: each method's run per seed ends at `budget` on the
  time grid with the given training loss."""
  rows, done = [], []
  for name, values in losses.items():
    for seed, loss in enumerate(values):
      run_id = f"{name}{seed}"
      done.append(
        {
          "run_id": run_id,
          "config:seed": seed,
          "config:measure.training.budget_s": budget,
        }
      )
      for step, at, value in ((0, np.nan, 3.0), (9, budget, loss)):
        rows.append(
          dict(
            measure="training",
            curvature=name,
            run_id=run_id,
            seed=seed,
            step=step,
            wall_s=at if step else 0.0,
            time_point_s=at,
            train_loss=value,
            diverged=False,
          )
        )
  return pd.DataFrame(done), pd.DataFrame(rows)


@pytest.mark.parametrize(
  "ekfac,outcome",
  [
    ([1.0, 1.1, 0.9], HOLDS),
    ([3.0, 3.1, 2.9], FAILS),
    ([2.0, 1.0, 3.0], UNSETTLED),
  ],
)
def test_ekfac_faster_follows_the_interval_of_the_difference(ekfac, outcome):
  done, rows = training({"kfac": [2.0, 2.1, 1.9], "ekfac": ekfac})
  assert verdict(george, 1, evidence(done, training=rows)) == outcome


# --- Martens & Grosse (K-FAC) ------------------------------------------------


def tuned_training(errors: dict, budget=10.0):
  """Training records of `{(problem, optimizer, learning rate): errors per
  seed}`, each run at its error on the last point of its time grid."""
  rows, done = [], []
  for (problem, name, rate), values in errors.items():
    for seed, error in enumerate(values):
      run_id = f"{problem}-{name}-{rate}-{seed}"
      done.append(
        {
          "run_id": run_id,
          "problem": problem,
          "config:optimizer.name": name,
          "config:optimizer.learning_rate": rate,
          "config:seed": seed,
          "config:measure.training.budget_s": budget,
        }
      )
      for step, at, value in ((0, 0.0, 50.0), (40, budget, error)):
        rows.append(
          dict(
            measure="training",
            run_id=run_id,
            problem=problem,
            step=step,
            wall_s=at,
            time_point_s=at,
            train_error=value,
            diverged=False,
            others_cpu_share=0.01 * seed,
          )
        )
  return evidence(pd.DataFrame(done), training=pd.DataFrame(rows))


def test_kfac_paper_claims_compare_each_optimizers_best_setting():
  found = tuned_training(
    {
      ("curves", "kfac", None): [3.0, 3.1, 2.9],
      ("curves", "sgd", 0.01): [5.0, 5.2, 4.9],  # the baseline's best
      ("curves", "sgd", 0.03): [1.0, 9.0, 30.0],  # lower once, worse mean
      ("curves", "adam", 0.001): [2.0, 2.1, 1.9],
    }
  )
  chosen = martens.chosen(found)
  assert set(chosen[chosen.optimizer == "sgd"].setting) == {
    "learning_rate=0.01"
  }
  judged = martens.ENTRY.claims[0].judge(found)
  assert judged.outcome == HOLDS  # below SGD's 5
  assert judged.evidence.startswith("at 10 s of training")
  assert judged.evidence.endswith("others' CPU share at most 2% while training")
  beaten = martens.ENTRY.claims[1].judge(found)
  assert beaten.outcome == FAILS and "curves" in beaten.evidence


def test_kfac_paper_claims_hold_only_on_every_problem():
  both = {
    ("curves", "kfac", None): [3.0, 3.1, 2.9],
    ("curves", "sgd", 0.01): [5.0, 5.2, 4.9],
  }
  assert (
    verdict(
      martens,
      0,
      tuned_training(
        {
          **both,
          ("mnist", "kfac", None): [3.0, 3.1, 2.9],
          ("mnist", "sgd", 0.01): [2.0, 2.1, 1.9],
        }
      ),
    )
    == FAILS
  )
  assert (
    verdict(
      martens,
      0,
      tuned_training(
        {
          **both,
          ("mnist", "kfac", None): [3.0, 1.0, 5.0],
          ("mnist", "sgd", 0.01): [3.0, 3.1, 2.9],
        }
      ),
    )
    == UNSETTLED
  )
  assert (
    verdict(
      martens,
      0,
      tuned_training({**both, ("mnist", "kfac", None): [3.0, 3.1, 2.9]}),
    )
    == UNSETTLED
  )


# --- Eschenhagen et al. (K-FAC-reduce) -----------------------------------------


def timing(medians: dict[str, list[float]]):
  return pd.DataFrame(
    [
      dict(
        curvature=name,
        phase="curvature_update",
        median_s=m,
        repeats=10,
        others_cpu_share=0.0,
        device_kind="cpu",
        run_id=f"{name}{i}",
      )
      for name, values in medians.items()
      for i, m in enumerate(values)
    ]
  )


def test_reduce_cheaper_follows_the_timings():
  expand = [1.0, 1.05, 0.95]
  assert (
    verdict(
      eschenhagen,
      0,
      evidence(
        timing=timing({"kfac": expand, "kfac_reduce": [0.5, 0.52, 0.48]})
      ),
    )
    == HOLDS
  )
  assert (
    verdict(
      eschenhagen,
      0,
      evidence(timing=timing({"kfac": expand, "kfac_reduce": [2.0, 2.1, 1.9]})),
    )
    == FAILS
  )


@pytest.mark.parametrize(
  "reduce,outcome",
  [
    ([2.0, 2.01, 1.99], HOLDS),
    ([3.0, 3.01, 2.99], FAILS),
    ([2.0, 2.4, 1.6], UNSETTLED),
  ],
)
def test_same_progress_is_an_equivalence_within_the_margin(reduce, outcome):
  _, rows = training({"kfac": [2.0, 2.01, 1.99], "kfac_reduce": reduce})
  assert verdict(eschenhagen, 1, evidence(training=rows)) == outcome


# --- Sagun et al. / Papyan (outliers) ----------------------------------------


def spectra(top: list[float], bulk: int = 300):
  """A trained GGN's eigenvalues per seed: `top`, then a bulk decaying
  from 1e-3 to 1e-6."""
  values = np.concatenate([top, np.geomspace(1e-3, 1e-6, bulk)])
  return pd.DataFrame(
    [
      dict(source="exact", matrix="ggn", step=step, seed=seed, eigenvalue=v)
      for seed in SEEDS
      for step in (0, 100)
      for v in values
    ]
  )


def test_outliers_counted_at_the_gap():
  ten = list(np.geomspace(1.0, 0.1, sagun.CLASSES))
  assert verdict(sagun, 0, evidence(spectra=spectra(ten))) == HOLDS
  assert verdict(sagun, 0, evidence(spectra=spectra(ten[:3]))) == FAILS
  # no gap of two anywhere: no outliers
  smooth = pd.DataFrame(
    [
      dict(source="exact", matrix="ggn", step=0, seed=s, eigenvalue=v)
      for s in SEEDS
      for v in np.geomspace(1.0, 1e-3, 100)
    ]
  )
  assert verdict(sagun, 0, evidence(spectra=smooth)) == FAILS


def test_bulk_near_zero():
  assert verdict(sagun, 1, evidence(spectra=spectra([1.0, 0.5]))) == HOLDS
  flat = spectra([1.0], bulk=0).assign(eigenvalue=1.0)
  flat = pd.concat([flat] * 50)
  assert verdict(sagun, 1, evidence(spectra=flat)) == FAILS


# --- Ghorbani et al. (batch norm) --------------------------------------------


def hessians(isolated: dict[str, float]):
  """Per normalisation and seed, a trained Hessian whose top eigenvalue is
  `isolated[norm]` (times a little noise) above a smooth rest."""
  done, rows = [], []
  rest = np.geomspace(1.0, 1e-3, 40)
  for norm, top in isolated.items():
    for seed in SEEDS:
      run_id = f"{norm}{seed}"
      done.append(
        {"run_id": run_id, "config:problem.norm": norm, "config:seed": seed}
      )
      values = np.concatenate([[top * (1 + 0.05 * seed)], rest])
      rows += [
        dict(
          source="exact",
          matrix="hessian",
          step=step,
          sample=0,
          seed=seed,
          run_id=run_id,
          eigenvalue=v,
        )
        for step in (0, 200)
        for v in values
      ]
  return pd.DataFrame(done), pd.DataFrame(rows)


def test_batch_norm_claim_compares_the_isolation_of_the_top():
  done, rows = hessians({"batch": 2.0, "none": 100.0})
  assert verdict(ghorbani, 0, evidence(done, spectra=rows)) == HOLDS
  done, rows = hessians({"batch": 100.0, "none": 2.0})
  assert verdict(ghorbani, 0, evidence(done, spectra=rows)) == FAILS
  assert ghorbani.isolation(np.geomspace(1.0, 1e-3, 40)) == pytest.approx(
    1 / np.geomspace(1.0, 1e-3, 40)[ghorbani.RANK - 1]
  )


# --- Morwani et al. (Shampoo²) ------------------------------------------------


def kronecker_quality(errors: dict[str, float]):
  """Relative Frobenius errors per approximation (`errors`, times a
  little per-sample noise), whole network and two layers."""
  rows = []
  rng = np.random.default_rng(0)
  for seed, sample, level, block in itertools.product(
    SEEDS, (0, 1), ("network", "layer", "layer"), ("all", "l1", "l2")
  ):
    if (level == "network") != (block == "all"):
      continue
    noise = 1 + 0.01 * rng.normal()
    rows += [
      dict(
        problem="mlp",
        mode="ggn_exact",
        reference="ggn",
        level=level,
        block=block,
        step=0,
        seed=seed,
        sample=sample,
        data="batch",
        curvature=name,
        metric="relative_frobenius",
        value=value * noise,
      )
      for name, value in errors.items()
    ]
  return pd.DataFrame(rows).drop_duplicates()


def test_shampoo2_claims_follow_the_errors():
  near = kronecker_quality(
    {"shampoo": 0.9, "shampoo2": 0.3, "optimal_kronecker": 0.25}
  )
  assert verdict(morwani, 0, evidence(quality=near)) == HOLDS
  assert verdict(morwani, 1, evidence(quality=near)) == HOLDS
  far = kronecker_quality(
    {"shampoo": 0.3, "shampoo2": 0.9, "optimal_kronecker": 0.5}
  )
  assert verdict(morwani, 0, evidence(quality=far)) == FAILS
  assert verdict(morwani, 1, evidence(quality=far)) == FAILS


# --- Cohen et al. (edge of stability) ----------------------------------------


def sharpness_runs(curve):
  """Full-batch runs at step sizes 0.2 and 0.5, two seeds each: the
  sharpness at each step is `curve(eta, step)`."""
  done, rows = [], []
  for eta, seed in itertools.product((0.2, 0.5), (0, 1)):
    run_id = f"{eta}-{seed}"
    done.append({"run_id": run_id, cohen.RATE: eta, "config:seed": seed})
    rows += [
      dict(
        source="exact",
        matrix="hessian",
        statistic="max_eigenvalue",
        run_id=run_id,
        seed=seed,
        step=step,
        value=curve(eta, step),
      )
      for step in cohen.STEPS
    ]
  return pd.DataFrame(done), pd.DataFrame(rows)


def test_edge_of_stability_claims_follow_the_sharpness():
  # Rises from 2 to 2/eta by step 100 and hovers there.
  hovering = sharpness_runs(
    lambda eta, step: 2 + (2 / eta - 2) * min(step / 100, 1)
  )
  found = evidence(*hovering[:1], statistics=hovering[1])
  assert [verdict(cohen, i, found) for i in range(3)] == [HOLDS] * 3
  # Flat below 2/eta: neither sharpens nor reaches it.
  flat = sharpness_runs(lambda eta, step: 2.0)
  found = evidence(*flat[:1], statistics=flat[1])
  assert [verdict(cohen, i, found) for i in range(3)] == [FAILS, FAILS, HOLDS]
  # Settled at twice 2/eta late in training.
  above = sharpness_runs(
    lambda eta, step: 2 + (4 / eta - 2) * min(step / 100, 1)
  )
  found = evidence(*above[:1], statistics=above[1])
  assert verdict(cohen, 2, found) == FAILS


# --- Gur-Ari et al. (tiny subspace) -------------------------------------------


def test_tiny_subspace_claim_reads_the_late_shares():
  def shares(late):
    return pd.DataFrame(
      [
        dict(
          source="exact",
          matrix="hessian",
          statistic=gurari.GRADIENT_SHARE,
          seed=seed,
          step=step,
          value=0.3 if step < gurari.SETTLED else late,
        )
        for seed in SEEDS
        for step in gurari.STEPS
      ]
    )

  assert verdict(gurari, 0, evidence(statistics=shares(0.95))) == HOLDS
  assert verdict(gurari, 0, evidence(statistics=shares(0.5))) == FAILS


def test_missing_records_leave_a_claim_not_settled():
  for entry in gallery.entries().values():
    for claim in entry.claims:
      found = claim.judge(evidence())
      assert found.outcome == UNSETTLED and "lack" in found.evidence


# --- the entries as presets, and run ------------------------------------------


def jobs(entry, size):
  return tuning_sweeper.union({}, entry.parts(size), [])


@pytest.mark.slow
def test_every_entry_composes_at_every_size_and_the_gallery_has_them_all():
  found = gallery.experiments()
  gallery_parts = found["gallery"]["hydra"]["sweeper"]["sweeps"]
  for name, entry in gallery.entries().items():
    assert {p["repro"] for p in entry.parts()} == {name}
    assert [p for p in gallery_parts if p["repro"] == name] == entry.parts()
    for size in entry.sweeps:
      for job in jobs(entry, size):
        config.compose(*job)  # checked: every key and value valid
  cfg = config.compose(
    "+experiment=repro_sagun2017_outliers", with_hydra=True, check=False
  )
  assert cfg.name == "repro_sagun2017_outliers"
  assert cfg.hydra.sweeper.sweeps[0].repro == "sagun2017_outliers"
  with pytest.raises(config.ConfigError, match="no gallery entry"):
    config.compose("repro=nobody")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(gallery.entries()))
def test_each_entry_at_its_tiny_size_is_judged_from_its_records(tmp_path, name):
  entry = gallery.entries()[name]
  for i, job in enumerate(jobs(entry, "tiny")):
    runs.run(config.compose(*job, "compilation_cache=null"), tmp_path / str(i))
  loaded = sweep.load_sweep(tmp_path)
  judged = page.judge(sweep.settings(loaded.runs), loaded.tables)
  assert [j.entry.name for j in judged] == [name]
  for claim, found in judged[0].verdicts:
    assert "lack" not in found.evidence, (claim.statement, found.evidence)
  text = page.write(tmp_path, tmp_path / "report", judged)[0].read_text()
  assert entry.title in text
  assert all(found.outcome in text for _, found in judged[0].verdicts)
