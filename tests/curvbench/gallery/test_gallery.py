"""The gallery: every claim judged from records built for each verdict it
can give (reproduced, contradicted, not reproduced at this scale where a
condition differs, inconclusive, too few samples to tell), no verdict from
three samples anywhere, a contradiction impossible wherever a declared
condition is not met, the kinds counted apart; and every entry run at its
tiny size, judged from the records the runs wrote."""

import dataclasses
import itertools
import json

import numpy as np
import pandas as pd
import pytest

from curvbench import config, gallery, planning, runs, sweep
from curvbench.gallery import (
  CHECK,
  CONTRADICTED,
  EXTENSION,
  FAILS,
  FINDING,
  INCONCLUSIVE,
  NO_VERDICT,
  NOT_AT_SCALE,
  PASSES,
  REPRODUCED,
  TOO_FEW,
  UNJUDGED,
  Evidence,
  Verdict,
  page,
)
from curvbench.gallery import cohen2021_edge_of_stability as cohen
from curvbench.gallery import eschenhagen2023_kfac_reduce as eschenhagen
from curvbench.gallery import george2018_ekfac as george
from curvbench.gallery import ghorbani2019_batch_norm as ghorbani
from curvbench.gallery import gurari2018_tiny_subspace as gurari
from curvbench.gallery import martens2015_kfac as martens
from curvbench.gallery import morwani2025_shampoo2 as morwani
from curvbench.gallery import sagun2017_outliers as sagun

# Enough for an exact 95 % interval: six runs (one group), four per group.
SIX, FOUR, THREE = range(6), range(4), range(3)


def judge(entry, claim: int, found: Evidence):
  return entry.ENTRY.claims[claim].judge(found)


def outcome(entry, claim: int, found: Evidence) -> str:
  return judge(entry, claim, found).outcome


def noise(seed: int, scale: float = 0.01) -> float:
  """A small, fixed, seed-dependent wobble, so samples are not all equal."""
  return 1 + scale * np.sin(1.0 + seed)


# --- the framework -------------------------------------------------------------


def test_a_contradiction_needs_every_declared_condition():
  """Any claim whose check says contradicted, on records that cannot show a
  condition it declares, is not reproduced at this scale instead."""
  for entry in gallery.entries().values():
    for claim in entry.claims:
      if claim.kind == CHECK:
        continue
      forced = dataclasses.replace(
        claim, check=lambda _: Verdict(CONTRADICTED, "forced")
      )
      found = forced.judge(Evidence(pd.DataFrame(), {}))
      if claim.conditions:
        assert found.outcome == NOT_AT_SCALE, (entry.name, claim.statement)
        assert all(not m.met for m in found.conditions)
      else:
        assert found.outcome == CONTRADICTED


def test_missing_records_leave_every_claim_unjudged():
  for entry in gallery.entries().values():
    for claim in entry.claims:
      found = claim.judge(Evidence(pd.DataFrame(), {}))
      assert found.outcome == UNJUDGED and "lack" in found.evidence


def test_every_entry_states_its_claims_kinds_sizes_and_sources():
  kinds = [c.kind for e in gallery.entries().values() for c in e.claims]
  assert set(kinds) <= {FINDING, EXTENSION, CHECK} and FINDING in kinds
  for entry in gallery.entries().values():
    assert set(entry.sizes) == set(gallery.SIZES)
    for claim in entry.claims:
      assert claim.where and claim.statement
    assert entry.counted() == tuple(
      c for c in entry.claims if c.kind == FINDING
    )
  # The by-construction ones are checks, Adam in the K-FAC paper an extension.
  assert george.ENTRY.claims[0].kind == CHECK
  assert morwani.ENTRY.claims[2].kind == CHECK
  assert martens.ENTRY.claims[1].kind == EXTENSION


def test_a_check_cannot_return_a_findings_verdict():
  claim = dataclasses.replace(
    george.ENTRY.claims[0], check=lambda _: Verdict(REPRODUCED, "")
  )
  with pytest.raises(ValueError, match="returns one of"):
    claim.judge(Evidence(pd.DataFrame(), {}))


def test_against_judges_over_a_range_and_names_where_it_flips():
  low = gallery.Threshold(0.5, 0.9, "ours")
  values = [0.7, 0.72, 0.74, 0.76, 0.78, 0.8]  # interval [0.7, 0.8]
  found = gallery.against(values, low, above=True, what="share")
  assert found.outcome == INCONCLUSIVE
  assert "reproduced for t below 0.7, contradicted above 0.8" in found.evidence
  assert (
    gallery.against(values, gallery.Threshold(0.5, 0.6, "x"), True, "s").outcome
    == REPRODUCED
  )
  assert (
    gallery.against(
      values, gallery.Threshold(0.85, 0.9, "x"), True, "s"
    ).outcome
    == CONTRADICTED
  )
  assert gallery.against(values[:5], low, True, "s").outcome == TOO_FEW
  paper = gallery.Threshold(1.0, 1.0, "the paper's", paper=1.0)
  assert (
    gallery.against(values, paper, above=False, what="s").outcome == REPRODUCED
  )


def test_page_counts_findings_extensions_and_checks_apart():
  found = page.Judged(
    martens.ENTRY,
    Evidence(pd.DataFrame({"config:repro_size": ["cpu"]}), {}),
    [
      (martens.ENTRY.claims[0], Verdict(REPRODUCED, "")),
      (martens.ENTRY.claims[1], Verdict(CONTRADICTED, "")),
    ],
  )
  checked = page.Judged(
    george.ENTRY,
    Evidence(pd.DataFrame(), {}),
    [(george.ENTRY.claims[0], Verdict(PASSES, ""))],
  )
  counts = page.tally([found, checked])
  assert counts == {
    FINDING: {REPRODUCED: 1},
    EXTENSION: {CONTRADICTED: 1},
    CHECK: {PASSES: 1},
  }
  words = page.tally_words([found, checked])
  assert words.startswith("1 findings (the papers' own claims): 1 reproduced.")
  assert "1 checks (true by construction" in words


# --- Cohen et al. (edge of stability) ----------------------------------------


def edge_runs(curve, seeds=(0, 1), loss="one_hot_squared_error", **change):
  """Full-batch runs at three step sizes per seed: the sharpness over 2/η at
  gradient-flow time τ is `curve(τ)`; every condition met unless `change`d
  (`every`: steps between measurements, `batch`, `error`: final training
  error, `momentum`)."""
  spec = dict(every=2, batch=1500, error=0.0, momentum=0.0) | change
  done, rows = [], []
  for eta, seed in itertools.product((0.02, 0.03, 0.04), seeds):
    run_id = f"{eta}-{seed}"
    done.append(
      {
        "run_id": run_id,
        cohen.RATE: eta,
        "config:optimizer.name": "sgd",
        "config:optimizer.momentum": spec["momentum"],
        "config:measure.training.sharpness_every": spec["every"],
      }
    )
    steps = np.arange(0, int(200 / eta) + 1, spec["every"])
    for step in steps:
      rows.append(
        dict(
          measure="training",
          run_id=run_id,
          seed=seed,
          step=step,
          loss=loss,
          batch_size=spec["batch"],
          num_train=1500,
          sharpness=curve(step * eta) * noise(seed) * 2 / eta,
          train_loss=1.0 / (1 + step * eta),
          train_error=spec["error"] if step == steps[-1] else 0.5,
        )
      )
  return Evidence(pd.DataFrame(done), {"training": pd.DataFrame(rows)})


def test_edge_of_stability_claims_follow_the_sharpness():
  # Rises from half of 2/eta to it by tau = 50, then hovers 2 % above.
  edge = edge_runs(lambda t: 0.5 + 0.52 * min(t / 50, 1))
  found = [outcome(cohen, i, edge) for i in range(3)]
  assert found == [REPRODUCED] * 3
  # Falling from half of 2/eta: no sharpening; never reaches; none to hover.
  flat = edge_runs(lambda t: 0.5 - 0.1 * min(t / 50, 1))
  assert outcome(cohen, 0, flat) == CONTRADICTED
  assert outcome(cohen, 1, flat) == CONTRADICTED
  assert outcome(cohen, 2, flat) == TOO_FEW  # no run reached 2/eta
  # Settled at twice 2/eta.
  above = edge_runs(lambda t: 0.5 + 1.5 * min(t / 50, 1))
  assert outcome(cohen, 2, above) == CONTRADICTED
  # The same, measured too rarely: not a contradiction.
  rare = edge_runs(lambda t: 0.5 + 1.5 * min(t / 50, 1), every=50)
  found = judge(cohen, 2, rare)
  assert found.outcome == NOT_AT_SCALE
  assert [m.condition.name for m in found.differing] == [
    "sharpness measured often"
  ]
  # Nor where the runs stop short of the accuracy goal, or use mini-batches.
  assert outcome(cohen, 2, edge_runs(lambda t: 2.0, error=0.2)) == NOT_AT_SCALE
  assert outcome(cohen, 2, edge_runs(lambda t: 2.0, batch=64)) == NOT_AT_SCALE
  # Cross-entropy's claim reads the cross-entropy runs only: the sharpness
  # falls from its peak once the loss is small.
  assert outcome(cohen, 3, edge) == UNJUDGED
  falling = edge_runs(
    lambda t: 0.6 * np.exp(-t / 100), loss="softmax_cross_entropy"
  )
  assert outcome(cohen, 3, falling) == REPRODUCED
  rising = edge_runs(
    lambda t: 0.2 + 0.4 * t / 200, loss="softmax_cross_entropy"
  )
  assert outcome(cohen, 3, rising) == CONTRADICTED
  # Unlike the squared loss's claims, it does not need the accuracy goal.
  short = edge_runs(
    lambda t: 0.2 + 0.4 * t / 200,
    loss="softmax_cross_entropy",
    error=0.2,
  )
  assert outcome(cohen, 3, short) == CONTRADICTED


def test_reaching_two_over_eta_is_judged_over_its_range():
  # Peaks at 0.95 of 2/eta: reached at 0.9, not at 1: no verdict of ours.
  near = edge_runs(lambda t: 0.5 + 0.45 * min(t / 50, 1))
  found = judge(cohen, 1, near)
  assert found.outcome == INCONCLUSIVE and "depends on t" in found.evidence


def test_a_verdict_over_a_range_says_whether_the_whole_range_agrees():
  ours = gallery.Threshold(0.9, 1.0, "ours")
  # The interval straddles both ends: inconclusive at every t, which is
  # not a verdict that depends on t.
  wide = gallery.against(np.linspace(0.5, 1.5, 8), ours, True, "x")
  assert wide.outcome == INCONCLUSIVE
  assert "inconclusive over the whole range" in wide.evidence
  margin = gallery.Threshold(0.1, 0.25, "ours")
  spread = [100.0, 90, 140, 60, 110, 80, 150, 70]
  apart = gallery.equivalent(spread, spread[::-1], ("a", "b"), "x", margin)
  assert apart.outcome == INCONCLUSIVE
  assert "inconclusive over the whole range" in apart.evidence
  assert "told apart within none: the interval holds no difference" in (
    apart.evidence
  )
  same = gallery.equivalent([5.0] * 4, [5.0] * 4, ("a", "b"), "x", margin)
  assert same.outcome == REPRODUCED and "within none" in same.evidence


# --- Sagun et al. / Papyan (outliers) ----------------------------------------


def ggn_runs(
  top,
  seeds=SIX,
  bulk=300,
  overlap=0.95,
  error=0.0,
  data="train",
  problem="convnet",
):
  """A trained GGN's eigenvalues per seed (`top`, then a bulk decaying from
  1e-3 to 1e-6), smooth at initialisation; the class-mean overlap; the
  final training error; where the spectrum was taken; the network, trained
  by SGD with weight decay."""
  trained = np.concatenate([top, np.geomspace(1e-3, 1e-6, bulk)])
  untrained = np.geomspace(1.0, 1e-6, trained.size)
  done, spectra, statistics, training = [], [], [], []
  for seed in seeds:
    run_id = f"r{seed}"
    done.append(
      {
        "run_id": run_id,
        "config:measure.spectra.data": data,
        "config:problem.name": problem,
        "config:measure.spectra.trainer.name": "sgd",
        "config:measure.spectra.trainer.weight_decay": 5e-4,
        "config:measure.spectra.steps": "[0, 100]",
      }
    )
    for step, values in ((0, untrained), (100, trained)):
      spectra += [
        dict(
          source="exact",
          matrix="ggn",
          step=step,
          sample=0,
          seed=seed,
          run_id=run_id,
          loss="softmax_cross_entropy",
          eigenvalue=v * noise(seed),
        )
        for v in values
      ]
      statistics.append(
        dict(
          source="exact",
          matrix="ggn",
          statistic=sagun.OVERLAP,
          step=step,
          run_id=run_id,
          seed=seed,
          num_params=3466,
          value=(overlap if step else 0.1) * noise(seed),
        )
      )
    training.append(
      dict(measure="training", run_id=run_id, step=100, train_error=error)
    )
  return Evidence(
    pd.DataFrame(done),
    {
      "spectra": pd.DataFrame(spectra),
      "statistics": pd.DataFrame(statistics),
      "training": pd.DataFrame(training),
    },
  )


def test_outliers_are_counted_at_the_gap_after_the_cth():
  ten = list(np.geomspace(1.0, 0.1, sagun.CLASSES))  # C outliers, then 1e-3
  assert outcome(sagun, 0, ggn_runs(ten)) == REPRODUCED
  smooth = list(np.geomspace(1.0, 1e-3, 40))  # no edge at C
  assert outcome(sagun, 0, ggn_runs(smooth)) == CONTRADICTED
  # Not in the terminal phase, or on an MLP: no contradiction.
  assert outcome(sagun, 0, ggn_runs(smooth, error=0.05)) == NOT_AT_SCALE
  assert outcome(sagun, 0, ggn_runs(smooth, problem="mlp")) == NOT_AT_SCALE
  # An MLP is in Sagun et al.'s family: the bulk's claim can be contradicted.
  flat = ggn_runs([1.0], bulk=0, problem="mlp")
  flat.tables["spectra"] = flat.tables["spectra"].assign(eigenvalue=0.5)
  assert outcome(sagun, 1, flat) == CONTRADICTED
  assert outcome(sagun, 0, ggn_runs(ten, seeds=THREE)) == TOO_FEW


def test_the_bulk_and_the_class_means():
  ten = list(np.geomspace(1.0, 0.1, sagun.CLASSES))
  assert outcome(sagun, 1, ggn_runs(ten)) == REPRODUCED
  flat = ggn_runs([1.0], bulk=0)
  flat.tables["spectra"] = flat.tables["spectra"].assign(eigenvalue=0.5)
  assert outcome(sagun, 1, flat) == CONTRADICTED
  assert outcome(sagun, 2, ggn_runs(ten)) == REPRODUCED
  assert outcome(sagun, 2, ggn_runs(ten, overlap=0.2)) == CONTRADICTED
  assert outcome(sagun, 2, ggn_runs(ten, overlap=0.7)) == INCONCLUSIVE
  assert (
    outcome(sagun, 2, ggn_runs(ten, overlap=0.2, data="batch")) == NOT_AT_SCALE
  )


def test_claims_about_trained_networks_refuse_records_that_stop_short():
  """Records that stop before the last step a run was set to measure at
  (the trained network's missing) leave every claim about trained networks
  unjudged, naming the run, rather than judged on the untrained one."""
  ten = list(np.geomspace(1.0, 0.1, sagun.CLASSES))
  for cut in (
    lambda df: df[df.step == 0],  # only the untrained records
    lambda df: df.iloc[:0],  # none at all
  ):
    found = ggn_runs(ten)
    found.tables = {n: cut(df) for n, df in found.tables.items()}
    for claim in range(3):
      verdict = judge(sagun, claim, found)
      assert verdict.outcome == UNJUDGED, (claim, verdict)
  found = ggn_runs(ten)
  found.done["config:measure.spectra.steps"] = "[0, 100, 200]"
  verdict = judge(sagun, 0, found)
  assert verdict.outcome == UNJUDGED
  assert (
    "step 200" in verdict.evidence and "stop at step 100" in verdict.evidence
  )
  found.done["config:measure.spectra.steps"] = "[0]"  # never trained
  assert "no trained step" in judge(sagun, 0, found).evidence
  found.done["config:measure.spectra.steps"] = "not a list"  # malformed
  assert judge(sagun, 0, found).outcome == UNJUDGED
  shares = hessian_runs({"batch": 10.0, "none": 10.0})
  shares.done["config:measure.spectra.steps"] = "[300, 600]"
  for claim in range(len(ghorbani.ENTRY.claims)):
    assert judge(ghorbani, claim, shares).outcome == UNJUDGED


def test_records_of_another_type_leave_a_claim_unjudged_saying_why():
  """A column whose type changed, or a table of other columns, is no
  traceback: the claim is not judged and says what it could not read."""
  ten = list(np.geomspace(1.0, 0.1, sagun.CLASSES))
  found = ggn_runs(ten)
  found.tables["spectra"] = found.tables["spectra"].assign(eigenvalue="x")
  verdict = judge(sagun, 0, found)
  assert verdict.outcome == UNJUDGED and "records" in verdict.evidence
  found = ggn_runs(ten)
  found.tables["spectra"] = found.tables["spectra"].drop(columns="eigenvalue")
  verdict = judge(sagun, 0, found)
  assert verdict.outcome == UNJUDGED and "eigenvalue" in verdict.evidence
  found = ggn_runs(ten)
  found.done = found.done.drop(columns="run_id")
  assert judge(sagun, 0, found).outcome == UNJUDGED


# --- Ghorbani et al. (batch norm) --------------------------------------------


def hessian_runs(
  isolated: dict[str, float],
  seeds=FOUR,
  shares=None,
  data="train",
  untrained=(),
):
  """Per normalisation and seed, a trained Hessian whose top eigenvalue is
  `isolated[norm]` above a smooth rest; the gradient's share `shares[norm]`
  in the top eigenspace; the runs `untrained` (ids) end at chance."""
  shares = shares or {"batch": 0.2, "none": 0.9}
  rest = np.geomspace(1.0, 1e-3, 60)
  done, spectra, statistics, training = [], [], [], []
  for norm, top in isolated.items():
    for seed in seeds:
      run_id = f"{norm}{seed}"
      for step, error in (
        (0, 0.9),
        (300, 0.88 if run_id in untrained else 0.1),
      ):
        training.append(dict(run_id=run_id, step=step, train_error=error))
      done.append(
        {
          "run_id": run_id,
          "config:problem.norm": norm,
          "config:seed": seed,
          "config:problem.name": "resnet_small",
          "config:measure.spectra.data": data,
          "config:measure.spectra.steps": "[300]",
        }
      )
      values = np.concatenate([[top * noise(seed, 0.05)], rest])
      spectra += [
        dict(
          source="exact",
          matrix="hessian",
          step=300,
          sample=0,
          seed=seed,
          run_id=run_id,
          eigenvalue=v,
        )
        for v in values
      ]
      statistics.append(
        dict(
          source="exact",
          matrix="hessian",
          statistic=ghorbani.GRADIENT_SHARE,
          step=300,
          run_id=run_id,
          value=shares[norm] * noise(seed),
        )
      )
  return Evidence(
    pd.DataFrame(done),
    {
      "spectra": pd.DataFrame(spectra),
      "statistics": pd.DataFrame(statistics),
      "training": pd.DataFrame(training),
    },
  )


def test_batch_norm_claims_leave_out_the_runs_that_did_not_train():
  """A collapsed network's Hessian (a few eigenvalues, the rest zero) is
  not a trained one's: such runs are left out, named, and what remains
  decides, too few samples included."""
  one_dead = hessian_runs({"batch": 2.0, "none": 100.0}, untrained=("none1",))
  for claim in (0, 1):
    assert outcome(ghorbani, claim, one_dead) == TOO_FEW
    verdict = judge(ghorbani, claim, one_dead)
    assert "left out, not trained" in verdict.evidence
    assert "none (training error 0.88)" in verdict.evidence
  five = hessian_runs(
    {"batch": 2.0, "none": 100.0}, seeds=(*FOUR, 9), untrained=("none9",)
  )
  assert outcome(ghorbani, 0, five) == REPRODUCED
  assert ghorbani.isolation(np.array([3.0, 1.0, 0.0]), 3) == np.inf


def test_batch_norm_claims_compare_the_isolation_and_the_gradient():
  assert (
    outcome(ghorbani, 0, hessian_runs({"batch": 2.0, "none": 100.0}))
    == REPRODUCED
  )
  assert (
    outcome(ghorbani, 0, hessian_runs({"batch": 100.0, "none": 2.0}))
    == CONTRADICTED
  )
  assert (
    outcome(
      ghorbani, 0, hessian_runs({"batch": 100.0, "none": 2.0}, data="batch")
    )
    == NOT_AT_SCALE
  )
  assert (
    outcome(
      ghorbani, 0, hessian_runs({"batch": 2.0, "none": 100.0}, seeds=THREE)
    )
    == TOO_FEW
  )
  assert (
    outcome(ghorbani, 1, hessian_runs({"batch": 2.0, "none": 100.0}))
    == REPRODUCED
  )
  flipped = hessian_runs(
    {"batch": 2.0, "none": 100.0}, shares={"batch": 0.9, "none": 0.2}
  )
  assert outcome(ghorbani, 1, flipped) == CONTRADICTED


# --- Gur-Ari et al. (tiny subspace) -------------------------------------------


def subspace_runs(share, alignment, seeds=SIX, momentum=0):
  done, statistics = [], []
  for seed in seeds:
    run_id = f"r{seed}"
    done.append(
      {
        "run_id": run_id,
        "config:measure.spectra.trainer.name": "sgd",
        "config:measure.spectra.trainer.momentum": momentum,
        "config:measure.spectra.data": "train",
        "config:measure.spectra.top_k": gurari.CLASSES,
        "config:measure.spectra.steps": json.dumps(list(gurari.STEPS)),
      }
    )
    for step in gurari.STEPS:
      for name, late in (
        (gurari.GRADIENT_SHARE, share),
        (gurari.ALIGNMENT, alignment),
      ):
        statistics.append(
          dict(
            source="exact",
            matrix="hessian",
            statistic=name,
            run_id=run_id,
            seed=seed,
            step=step,
            num_params=1482,
            num_train=1500,
            batch_size=64,
            loss="softmax_cross_entropy",
            value=(late if step else 0.1) * noise(seed),
          )
        )
  return Evidence(pd.DataFrame(done), {"statistics": pd.DataFrame(statistics)})


def test_tiny_subspace_claims_read_late_training_against_chance():
  found = judge(gurari, 0, subspace_runs(0.95, 0.95))
  assert found.outcome == REPRODUCED and "times chance" in found.evidence
  assert outcome(gurari, 0, subspace_runs(0.3, 0.95)) == CONTRADICTED
  assert outcome(gurari, 0, subspace_runs(0.7, 0.95)) == INCONCLUSIVE
  assert (
    outcome(gurari, 0, subspace_runs(0.3, 0.95, momentum=0.9)) == NOT_AT_SCALE
  )
  assert outcome(gurari, 1, subspace_runs(0.95, 0.95)) == REPRODUCED
  assert outcome(gurari, 1, subspace_runs(0.95, 0.5)) == CONTRADICTED


# --- Martens & Grosse (K-FAC) ------------------------------------------------


def tuned_training(
  errors: dict, problem="autoencoder_curves", budget=10.0, kfac_steps=600
):
  """Training records of `{(optimizer, learning rate): errors per seed}`,
  each run at its error on the last point of its time grid."""
  rows, done = [], []
  for (name, rate), values in errors.items():
    for seed, error in enumerate(values):
      run_id = f"{name}-{rate}-{seed}"
      done.append(
        {
          "run_id": run_id,
          "problem": problem,
          "config:problem.name": problem,
          "config:problem.init": "sparse",
          "config:optimizer.name": name,
          "config:optimizer.learning_rate": rate,
          "config:seed": seed,
          "config:measure.training.budget_s": budget,
          "config:measure.training.average_decay": 0.99,
          "config:measure.training.batch_growth_steps": 500,
        }
      )
      end = kfac_steps if name == "kfac" else 5000
      for step, at, value in ((0, 0.0, 50.0), (end, budget, error)):
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
  return Evidence(pd.DataFrame(done), {"training": pd.DataFrame(rows)})


def test_kfac_paper_claims_compare_each_optimizers_best_setting():
  errors = {
    ("kfac", None): [3.0, 3.1, 2.9, 3.05],
    ("sgd", 0.01): [5.0, 5.2, 4.9, 5.1],  # the baseline's best
    ("sgd", 0.03): [1.0, 9.0, 30.0, 8.0],  # lower once, worse mean
    ("adam", 0.001): [2.0, 2.1, 1.9, 2.05],
  }
  found = tuned_training(errors)
  chosen = martens.chosen(found)
  assert set(chosen[chosen.method == "sgd"].setting) == {"learning_rate=0.01"}
  judged = judge(martens, 0, found)
  assert judged.outcome == REPRODUCED
  assert judged.evidence.startswith("at 10 s of training")
  assert judged.evidence.endswith("others' CPU share at most 3% while training")
  assert "best of 2" in judged.evidence
  assert outcome(martens, 1, found) == CONTRADICTED  # Adam lower
  # On a narrowed network, a loss is not a contradiction of the paper.
  narrowed = tuned_training(errors, problem="autoencoder_curves_small")
  assert outcome(martens, 1, narrowed) == NOT_AT_SCALE
  # Nor where K-FAC never got past its batch growth.
  short = tuned_training(errors, kfac_steps=100)
  assert outcome(martens, 1, short) == NOT_AT_SCALE
  few = {k: v[:3] for k, v in errors.items()}
  assert outcome(martens, 0, tuned_training(few)) == TOO_FEW


# --- George et al. (EKFAC) ----------------------------------------------------


def quality(ekfac_over_kfac, seeds=SIX):
  """Per-block errors, EKFAC's `ekfac_over_kfac(seed, step, block)` times
  K-FAC's."""
  rows = []
  for seed, step, block in itertools.product(seeds, (0, 10), ("l1", "l2")):
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
  return Evidence(pd.DataFrame(), {"quality": pd.DataFrame(rows)})


def test_ekfac_check_passes_only_where_every_block_is_closer():
  assert outcome(george, 0, quality(lambda *_: 0.8)) == PASSES
  assert outcome(george, 0, quality(lambda *_: 1.0)) == PASSES  # at most
  found = judge(
    george,
    0,
    quality(
      lambda seed, step, block: 1.2 if (seed, block) == (1, "l2") else 0.8
    ),
  )
  assert found.outcome == FAILS
  assert "2 of 24" in found.evidence and "seed 1, step 10, l2" in found.evidence
  assert outcome(george, 0, quality(lambda *_: 0.8, seeds=THREE)) == TOO_FEW


def ekfac_training(
  losses: dict[str, list[float]],
  problem="autoencoder_mnist",
  mode="fisher_empirical",
):
  rows, done = [], []
  for name, values in losses.items():
    for damping, seed in itertools.product((1.0, 10.0), range(len(values))):
      run_id = f"{name}{damping}-{seed}"
      done.append(
        {
          "run_id": run_id,
          "problem": "p",
          "config:seed": seed,
          "config:curvature.name": name,
          "config:problem.name": problem,
          "config:curvature.mode": mode,
          "config:optimizer.initial_damping": damping,
          "config:measure.training.budget_s": 4.0,
        }
      )
      loss = values[seed] * (1 if damping == 1.0 else 2)
      for step, at, value in ((0, 0.0, 3.0), (9, 4.0, loss)):
        rows.append(
          dict(
            measure="training",
            curvature=name,
            run_id=run_id,
            problem="p",
            seed=seed,
            step=step,
            wall_s=at,
            time_point_s=at,
            train_loss=value,
            diverged=False,
          )
        )
  return Evidence(pd.DataFrame(done), {"training": pd.DataFrame(rows)})


@pytest.mark.parametrize(
  "ekfac,expected",
  [
    ([1.0, 1.1, 0.9, 1.05], REPRODUCED),
    ([3.0, 3.1, 2.9, 3.05], CONTRADICTED),
    ([2.0, 1.0, 3.0, 2.05], INCONCLUSIVE),
  ],
)
def test_ekfac_faster_compares_the_tuned_runs_at_equal_time(ekfac, expected):
  found = ekfac_training({"kfac": [2.0, 2.1, 1.9, 2.05], "ekfac": ekfac})
  assert outcome(george, 1, found) == expected


def test_ekfac_on_another_network_or_curvature_is_no_contradiction():
  losses = {"kfac": [2.0, 2.1, 1.9, 2.05], "ekfac": [3.0, 3.1, 2.9, 3.05]}
  assert (
    outcome(george, 1, ekfac_training(losses, problem="autoencoder"))
    == NOT_AT_SCALE
  )
  assert (
    outcome(george, 1, ekfac_training(losses, mode="fisher_gradients"))
    == NOT_AT_SCALE
  )


def test_a_claims_conditions_are_read_off_its_own_runs():
  """The entry's spectra runs (another mode, their own trainer's rows) do
  not make the equal-time claim's conditions differ."""
  found = ekfac_training(
    {"kfac": [2.0, 2.1, 1.9, 2.05], "ekfac": [3.0, 3.1, 2.9, 3.05]}
  )
  spectra = {
    "run_id": "spectra0",
    "config:problem.name": "autoencoder",
    "config:curvature.mode": "ggn_exact",
  }
  trainer = dict(measure="spectra", run_id="spectra0", step=0, train_loss=1.0)
  both = Evidence(
    pd.concat([found.done, pd.DataFrame([spectra])], ignore_index=True),
    {"training": pd.concat([found.table("training"), pd.DataFrame([trainer])])},
  )
  assert outcome(george, 1, both) == CONTRADICTED


# --- Eschenhagen et al. (K-FAC-reduce) -----------------------------------------


def reduce_runs(medians, to_target, loss="softmax_cross_entropy"):
  """Timed rounds of the curvature update (one run per flavour, its rounds
  `medians`) and training runs that reach a test error of 0.2 after
  `to_target` steps."""
  timing, samples, training, done = [], [], [], []
  for name, values in medians.items():
    run_id = f"t{name}"
    common = dict(
      problem="resnet", curvature=name, phase="curvature_update", run_id=run_id
    )
    timing.append(
      dict(
        common,
        median_s=float(np.median(values)),
        repeats=len(values),
        others_cpu_share=0.0,
        device_kind="cpu",
        loss="softmax_cross_entropy",
      )
    )
    samples += [dict(common, repeat=i, seconds=m) for i, m in enumerate(values)]
    done.append({"run_id": run_id})
  for name, values in to_target.items():
    for seed, steps in enumerate(values):
      run_id = f"{name}{seed}"
      done.append(
        {
          "run_id": run_id,
          "config:measure.training.target_error": 0.2,
          "config:optimizer.initial_damping": (0.1, 1.0)[seed % 2],
        }
      )
      for step in range(0, 301, 10):
        training.append(
          dict(
            measure="training",
            problem="resnet_small",
            curvature=name,
            run_id=run_id,
            step=step,
            wall_s=step * 0.01,
            loss=loss,
            test_error=0.1 if step >= steps else 0.5,
            diverged=False,
          )
        )
  return Evidence(
    pd.DataFrame(done),
    {
      "timing": pd.DataFrame(timing),
      "timing_samples": pd.DataFrame(samples),
      "training": pd.DataFrame(training),
    },
  )


def test_reduce_claims_follow_the_timings_and_the_steps_to_target():
  expand = [1.0, 1.05, 0.95, 1.02]
  same = {"kfac": [100, 102, 98, 100], "kfac_reduce": [100, 101, 99, 100]}
  found = reduce_runs(
    {"kfac": expand, "kfac_reduce": [0.5, 0.52, 0.48, 0.51]}, same
  )
  assert outcome(eschenhagen, 0, found) == REPRODUCED
  assert outcome(eschenhagen, 1, found) == REPRODUCED
  slower = reduce_runs(
    {"kfac": expand, "kfac_reduce": [2.0, 2.1, 1.9, 2.05]}, same
  )
  assert outcome(eschenhagen, 0, slower) == CONTRADICTED
  apart = {"kfac": [100, 110, 100, 90], "kfac_reduce": [250, 260, 270, 280]}
  assert (
    outcome(eschenhagen, 1, reduce_runs({"kfac": expand}, apart))
    == CONTRADICTED
  )
  # The expand setting's runs bear on the extension only.
  per_position = reduce_runs(
    {"kfac": expand}, apart, loss="sequence_softmax_cross_entropy"
  )
  assert outcome(eschenhagen, 1, per_position) == UNJUDGED
  assert outcome(eschenhagen, 2, per_position) == CONTRADICTED


# --- Morwani et al. (Shampoo²) ------------------------------------------------


def kronecker_quality(cosines: dict[str, float], seeds=SIX, mode="ggn_exact"):
  """Per-layer cosine similarities (`cosines`) and relative Frobenius
  errors (1 - cosine), per seed and batch, at steps 0 and 50."""
  rows = []
  for seed, sample, step, block in itertools.product(
    seeds, (0, 1), (0, 50), ("l1", "l2")
  ):
    for name, cos in cosines.items():
      for metric, value in (
        ("cosine_similarity", cos * noise(seed, 0.001)),
        ("relative_frobenius", 1 - cos),
      ):
        rows.append(
          dict(
            curvature=name,
            mode=mode,
            reference="ggn",
            level="layer",
            block=block,
            step=step,
            seed=seed,
            sample=sample,
            metric=metric,
            value=value,
          )
        )
  done = pd.DataFrame({"run_id": ["r"], "config:curvature.mode": [mode]})
  return Evidence(done, {"quality": pd.DataFrame(rows)})


def test_shampoo2_claims_follow_the_cosine_similarities():
  near = kronecker_quality(
    {"shampoo": 0.6, "shampoo2": 0.979, "optimal_kronecker": 0.98}
  )
  assert [outcome(morwani, i, near) for i in range(3)] == [
    REPRODUCED,
    REPRODUCED,
    PASSES,
  ]
  far = kronecker_quality(
    {"shampoo": 0.9, "shampoo2": 0.5, "optimal_kronecker": 0.6}
  )
  assert outcome(morwani, 0, far) == CONTRADICTED
  assert outcome(morwani, 1, far) == CONTRADICTED
  assert outcome(morwani, 2, far) == FAILS  # optimal above Shampoo
  assert (
    outcome(
      morwani,
      0,
      kronecker_quality(
        {"shampoo": 0.9, "shampoo2": 0.5, "optimal_kronecker": 0.6},
        mode="fisher_empirical",
      ),
    )
    == NOT_AT_SCALE
  )


# --- no verdict from three samples --------------------------------------------


THREE_SAMPLE_RECORDS = [
  (cohen, 0, edge_runs(lambda t: 0.5 + 1.5 * min(t / 50, 1), seeds=[0])),
  (cohen, 1, edge_runs(lambda t: 0.5, seeds=[0])),
  (cohen, 2, edge_runs(lambda t: 2.0, seeds=[0])),
  (sagun, 0, ggn_runs(list(np.geomspace(1.0, 0.1, 10)), seeds=THREE)),
  (sagun, 1, ggn_runs([1.0], seeds=THREE)),
  (sagun, 2, ggn_runs([1.0], seeds=THREE, overlap=0.1)),
  (ghorbani, 0, hessian_runs({"batch": 100.0, "none": 2.0}, seeds=THREE)),
  (ghorbani, 1, hessian_runs({"batch": 100.0, "none": 2.0}, seeds=THREE)),
  (gurari, 0, subspace_runs(0.1, 0.1, seeds=THREE)),
  (gurari, 1, subspace_runs(0.99, 0.99, seeds=THREE)),
  (george, 0, quality(lambda *_: 1.5, seeds=THREE)),
  (
    george,
    1,
    ekfac_training({"kfac": [1.0, 1.1, 1.2], "ekfac": [5.0, 5.1, 5.2]}),
  ),
  (
    morwani,
    0,
    kronecker_quality(
      {"shampoo": 0.6, "shampoo2": 0.979, "optimal_kronecker": 0.98},
      seeds=THREE,
    ),
  ),
  (
    morwani,
    1,
    kronecker_quality(
      {"shampoo": 0.6, "shampoo2": 0.979, "optimal_kronecker": 0.98},
      seeds=THREE,
    ),
  ),
  (
    morwani,
    2,
    kronecker_quality(
      {"shampoo": 0.6, "shampoo2": 0.97, "optimal_kronecker": 0.5}, seeds=THREE
    ),
  ),
  (
    martens,
    0,
    tuned_training(
      {
        ("kfac", None): [1.0, 1.1, 1.2],
        ("sgd", 0.01): [5.0, 5.1, 5.2],
        ("adam", 0.001): [9.0, 9.1, 9.2],
      }
    ),
  ),
  (
    martens,
    1,
    tuned_training(
      {
        ("kfac", None): [1.0, 1.1, 1.2],
        ("sgd", 0.01): [5.0, 5.1, 5.2],
        ("adam", 0.001): [9.0, 9.1, 9.2],
      }
    ),
  ),
  (
    eschenhagen,
    0,
    reduce_runs(
      {"kfac": [1.0, 1.1, 1.2], "kfac_reduce": [0.1, 0.1, 0.1]},
      {"kfac": [100] * 3, "kfac_reduce": [100] * 3},
    ),
  ),
  (
    eschenhagen,
    1,
    reduce_runs(
      {"kfac": [1.0]}, {"kfac": [100, 110, 90], "kfac_reduce": [300, 300, 300]}
    ),
  ),
  (
    eschenhagen,
    2,
    reduce_runs(
      {"kfac": [1.0]},
      {"kfac": [100, 110, 90], "kfac_reduce": [100, 100, 100]},
      loss="sequence_softmax_cross_entropy",
    ),
  ),
]


@pytest.mark.parametrize("entry,claim,found", THREE_SAMPLE_RECORDS)
def test_three_samples_give_no_verdict(entry, claim, found):
  """Records of three seeds (Cohen: three runs), however clear, give no
  verdict; every claim of every entry is covered."""
  assert outcome(entry, claim, found) == TOO_FEW


def test_the_three_sample_records_cover_every_claim():
  covered = {(e.ENTRY.name, i) for e, i, _ in THREE_SAMPLE_RECORDS}
  claims = {
    (name, i)
    for name, entry in gallery.entries().items()
    for i, claim in enumerate(entry.claims)
    if not (name == "cohen2021_edge_of_stability" and i >= 3)  # the same checks
  }
  assert claims == covered


# --- the entries as presets, and run ------------------------------------------


def jobs(entry, size):
  return planning.union({}, entry.parts(size), [])


@pytest.mark.slow
def test_every_entry_composes_at_every_size_and_the_gallery_has_them_all():
  found = gallery.experiments()
  for experiment, size in (
    ("gallery", "cpu"),
    ("gallery_accelerator", "accelerator"),
  ):
    parts = found[experiment]["hydra"]["sweeper"]["sweeps"]
    for name, entry in gallery.entries().items():
      assert [p for p in parts if p["repro"] == name] == entry.parts(size)
  for name, entry in gallery.entries().items():
    assert {p["repro"] for p in entry.parts()} == {name}
    for size in entry.sizes:
      assert {p["repro_size"] for p in entry.parts(size)} == {size}
      for job in jobs(entry, size):
        config.compose(*job)  # checked: every key and value valid
  cfg = config.compose(
    "+experiment=repro_sagun2017_outliers", with_hydra=True, check=False
  )
  assert cfg.name == "repro_sagun2017_outliers"
  assert cfg.hydra.sweeper.sweeps[0].repro == "sagun2017_outliers"
  with pytest.raises(config.ConfigError, match="no gallery entry"):
    config.compose("repro=nobody")
  with pytest.raises(config.ConfigError, match="no gallery size"):
    config.compose("repro_size=huge")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(gallery.entries()))
def test_each_entry_at_its_tiny_size_is_judged_from_its_records(tmp_path, name):
  entry = gallery.entries()[name]
  for i, job in enumerate(jobs(entry, "tiny")):
    runs.run(config.compose(*job, "compilation_cache=null"), tmp_path / str(i))
  loaded = sweep.load_sweep(tmp_path)
  judged = page.judge(sweep.settings(loaded.runs), loaded.tables)
  assert [j.entry.name for j in judged] == [name]
  assert judged[0].sizes() == ["tiny"]
  for claim, found in judged[0].verdicts:
    assert "lack" not in found.evidence, (claim.statement, found.evidence)
    # One seed: never a verdict.
    assert found.outcome in NO_VERDICT, (claim.statement, found.outcome)
  text = page.write(tmp_path, tmp_path / "report", judged)[0].read_text()
  assert entry.title in text and entry.sizes["tiny"].runs in text
  assert all(found.outcome in text for _, found in judged[0].verdicts)
