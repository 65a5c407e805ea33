"""Autotune (HOROVOD_AUTOTUNE=1): the runtime tunes its own settings while the job trains.

Tuned: the fusion threshold, the cycle time, DistributedOptimizer's gradient bucket size, the
response cache on or off, and, where there are several nodes, hierarchical allreduce and
allgather on or off.  As in Horovod a sample is a number of training steps
(HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE) at one setting, scored by the bytes reduced per second; the
first HOROVOD_AUTOTUNE_WARMUP_SAMPLES are not scored.  The first scored sample is the setting
the job started with; each next one is the candidate with the highest expected improvement under
a Gaussian process (scikit-learn's) fitted to the scores so far.  After
HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES samples the best setting seen is applied for good.

A step is one ``step()`` of a DistributedOptimizer, so every rank reaches a sample's end at the
same step.  There rank 0 scores the sample and proposes the next setting, and an engine request
(run at the same point of the same round on every rank) broadcasts it and applies it: every
rank changes at the same step, between steps, with nothing in flight.  Rank 0 logs each sample
to HOROVOD_AUTOTUNE_LOG (CSV).
"""
import csv
import logging
import math
import time
import warnings
from dataclasses import astuple, dataclass, fields, replace
from typing import List, Tuple

import numpy as np
import torch

log = logging.getLogger("horovod_ext")

# Ranges searched (log scale for sizes and times; the lowest 5% of a size's range means "off").
FUSION_RANGE = (16, 27)        # log2 bytes: 64 KiB .. 128 MiB
BUCKET_RANGE = (16, 26)        # log2 bytes: 64 KiB .. 64 MiB
FIRST_BUCKET_RANGE = (14, 24)  # log2 bytes: 16 KiB .. 16 MiB
CYCLE_RANGE_MS = (0.1, 25.0)
OFF_BELOW = 0.05
CANDIDATES = 2000              # random candidates scored by expected improvement per proposal


@dataclass(frozen=True)
class Setting:
    fusion_threshold: int
    cycle_time_ms: float
    gradient_bucket_bytes: int
    first_bucket_bytes: int
    cache: bool
    hierarchical_allreduce: bool
    hierarchical_allgather: bool

    def to_tensor(self, frozen: bool) -> torch.Tensor:
        return torch.tensor([float(v) for v in astuple(self)] + [float(frozen)],
                            dtype=torch.float64)

    @classmethod
    def empty_tensor(cls) -> torch.Tensor:
        """What ``to_tensor`` fills: a receive buffer of its size."""
        return torch.zeros(len(fields(cls)) + 1, dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor):
        v = t.tolist()
        return (cls(int(v[0]), v[1], int(v[2]), int(v[3]), bool(v[4]), bool(v[5]), bool(v[6])),
                bool(v[7]))

    @classmethod
    def of(cls, config, comms) -> "Setting":
        return cls(config.fusion_threshold, config.cycle_time_ms, config.gradient_bucket_bytes,
                   config.first_bucket_bytes, config.cache_capacity > 0, comms.hierarchical_allreduce,
                   comms.hierarchical_allgather)


def _size(x: float, lo: int, hi: int) -> int:
    if x < OFF_BELOW:
        return 0
    return int(2 ** (lo + (hi - lo) * (x - OFF_BELOW) / (1 - OFF_BELOW)))


def _unsize(v: int, lo: int, hi: int) -> float:
    if v <= 0:
        return 0.0
    return OFF_BELOW + (1 - OFF_BELOW) * min(max((math.log2(v) - lo) / (hi - lo), 0.0), 1.0)


class Space:
    """Settings as points of [0, 1]^d (d = 5, or 7 where hierarchy applies)."""

    def __init__(self, hierarchy: bool, start: Setting):
        self.hierarchy = hierarchy
        self.start = start
        self.dims = 7 if hierarchy else 5

    def setting(self, x) -> Setting:
        lo, hi = CYCLE_RANGE_MS
        return Setting(
            fusion_threshold=_size(x[0], *FUSION_RANGE),
            cycle_time_ms=round(lo * (hi / lo) ** float(x[1]), 3),
            gradient_bucket_bytes=_size(x[2], *BUCKET_RANGE),
            first_bucket_bytes=_size(x[3], *FIRST_BUCKET_RANGE),
            cache=bool(x[4] >= 0.5),
            hierarchical_allreduce=bool(x[5] >= 0.5) if self.hierarchy
            else self.start.hierarchical_allreduce,
            hierarchical_allgather=bool(x[6] >= 0.5) if self.hierarchy
            else self.start.hierarchical_allgather)

    def point(self, s: Setting) -> np.ndarray:
        lo, hi = CYCLE_RANGE_MS
        cycle = min(max(s.cycle_time_ms, lo), hi)
        x = [_unsize(s.fusion_threshold, *FUSION_RANGE), math.log(cycle / lo) / math.log(hi / lo),
             _unsize(s.gradient_bucket_bytes, *BUCKET_RANGE),
             _unsize(s.first_bucket_bytes, *FIRST_BUCKET_RANGE), float(s.cache)]
        if self.hierarchy:
            x += [float(s.hierarchical_allreduce), float(s.hierarchical_allgather)]
        return np.array(x)

    def random(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.random((n, self.dims))
        x[:, 4:] = np.round(x[:, 4:])   # on/off dimensions take their two values only
        return x


class BayesianProposer:
    """Expected improvement under a Gaussian process (scikit-learn) fitted to the scores so
    far, each divided by the best, with ``noise`` as the observations' variance."""

    def __init__(self, space: Space, noise: float, seed: int = 0):
        try:
            from sklearn.gaussian_process import GaussianProcessRegressor
            from sklearn.gaussian_process.kernels import ConstantKernel, Matern
        except ImportError as exc:
            raise ImportError("HOROVOD_AUTOTUNE=1 needs scikit-learn: "
                              "pip install 'horovod_ext[autotune]'") from exc
        self._gp = lambda: GaussianProcessRegressor(
            kernel=ConstantKernel(1.0, (1e-2, 1e2)) * Matern(length_scale=0.3,
                                                             length_scale_bounds=(0.05, 3.0),
                                                             nu=2.5),
            alpha=noise, normalize_y=False, random_state=seed)
        self.space = space
        self.rng = np.random.default_rng(seed)

    def propose(self, xs: List[np.ndarray], scores: List[float]) -> np.ndarray:
        from scipy.stats import norm
        best = max(scores)
        y = np.array(scores) / best
        gp = self._gp()
        with warnings.catch_warnings():   # a length scale at its bound is no news here
            warnings.simplefilter("ignore")
            gp.fit(np.array(xs), y)
        candidates = self.space.random(self.rng, CANDIDATES)
        mu, sigma = gp.predict(candidates, return_std=True)
        sigma = np.maximum(sigma, 1e-9)
        gain = mu - 1.0 - 0.01
        z = gain / sigma
        ei = gain * norm.cdf(z) + sigma * norm.pdf(z)
        return candidates[int(np.argmax(ei))]


class Autotuner:
    """The tuning state of one rank; rank 0 scores and proposes (``conclude_sample``)."""

    def __init__(self, config, start: Setting, hierarchy: bool, rank: int):
        self.rank = rank
        self.warmup = config.autotune_warmup_samples
        self.steps_per_sample = config.autotune_steps_per_sample
        self.max_samples = config.autotune_bayes_opt_max_samples
        self.space = Space(hierarchy, start)
        self.proposer = BayesianProposer(self.space, config.autotune_gaussian_process_noise) \
            if rank == 0 else None
        self.log_path = config.autotune_log if rank == 0 else None
        self.current = start
        self.frozen = False
        self.samples = 0            # samples finished, warm-up included
        self.xs: List[np.ndarray] = []
        self.scores: List[float] = []
        self.settings: List[Setting] = []
        self._steps = 0
        self._bytes = 0
        self._since = time.perf_counter()
        if self.log_path:
            with open(self.log_path, "w", newline="") as f:
                csv.writer(f).writerow(["sample", "phase"] + [f.name for f in fields(Setting)]
                                       + ["bytes_per_second"])

    def count_step(self, nbytes: int) -> bool:
        """A training step that reduced ``nbytes`` is done; True when it ends a sample."""
        self._steps += 1
        self._bytes += nbytes
        return self._steps >= self.steps_per_sample

    def conclude_sample(self) -> Tuple[Setting, bool]:
        """Rank 0: score the sample just finished and choose the setting of the next one, or
        the best seen after the last (then with True: keep it for good)."""
        elapsed = max(time.perf_counter() - self._since, 1e-9)
        score = self._bytes / elapsed
        scored = self.samples >= self.warmup
        self._log("warmup" if not scored else "sample", self.current, score)
        if scored:
            self.xs.append(self.space.point(self.current))
            self.scores.append(score)
            self.settings.append(self.current)
        if len(self.scores) >= self.max_samples:
            best = self.settings[int(np.argmax(self.scores))]
            self._log("best", best, max(self.scores))
            return best, True
        if not self.scores:
            return self.current, False
        return self.space.setting(self.proposer.propose(self.xs, self.scores)), False

    def begin_sample(self, setting: Setting, frozen: bool):
        """Every rank, once the setting of the next sample is applied."""
        self.current, self.frozen = setting, frozen
        self.samples += 1
        self._steps = self._bytes = 0
        self._since = time.perf_counter()
        if frozen and self.rank == 0:
            log.info("autotune: settled on %s after %d samples", setting, self.samples)

    def _log(self, phase: str, s: Setting, score: float):
        if self.log_path:
            with open(self.log_path, "a", newline="") as f:
                csv.writer(f).writerow([self.samples, phase] + list(astuple(s))
                                       + [f"{score:.1f}"])


def apply(setting: Setting, engine, state) -> None:
    """Make ``setting`` the world engine's (on its thread, at the same point on every rank).
    Process sets keep their own settings: their engines run their own rounds."""
    old = engine.config
    capacity = (old.cache_capacity or type(old).cache_capacity) if setting.cache else 0
    config = replace(old, fusion_threshold=setting.fusion_threshold,
                     cycle_time_ms=setting.cycle_time_ms,
                     gradient_bucket_bytes=setting.gradient_bucket_bytes,
                     first_bucket_bytes=setting.first_bucket_bytes,
                     cache_capacity=capacity,
                     hierarchical_allreduce=setting.hierarchical_allreduce,
                     hierarchical_allgather=setting.hierarchical_allgather)
    engine.reconfigure(config)
    engine.comms.hierarchical_allreduce = setting.hierarchical_allreduce
    engine.comms.hierarchical_allgather = setting.hierarchical_allgather
    state.config = config
