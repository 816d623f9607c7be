"""KFAC-JAX's module name `loss_functions`: the losses of `estimators.losses`
and their registration functions."""

from estimators.losses import (
  CategoricalLogitsNegativeLogProbLoss,
  DistributionNegativeLogProbLoss,
  LossFunction,
  LossFunctionInputs,
  MultiBernoulliNegativeLogProbLoss,
  NaturalParamsNegativeLogProbLoss,
  NegativeLogProbLoss,
  NormalMeanNegativeLogProbLoss,
  NormalMeanVarianceNegativeLogProbLoss,
  OneHotCategoricalLogitsNegativeLogProbLoss,
  filter_none,
  insert_slice_in_zeros,
  register_categorical_predictive_distribution,
  register_multi_bernoulli_predictive_distribution,
  register_normal_predictive_distribution,
  register_sigmoid_cross_entropy_loss,
  register_softmax_cross_entropy_loss,
  register_squared_error_loss,
)

__all__ = [
  "CategoricalLogitsNegativeLogProbLoss",
  "DistributionNegativeLogProbLoss",
  "LossFunction",
  "LossFunctionInputs",
  "MultiBernoulliNegativeLogProbLoss",
  "NaturalParamsNegativeLogProbLoss",
  "NegativeLogProbLoss",
  "NormalMeanNegativeLogProbLoss",
  "NormalMeanVarianceNegativeLogProbLoss",
  "OneHotCategoricalLogitsNegativeLogProbLoss",
  "filter_none",
  "insert_slice_in_zeros",
  "register_categorical_predictive_distribution",
  "register_multi_bernoulli_predictive_distribution",
  "register_normal_predictive_distribution",
  "register_sigmoid_cross_entropy_loss",
  "register_softmax_cross_entropy_loss",
  "register_squared_error_loss",
]
