"""Autotune (horovod_ext/autotune.py): every rank applies the same setting at the same step,
tuning changes no result, the log records every sample, and the Bayesian search finds good
settings of a known score surface."""
import csv
import math

import numpy as np
import pytest
import torch

from tests.harness import BACKENDS, run_ranks

pytestmark = pytest.mark.timeout(180)

BAD = {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "20",
       "HOROVOD_GRADIENT_BUCKET_BYTES": "0"}
STEPS = 30


def body_train():
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    data = torch.Generator().manual_seed(hvd.rank())
    history = []
    for _ in range(STEPS):
        x = torch.randn(16, 20, generator=data)
        y = torch.randint(0, 4, (16,), generator=data)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        config, engine = runtime.state.config, runtime.engine()
        tuner = runtime.state.autotuner
        history.append((config.fusion_threshold, config.cycle_time_ms,
                        config.gradient_bucket_bytes, engine.config.cache_capacity,
                        engine._cycle_s, opt._hvd.plan.bucket_cap,
                        len(getattr(opt._hvd.reducer, "buckets", ())),
                        None if tuner is None else tuner.frozen,
                        engine.comms.hierarchical_allreduce, engine.comms.hierarchical_allgather))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return history, params


def body_tuned_then_plain(untuned_env):
    """``body_train`` tuned (as the launch's environment says), then, in the same processes
    re-initialised with ``untuned_env`` instead of the autotune variables, untuned: the
    reference run, without a second launch of every rank."""
    import os
    import horovod_ext.torch as hvd
    tuned = body_train()
    hvd.shutdown()
    for key in [k for k in os.environ if k.startswith("HOROVOD_AUTOTUNE")]:
        del os.environ[key]
    os.environ.update(untuned_env)
    hvd.init()
    return tuned, body_train()


def _split(results):
    """Per-rank (tuned, plain) results as two lists; the plain run must not have been tuned:
    no autotuner, and the launch's settings at every step."""
    tuned, plain = [t for t, _ in results], [p for _, p in results]
    for history, _ in plain:
        assert all(h[7] is None for h in history), "the reference run was tuned"
        assert {h[:3] for h in history} == {(0, 20.0, 0)}, "the reference run's settings moved"
    return tuned, plain


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_rank_takes_each_setting_at_the_same_step_and_results_do_not_change(backend,
                                                                                  tmp_path):
    log_path = str(tmp_path / "autotune.csv")
    env = dict(BAD, HOROVOD_AUTOTUNE="1", HOROVOD_AUTOTUNE_LOG=log_path,
               HOROVOD_AUTOTUNE_WARMUP_SAMPLES="1", HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE="3",
               HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES="6")
    # tuned, then (the same processes re-initialised without the autotune variables) plain
    tuned, plain = _split(run_ranks(body_tuned_then_plain, 2, backend, env=env, args=(BAD,)))
    histories = [h for h, _ in tuned]
    assert histories[0] == histories[1]            # the same setting at every step everywhere
    settings = {h[:6] for h in histories[0]}
    assert len(settings) > 2                       # it did try other settings
    assert histories[0][-1][7] is True             # and settled (1 + 6 samples of 3 steps)
    settled = [h for h in histories[0] if h[7]]
    assert len({h[:7] for h in settled}) == 1      # nothing changes once settled
    for h in histories[0]:                         # the engine and optimizer follow the config
        assert math.isclose(h[4], h[1] / 1000.0)
        assert h[5] == min(h[0], h[2]) and (h[6] > 0) == (h[5] > 0)
    # tuning changes how, never what: the parameters equal those of an untuned run
    for (_, params), (_, reference) in zip(tuned, plain):
        assert torch.equal(params, reference)

    with open(log_path) as f:
        rows = list(csv.DictReader(f))
    assert [r["phase"] for r in rows] == ["warmup"] + ["sample"] * 6 + ["best"]
    assert rows[1]["fusion_threshold"] == "0" and rows[1]["cycle_time_ms"] == "20.0"
    samples = rows[1:7]
    best = max(samples, key=lambda r: float(r["bytes_per_second"]))
    keys = ["fusion_threshold", "cycle_time_ms", "gradient_bucket_bytes"]
    assert [rows[-1][k] for k in keys] == [best[k] for k in keys]
    final = histories[0][-1]
    assert [str(final[0]), repr(final[1]), str(final[2])] == [best[k] for k in keys]


def test_hierarchy_is_tuned_where_there_are_nodes():
    """2 pretend nodes of 2 ranks: hierarchical allreduce and allgather join the search, and
    switching them between steps keeps every rank in step and the results those of a plain run
    (to rounding: hierarchical sums add in another order)."""
    env = dict(BAD, HOROVOD_AUTOTUNE="1", HOROVOD_AUTOTUNE_WARMUP_SAMPLES="0",
               HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE="2", HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES="10")
    nodes = ["node-a", "node-a", "node-b", "node-b"]
    tuned, plain = _split(run_ranks(body_tuned_then_plain, 4, "gloo", env=env, args=(BAD,),
                                    hostnames=nodes, timeout=150))
    histories = [h for h, _ in tuned]
    assert all(h == histories[0] for h in histories)
    assert {h[8] for h in histories[0]} == {False, True}    # hierarchical allreduce off and on
    for (_, params), (_, reference) in zip(tuned, plain):
        assert torch.allclose(params, reference, rtol=1e-5, atol=1e-6)


def test_bayesian_search_finds_the_best_region_of_a_known_surface():
    """A score surface like a real one (short cycles, fusion and buckets on, cache on help),
    searched with the default budget: the best setting found scores within 5% of the optimum."""
    from horovod_ext.engine.autotune import BayesianProposer, Setting, Space

    def score(s: Setting) -> float:
        cycle_cost = 0.002 * s.cycle_time_ms            # waits per step
        calls = 1 if s.gradient_bucket_bytes >= (1 << 20) else (3 if s.fusion_threshold else 6)
        return 1.0 / (0.02 + cycle_cost + 0.001 * calls + (0.0 if s.cache else 0.0005))

    start = Setting(0, 20.0, 0, 0, True, False, False)
    space = Space(False, start)
    optimum = max(score(space.setting(x)) for x in space.random(np.random.default_rng(1), 20000))
    proposer = BayesianProposer(space, noise=0.8, seed=0)
    xs, scores, current = [], [], start
    for _ in range(20):
        xs.append(space.point(current))
        scores.append(score(current))
        current = space.setting(proposer.propose(xs, scores))
    assert max(scores) >= 0.95 * optimum, (max(scores), optimum)
    assert scores[0] < 0.5 * optimum             # it started far from it


def test_settings_travel_as_tensors_and_points():
    from horovod_ext.engine.autotune import Setting, Space
    s = Setting(1 << 20, 2.5, 1 << 22, 1 << 18, False, True, False)
    assert Setting.from_tensor(s.to_tensor(True)) == (s, True)
    space = Space(True, s)
    back = space.setting(space.point(s))
    assert back.cache is False and back.hierarchical_allreduce is True
    assert abs(math.log2(back.fusion_threshold) - 20) < 0.01
    assert abs(back.cycle_time_ms - 2.5) < 0.01
    assert space.setting(space.point(Setting(0, 1.0, 0, 0, True, False, False))).fusion_threshold == 0


def test_bad_autotune_variables_are_named():
    from horovod_ext.config import Config, ConfigError
    with pytest.raises(ConfigError, match="HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE='0'"):
        Config.from_env({"HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "0"})
    with pytest.raises(ConfigError, match="HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"):
        Config.from_env({"HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "-1"})
    with pytest.raises(ConfigError, match="HOROVOD_AUTOTUNE="):
        Config.from_env({"HOROVOD_AUTOTUNE": "maybe"})
