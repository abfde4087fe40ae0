"""Every string option's allowed values, defined once.

The options (:mod:`kaisa.options`), the maths (:mod:`kaisa.curvature`), the
plan (:mod:`kaisa.distributed`), the command lines and the docs read these;
each ``Literal`` type and its tuple of values are the same list.
"""

from __future__ import annotations

from typing import Literal, get_args

ComputeMethod = Literal["eigen", "inverse"]
"""How a factor is solved: an eigendecomposition, or the damped inverse."""
COMPUTE_METHODS: tuple[ComputeMethod, ...] = get_args(ComputeMethod)

DampingMode = Literal["absolute", "relative"]
"""Damping added as is, or relative to each factor's mean eigenvalue."""
DAMPING_MODES: tuple[DampingMode, ...] = get_args(DampingMode)

FactorInit = Literal["identity", "first_batch"]
"""What the running averages start from."""
FACTOR_INITS: tuple[FactorInit, ...] = get_args(FactorInit)

ConvEstimator = Literal["expand", "reduce"]
"""Conv factors from every patch, or from per-sample patch means."""
CONV_ESTIMATORS: tuple[ConvEstimator, ...] = get_args(ConvEstimator)

AssignmentStrategy = Literal["compute", "memory"]
"""What the plan balances across ranks: decomposition time or memory."""
ASSIGNMENT_STRATEGIES: tuple[AssignmentStrategy, ...] = get_args(AssignmentStrategy)

EigenCorrection = Literal["off", "ekfac", "adam"]
"""Eigenvalue correction of exact layers: none, EKFAC's solve at the factors' trace, or
Adam's second moment in the eigenbasis."""
EIGEN_CORRECTIONS: tuple[EigenCorrection, ...] = get_args(EigenCorrection)

Grafting = Literal["off", "layer"]
"""Whether each layer's preconditioned gradient takes the raw gradient's norm."""
GRAFTINGS: tuple[Grafting, ...] = get_args(Grafting)

Profile = Literal["auto", "general", "language-model"]
"""Which defaults the options left 'auto' take: chosen from the model, or named."""
PROFILES: tuple[Profile, ...] = get_args(Profile)

NamedFraction = Literal["comm-opt", "hybrid-opt", "mem-opt"]
"""The gradient-worker fractions with names (KAISA's three strategies)."""
NAMED_FRACTIONS: tuple[NamedFraction, ...] = get_args(NamedFraction)
